"""ds3d's checkpoint storage and commit layer.

    errors       ds3d's one error hierarchy (`Ds3dError`...), imported by every layer
    layout       object keys and local marker paths (the contract with trainer and daemon)
    storage      the `Storage` protocol and `open_storage(url)`
    file_storage `FileStorage` (file://), atomic writes
    s3_storage   `S3Storage` (s3://) via boto3, with the one botocore-error classifier
    manifest     `Manifest`, per-rank parts, sha256, local verification
    hashing_writer  a file's sha256 and piece hashes taken while torch.save writes it
    upload       per-rank upload, the committer, the background `Uploader`, and a CLI
    catalog      list / verify / delete / newest restorable checkpoint, retention applied
    retention    `plan_retention`: which committed steps to delete
    settings     `CheckpointSettings`: what a worker's checkpointing reads of its job
    engine_io    a worker's save (snapshot, upload, commit) and collective restore
    recovery_scripts  DeepSpeed's zero_to_fp32.py copies: once, never failing a save
    logs         structlog set-up of the workers and the uploader process

This package imports neither the trainer nor the daemon: it takes an engine and its own
settings, and the export, which needs the model, is the trainer's (trainer/export.py).

Submodules are imported explicitly (`from ds3d.checkpoints.upload import Uploader`): importing
this package loads neither boto3 nor pydantic.
"""
