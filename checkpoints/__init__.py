"""ds3d's checkpoint storage and commit layer.

    layout       object keys and local marker paths (the contract with trainer and daemon)
    storage      the `Storage` protocol and `open_storage(url)`
    file_storage `FileStorage` (file://), atomic writes
    s3_storage   `S3Storage` (s3://) via boto3, with the one botocore-error classifier
    manifest     `Manifest`, per-rank parts, sha256, local verification
    upload       per-rank upload, the committer, the background `Uploader`, and a CLI
    catalog      list / verify / delete / newest restorable checkpoint, retention applied
    retention    `plan_retention`: which committed steps to delete

Submodules are imported explicitly (`from ds3d.checkpoints.upload import Uploader`): importing
this package loads neither boto3 nor pydantic.
"""
