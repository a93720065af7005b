"""The job configuration: one schema shared by ds3dctl, ds3dd and the trainer.

A job is described by a TOML file or a preset name, plus `--set key=value` overrides. It is
validated twice (types and ranges by pydantic; combinations by `validate_job`) before any process
starts, and every refusal names the field, the value, why, and what to use instead.

This module imports pydantic and the standard library only, so `ds3dctl` starts fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import reprlib
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from .errors import ConfigError
from .presets import PRESETS

if TYPE_CHECKING:
    from ds3d.checkpoints.settings import CheckpointSettings

# A job name names a folder, a store prefix and a database row: 1-63 characters of a-z, 0-9,
# '.', '_', '-', the first a letter or digit. Always test it with `valid_job_name` (fullmatch):
# `re.match` with `$` accepts a trailing newline ("nl\n" would share the prefix of "nl").
JOB_NAME_PATTERN = r"[a-z0-9][a-z0-9._-]{0,62}"
JOB_NAME_RE = re.compile(rf"\A{JOB_NAME_PATTERN}\Z")
JOB_NAME_RULE = ("1-63 characters of a-z, 0-9, '.', '_' or '-', starting with a letter or digit "
                 "(it names a folder and a store prefix, so no '/', '..', spaces or newlines)")
MAX_TEXT_CHARS = 4096  # any string setting (paths, URLs, hosts)
# Why a ds3dd job's paths are absolute: a relative one would name a different file for each reader
RELATIVE_PATH_WHY = ("ds3dctl reads it from your folder, ds3dd from its own and the workers from "
                     "the job's run directory, so a relative path names a different file for each")

# Upper bounds (docs/configuration.md lists every range): generous for the largest jobs run
# today, small enough that every product the daemon computes fits int64 (and the proto's int32
# degrees), and that a typo (steps = 10**12) is refused instead of accepted.
MAX_STEPS = 10**9
MAX_BATCH_INDEX = 10**15


def valid_job_name(name: str) -> bool:
    return JOB_NAME_RE.fullmatch(name) is not None


def is_readable_file(path: str) -> bool:
    """`Path.is_file` that answers False instead of raising for a name too long, a folder it
    may not enter and the like (a request's path is untrusted input)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def _plain_text(value: Any) -> None:
    """Strings in a job are one line of printable text of bounded length: a control character
    (newline, NUL, escape) in a path or host is a mistake or an attack, never meant."""
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise ValueError(f"is {len(value)} characters long; at most {MAX_TEXT_CHARS}")
        bad = next((c for c in value if ord(c) < 32 or 127 <= ord(c) < 160
                    or 0xD800 <= ord(c) < 0xE000), None)
        if bad is not None:
            what = "an unpaired surrogate" if ord(bad) >= 0xD800 else "the control character"
            raise ValueError(f"contains {what} U+{ord(bad):04X}; settings are one line of "
                             "printable text")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _plain_text(item)


class _Section(BaseModel):
    """Strict at the boundary: no number from a string or a bool (`tp = true`, `steps = "10"`),
    no NaN or infinity in any float, no control character in any string, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True,
                              allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _text_is_plain(cls, v: Any) -> Any:
        _plain_text(v)
        return v


# Pairs come as TOML/JSON arrays (lists): the tuple is lax about that, its items stay strict.
Beta = Annotated[float, Strict(), Field(ge=0, lt=1)]
BatchIndex = Annotated[int, Strict(), Field(ge=0, le=MAX_BATCH_INDEX)]


class ModelConfig(_Section):
    """A decoder-only GPT: pre-LayerNorm blocks, causal SDPA attention with rotary positions,
    GELU MLP, untied input embedding and output head (untied so that the first and last pipeline
    stages share no weight and need no tied-gradient all-reduce)."""

    vocab_size: int = Field(gt=0, le=1 << 22,
                            description="token vocabulary size (padded to a multiple of TP)")
    d_model: int = Field(gt=0, le=65536, description="hidden size")
    n_layers: int = Field(gt=0, le=1024, description="transformer blocks")
    n_heads: int = Field(gt=0, le=1024, description="attention heads")
    seq_len: int = Field(gt=1, le=1 << 20, description="tokens per sample")
    d_ff: int | None = Field(default=None, gt=0, le=1 << 18,
                             description="MLP width; default 4 * d_model")
    layer_d_ff: list[Annotated[int, Field(gt=0, le=1 << 18)]] | None = Field(
        default=None, max_length=1024,
        description="per-block MLP widths (uneven models); overrides d_ff")
    rope_theta: float = Field(default=10000.0, gt=0, le=1e12)
    norm_eps: float = Field(default=1e-5, gt=0, le=1)
    init_std: float = Field(default=0.02, gt=0, le=10)

    @property
    def ffn_width(self) -> int:
        return self.d_ff or 4 * self.d_model

    def block_ffn_widths(self) -> list[int]:
        return list(self.layer_d_ff) if self.layer_d_ff else [self.ffn_width] * self.n_layers

    def n_params(self) -> int:
        """Parameters of the whole (unsharded) model."""
        d, v = self.d_model, self.vocab_size
        blocks = sum(4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d for f in self.block_ffn_widths())
        return v * d + blocks + 2 * d + d * v


class ZeroOptions(_Section):
    """DeepSpeed's ZeRO tuning options (`zero_optimization.*` of its JSON), passed to DeepSpeed
    as given; unset = DeepSpeed's default. They change speed and memory, never the math."""

    allgather_partitions: bool | None = None
    allgather_bucket_size: int | None = Field(default=None, gt=0, le=1 << 40)
    overlap_comm: bool | None = None
    reduce_scatter: bool | None = None
    reduce_bucket_size: int | None = Field(default=None, gt=0, le=1 << 40)
    contiguous_gradients: bool | None = None
    round_robin_gradients: bool | None = None
    stage3_prefetch_bucket_size: int | None = Field(default=None, ge=0, le=1 << 40)
    stage3_param_persistence_threshold: int | None = Field(default=None, ge=0, le=1 << 40)
    stage3_max_live_parameters: int | None = Field(default=None, ge=0, le=1 << 40)
    stage3_max_reuse_distance: int | None = Field(default=None, ge=0, le=1 << 40)
    stage3_gather_16bit_weights_on_model_save: bool | None = None
    # elements per optimizer sub-group: larger than the model = one group (Hugging Face's
    # ZeRO-3 config writes 1e14)
    sub_group_size: int | None = Field(default=None, gt=0, le=1 << 62)


class ParallelConfig(_Section):
    tp: int = Field(default=1, ge=1, le=64, description="tensor-parallel degree (within a node)")
    pp: int = Field(default=1, ge=1, le=1024, description="pipeline stages")
    dp: int = Field(default=1, ge=1, le=65536, description="data-parallel replicas")
    zero_stage: int = Field(default=1, ge=0, le=3, description="ZeRO stage; 0/1 with PP > 1")
    partition_method: Literal["parameters", "uniform", "measured"] | list[
            Annotated[int, Field(ge=1, le=1024)]] = Field(
        default="parameters", max_length=1024,
        description="how blocks are split into stages: by parameter count, uniformly, an "
        "explicit list of blocks per stage, e.g. [3, 4, 5], or \"measured\": start by parameter "
        "count, time every layer over the first steps, and restart once (checkpoint, new "
        "boundaries) if the measured split's slowest stage is faster by more than "
        "partition_threshold (see docs/pipeline-partition.md)")
    partition_profile_steps: int = Field(
        default=3, ge=1, le=100, description="steps timed with layer hooks per profile (after "
        "one warm-up step and 2 unhooked calibration steps); measured partition and `ds3dctl "
        "rebalance`")
    partition_threshold: float = Field(
        default=0.05, ge=0, lt=1, description="re-partition only if the measured split's slowest "
        "stage is faster than the current one's by more than this share")
    partition_memory_gb: float | None = Field(
        default=None, gt=0, le=1e6, description="memory limit per stage for the measured split, "
        "GiB (default: 90% of the GPU's memory; no limit on CPU)")
    activation_checkpoint_interval: int = Field(
        default=0, ge=0, le=1024, description="recompute activations every N layers (0 = off)")
    zero_options: ZeroOptions = Field(
        default_factory=ZeroOptions, description="DeepSpeed ZeRO bucket/overlap options")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


class TrainConfig(_Section):
    steps: int = Field(default=100, gt=0, le=MAX_STEPS,
                       description="optimizer steps in the whole job")
    micro_batch_size: int = Field(default=1, gt=0, le=65536,
                                  description="samples per micro-batch per DP rank")
    global_batch_size: int | None = Field(
        default=None, gt=0, le=1 << 24,
        description="samples per optimizer step, all DP ranks together")
    grad_accum_steps: int | None = Field(
        default=None, gt=0, le=65536,
        description="micro-batches per step per DP rank (derived if unset)")
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    timing_interval: int = Field(
        default=50, ge=0, le=MAX_STEPS, description="measure where the step time goes (forward, "
        "backward, optimizer, pipeline wait, DP reduction) on step 2 and every N steps; 0 = off")
    lr: float = Field(default=3e-4, gt=0, le=10)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="final LR as a share of lr")
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    betas: Annotated[tuple[Beta, Beta], Strict(False)] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0, le=1)
    grad_clip: float = Field(default=1.0, ge=0, le=1e6,
                             description="max global grad norm (0 = off)")
    seed: int = Field(default=1234, ge=0, le=2**32 - 1)
    initial_scale_power: int = Field(default=16, ge=0, le=32, description="fp16: initial 2**N")
    loss_scale_window: int = Field(default=1000, gt=0, le=10**6,
                                   description="fp16: steps before raising")
    hysteresis: int = Field(default=2, ge=1, le=1000, description="fp16: overflows before lowering")
    min_loss_scale: float = Field(default=1.0, gt=0, le=2.0**32)
    compile: bool = Field(default=False, description="torch.compile the blocks (GPU)")
    steps_per_print: int = Field(
        default=0, ge=0, le=MAX_STEPS, description="DeepSpeed's own progress line in the "
        "worker logs every N steps (0 = off; ds3d reports every step itself)")
    deepspeed_config: str | None = Field(
        default=None, description="path of a DeepSpeed JSON, translated into these fields when "
        "the job is built (trainer/ds_config_import.py; docs/configuration.md)")

    def grad_accum(self, dp: int) -> int:
        """Micro-batches per step; the global batch stays fixed when DP changes (elastic)."""
        if self.grad_accum_steps is not None:
            return self.grad_accum_steps
        if self.global_batch_size is None:
            return 1
        return max(1, self.global_batch_size // (self.micro_batch_size * dp))

    def global_batch(self, dp: int) -> int:
        return self.global_batch_size or self.micro_batch_size * self.grad_accum(dp) * dp


class IndexedSource(_Section):
    """One Megatron indexed dataset (PREFIX.bin + PREFIX.idx) of a blend."""

    prefix: str = Field(description="absolute path without the .bin/.idx suffix, as "
                        "Megatron's --data-path takes it")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                          description="share of samples drawn from it (normalised over the blend)")


class DataConfig(_Section):
    source: str = Field(
        default="synthetic", description='"synthetic", a path to a flat token file (.bin), or '
        '"indexed": the Megatron indexed datasets listed in data.blend')
    dtype: Literal["uint16", "uint32"] = Field(
        default="uint16", description="token type of a flat .bin (indexed datasets say theirs)")
    blend: list[IndexedSource] = Field(
        default_factory=list, description='source = "indexed": the datasets and their weights')
    document_boundaries: Literal["cross", "start"] | None = Field(
        default=None, description='source = "indexed": "cross" (default) cuts samples anywhere '
        "in the concatenated documents, as Megatron's GPTDataset does; \"start\" begins every "
        "sample at a document start")
    tokenizer: str | None = Field(
        default=None, description="the tokenizer the data was made with (tokenizer.json file or "
        "Hugging Face tokenizer folder, absolute path): its vocabulary must fit "
        "model.vocab_size, and `ds3dctl export --format hf` ships it")
    skip_batches: list[Annotated[tuple[BatchIndex, BatchIndex], Strict(False)]] = Field(
        default_factory=list, max_length=10000, description="half-open ranges [start, end) of "
        "batch indices never trained on (set by NaN recovery)")


class S3TransferConfig(_Section):
    """How the job's workers move checkpoints to an `s3://` store; unset fields fall back to the
    `DS3D_S3_*` environment of ds3dd (the same names, upper case), then to the built-in
    defaults (checkpoints/s3_storage.py: options_from_settings). Credentials and endpoints never
    come from here (the daemon's environment)."""

    multipart_threshold_mib: float | None = Field(
        default=None, gt=0, le=5 << 20,
        description="files from this size up are resumable multipart uploads")
    multipart_chunksize_mib: float | None = Field(
        default=None, ge=5, le=5120, description="part size (S3's minimum is 5 MiB)")
    max_concurrency: int | None = Field(default=None, ge=1, le=1024,
                                        description="parts in flight per file")
    max_bandwidth_mib: float | None = Field(
        default=None, ge=0, le=1e6, description="MiB/s per rank, 0 = unlimited")
    max_attempts: int | None = Field(default=None, ge=1, le=100,
                                     description="botocore attempts per request")
    outage_retries: int | None = Field(
        default=None, ge=0, le=1000,
        description="whole-operation retries (backoff) through an outage")


class CheckpointConfig(_Section):
    interval: Annotated[int, Field(ge=0, le=10**9)] | Literal["auto"] = Field(
        default=0, description='save every N steps (0 = only on demand), or "auto": every '
        "sqrt(2 * save cost * MTBF) seconds (Young-Daly; trainer/checkpoint_interval.py)")
    memory_interval: Annotated[int, Field(ge=0, le=10**9)] | Literal["auto"] = Field(
        default=0, description="take a memory-only snapshot every N steps "
        "between durable saves (0 = none): held in host memory and node memory (/dev/shm), "
        "never written, so a NaN or spike rollback or a crash restart loses at most N steps "
        "instead of a whole interval; costs a second snapshot arena (2x this rank's state in "
        "host memory and /dev/shm). Smaller than an integer interval; skipped with "
        'data-parallel size > 1 (checkpoints/snapshot.py). "auto": every sqrt(2 * snapshot '
        "cost * MTBF) seconds, at least one step, at most the durable interval (Young-Daly "
        "with the measured blocked time of a memory-only snapshot and the MTBF of "
        'interval = "auto"; trainer/checkpoint_interval.py)')
    auto_mtbf_prior_hours: float = Field(
        default=6.0, gt=0, le=10**5, allow_inf_nan=False, description='interval = "auto": the '
        "mean time between failures assumed before any is observed (counts as one failure in "
        "this many hours of running)")
    auto_initial_save_cost_s: float = Field(
        default=30.0, gt=0, le=86400, allow_inf_nan=False, description='interval = "auto": the '
        "save cost (blocked + time to commit) assumed until the first save has committed")
    local_dir: str | None = Field(default=None, description="node-local tier; default JOB_DIR/ckpt")
    store: str | None = Field(default=None, description='durable tier: "file:///p" or "s3://b/p"')
    keep_last: int = Field(default=3, ge=1, le=10000)
    keep_every: int = Field(default=0, ge=0, le=MAX_STEPS,
                            description="also keep every Nth step (0 = none)")
    cleanup_grace_s: float = Field(
        default=3600.0, ge=0, le=2592000, allow_inf_nan=False, description="seconds before the "
        "leftovers of interrupted saves (uncommitted steps older than the newest commit, "
        "temporary files, unfinished multipart uploads) are removed (checkpoints/catalog.py)")
    store_wait_s: float = Field(
        default=300.0, ge=0, le=604800, allow_inf_nan=False, description="seconds the workers "
        "wait at their end (complete, pause, stop, planned restart) for their newest checkpoint "
        "to be durable; past it they exit, freeing the devices, and the daemon uploads and "
        "commits what is left (daemon/backlog_upload.py) before the job ends")
    load: bool = Field(default=True, description="resume from the newest complete checkpoint")
    keep_in_node_memory: bool | Literal["auto"] = Field(
        default="auto", description='keep the newest save\'s host copy in node memory '
        '(/dev/shm), so that a worker restarted after a crash restores from it: "auto" where '
        "/dev/shm is a tmpfs with room (else process memory, one log line says why), true "
        "(the same, but a start without room fails), false (process memory only; "
        "checkpoints/node_memory.py)")
    s3: S3TransferConfig = Field(default_factory=S3TransferConfig,
                                 description="transfer settings for an s3:// store")


class FaultsConfig(_Section):
    """What the trainer does when a step goes bad. Every rank decides the same (one all-reduce)."""

    nan_policy: Literal["rollback", "pause", "alert"] = Field(
        default="rollback", description="on NaN/Inf loss or gradient norm: recover in-process "
        "(undo the step in place when every optimizer skipped its update, else reload the "
        "newest checkpoint) and skip the bad data window, pause the job, or only report")
    skip_batches: int = Field(default=1, ge=0, le=10**6, description="batches skipped on a "
                              "recovery, ending with the one that failed (0: trained again; "
                              "above 1 always a rollback)")
    lr_factor: float = Field(default=1.0, gt=0, le=1, description="multiply the LR by this on "
                             "every recovery from a bad step (1 = unchanged)")
    fp16_max_skipped_steps: int = Field(default=20, ge=0, le=10**6, description="fp16: "
                                        "consecutive overflow-skipped steps tolerated before a "
                                        "rollback")
    max_rollbacks: int = Field(default=3, ge=1, le=1000, description="recoveries from bad steps "
                               "(rollbacks or steps undone in place) allowed within "
                               "rollback_window_steps before the job pauses instead")
    rollback_window_steps: int = Field(default=1000, ge=1, le=MAX_STEPS)
    spike_policy: Literal["off", "alert", "rollback"] = Field(
        default="alert", description="on a loss spike: nothing, report it, or treat it as NaN")
    spike_window: int = Field(default=50, ge=5, le=100_000,
                              description="steps of loss history for the median")
    spike_mads: float = Field(default=6.0, gt=0, le=1e6, description="a spike is a loss above "
                              "the running median by this many median absolute deviations")
    spike_patience: int = Field(default=3, ge=1, le=10_000,
                                description="... for this many steps in a row")
    spike_min_rise: float = Field(default=0.1, ge=0, le=100, description="... and by at least "
                                  "this fraction of the median (a smooth, converged loss has a "
                                  "tiny MAD, and k of them are ordinary noise)")


ETCD_SCHEME = "etcd://"
MAX_ETCD_ENDPOINTS = 16
_ETCD_HOST_RE = re.compile(
    r"\A(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)\Z")
ETCD_FORM = "etcd://HOST:PORT[,HOST:PORT...] (e.g. etcd://10.0.0.5:2379,10.0.0.6:2379)"


def etcd_endpoints(value: str) -> list[tuple[str, int]]:
    """(host, port) of each member in `launch.rendezvous`; raises ValueError saying what to write.
    Hosts are names, IPv4 or bracketed IPv6 addresses; every member is listed with its port."""
    if not value.startswith(ETCD_SCHEME):
        raise ValueError(f"{value!r} is not an etcd URL; write {ETCD_FORM}, or leave "
                         "launch.rendezvous out to use the head daemon's own store")
    items = value[len(ETCD_SCHEME):].split(",")
    if len(items) > MAX_ETCD_ENDPOINTS:
        raise ValueError(f"lists {len(items)} etcd members; at most {MAX_ETCD_ENDPOINTS}")
    out: list[tuple[str, int]] = []
    for item in items:
        host, sep, port = item.rpartition(":")
        if not sep or not _ETCD_HOST_RE.match(host) or not port.isdigit() or len(port) > 5:
            raise ValueError(f"member {item!r} is not HOST:PORT; write {ETCD_FORM}")
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"member {item!r}: port {int(port)} is outside 1-65535")
        if (host, int(port)) in out:
            raise ValueError(f"member {item!r} is listed more than once")
        out.append((host, int(port)))
    return out


class LaunchConfig(_Section):
    nnodes: int = Field(default=1, ge=1, le=4096, description="nodes the job starts on")
    min_nodes: int | None = Field(default=None, ge=1, le=4096,
                                  description="fewest nodes to keep running")
    nproc_per_node: int | None = Field(default=None, ge=1, le=256)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_restarts: int = Field(default=3, ge=0, le=1000)
    hosts: list[str] = Field(default_factory=list, max_length=4096,
                             description="daemon addresses, one per node, each once")
    rendezvous: str | None = Field(
        default=None, description="etcd://HOST:PORT[,HOST:PORT...]: torch elastic's etcd "
        "rendezvous instead of the head daemon's c10d store")

    @field_validator("rendezvous")
    @classmethod
    def _rendezvous_is_etcd(cls, v: str | None) -> str | None:
        if v is not None:
            etcd_endpoints(v)
        return v

    @property
    def etcd_endpoints(self) -> list[tuple[str, int]]:
        """The etcd members of `rendezvous` (empty: the head daemon's c10d store)."""
        return etcd_endpoints(self.rendezvous) if self.rendezvous else []

    @field_validator("hosts")
    @classmethod
    def _hosts_are_distinct(cls, v: list[str]) -> list[str]:
        if any(not h.strip() or h != h.strip() for h in v):
            raise ValueError("an address is empty or has spaces around it; give HOST:PORT")
        twice = sorted({h for h in v if v.count(h) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once; one daemon per node, "
                             "each listed once, this (head) node first")
        return v


class JobConfig(_Section):
    name: str = "job"
    preset: str | None = None
    model: ModelConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)

    @field_validator("name")
    @classmethod
    def _name_is_safe(cls, v: str) -> str:
        if not valid_job_name(v):
            raise ValueError(f"must be {JOB_NAME_RULE}")
        return v

    @field_validator("preset")
    @classmethod
    def _preset_is_known(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"is not a preset; use one of {', '.join(PRESETS)} or leave it out")
        return v

    def model_hash(self) -> str:
        """Identifies the architecture: a checkpoint restores only into the same hash."""
        blob = json.dumps(self.model.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def checkpoint_settings(self) -> CheckpointSettings:
        """What the workers' checkpointing reads of this job (checkpoints/settings.py): storage
        takes these, never the JobConfig, so it knows no trainer."""
        from ds3d.checkpoints.settings import CheckpointSettings

        c = self.checkpoint
        return CheckpointSettings(
            job=self.name, store=c.store, local_dir=c.local_dir, keep_last=c.keep_last,
            keep_every=c.keep_every, cleanup_grace_s=c.cleanup_grace_s,
            model_hash=self.model_hash(), zero_stage=self.parallel.zero_stage,
            keep_in_node_memory=c.keep_in_node_memory, memory_interval=c.memory_interval,
            s3=c.s3.model_dump())

    def dump_json(self) -> str:
        return self.model_dump_json(indent=2)

    @property
    def elastic(self) -> bool:
        """The job keeps running on fewer nodes than it started with (launch.min_nodes)."""
        return self.launch.min_nodes is not None and self.launch.min_nodes < self.launch.nnodes

    def at_world_size(self, world_size: int) -> JobConfig:
        """The job as it runs on `world_size` processes. An elastic job that lost (or got back)
        nodes keeps TP x PP and its global batch; DP follows the world and gradient
        accumulation makes up the difference. Any other job is returned unchanged (and
        `validate_job` refuses a world size that does not match it)."""
        p, launch = self.parallel, self.launch
        if world_size == p.world_size or not self.elastic or world_size % (p.tp * p.pp):
            return self
        nproc = launch.nproc_per_node or p.world_size // launch.nnodes
        nodes = max(1, world_size // nproc)
        return self.model_copy(update={
            "parallel": p.model_copy(update={"dp": world_size // (p.tp * p.pp)}),
            "launch": launch.model_copy(update={
                "nnodes": nodes, "nproc_per_node": nproc,
                "min_nodes": min(launch.min_nodes or nodes, nodes)})})

    @classmethod
    def parse_json(cls, text: str | bytes, source: str) -> JobConfig:
        """A job as JSON (a StartJob or StartShare request, a stored row) -> JobConfig, checked
        against the schema only (`validate_job` checks the combinations); ConfigError names
        every problem."""
        try:
            cfg = cls.model_validate_json(text)
        except ValidationError as e:
            raise ConfigError(explain(e, source)) from None
        twice = _keys_given_twice(text)  # the JSON parser keeps the last: which was meant?
        if twice:
            raise ConfigError(f"invalid job configuration ({source}):\n  {twice} is given twice; "
                              "give each setting once")
        return cfg

    @classmethod
    def load_json(cls, path: str | Path) -> JobConfig:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except ValidationError as e:
            raise ConfigError(explain(e, str(path))) from None


def _keys_given_twice(text: str | bytes) -> str | None:
    """The first key that appears twice in one object of a JSON text that parsed ("train.lr",
    or "name" at the top level), or None."""
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in items]
        found.extend(key for i, key in enumerate(keys) if key in keys[:i])
        return dict(items)

    try:
        json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None  # the schema check refuses such text; nothing more to say here
    if not found:
        return None
    where = _path_of_key(json.loads(text), found[0])
    return where or found[0]


def _path_of_key(data: Any, key: str, prefix: str = "") -> str | None:
    """The dotted path of the first object holding `key` (for the message)."""
    if isinstance(data, dict):
        if key in data:
            return f"{prefix}{key}"
        for k, v in data.items():
            if (found := _path_of_key(v, key, f"{prefix}{k}.")) is not None:
                return found
    return None


# --------------------------------------------------------------------------------------------
# Loading: preset or TOML, then overrides, then cross-field validation.


_EXPLAINED_MAX = 20  # problems listed in one refusal (a fuzzed request can have thousands)


def explain(err: ValidationError, source: str,
            from_json: dict[tuple[str, ...], str] | None = None) -> str:
    """A pydantic error as lines a person can act on: the field, the value, what is wrong, and
    the allowed range. Values are shortened: a refusal must stay small enough for a gRPC
    status message whatever the request held. A field whose value came from the user's
    DeepSpeed JSON (`from_json`: field -> JSON key) is named by its JSON key too."""
    lines = []
    errors = err.errors()
    for e in errors[:_EXPLAINED_MAX]:
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        key = next((k for f, k in (from_json or {}).items()
                    if tuple(e["loc"][:len(f)]) == f), None)
        if key is not None:
            where = f"{key} (the DeepSpeed JSON) -> {where}"
        value = _short(e.get("input"))
        if e["type"] == "extra_forbidden":
            lines.append(f"{_clip(where)}: unknown setting; check the spelling (see "
                         "docs/configuration.md)")
        elif e["type"] == "missing":
            lines.append(f"{where}: required but missing")
        elif e["type"] == "json_invalid":
            lines.append(f"not valid JSON ({e['msg']})")
        elif e["type"] == "finite_number":
            lines.append(f"{where}={value}: must be a finite number (NaN and infinity are "
                         f"refused){_range_hint(e['loc'])}")
        elif e["type"] in ("int_type", "float_type", "bool_type", "string_type") and \
                isinstance(e.get("input"), (bool, str)) and _quoted_value(e["type"], e["input"]):
            kind = "true/false" if isinstance(e["input"], bool) else "a string"
            lines.append(f"{where}={value}: {e['msg']}; {kind} is not converted: write the "
                         f"value itself, e.g. 8 not \"8\", true not \"true\", 1 not true")
        elif e["type"] in ("int_type", "float_type", "bool_type"):
            want = {"int_type": "a whole number, e.g. 8", "float_type": "a number, e.g. 3e-4",
                    "bool_type": "true or false"}[e["type"]]
            lines.append(f"{where}={value}: expected {want}{_range_hint(e['loc'])}")
        elif e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            lines.append(f"{where}={value}: {e['msg']}{_range_hint(e['loc'])}")
        elif e["type"] in ("model_type", "model_attributes_type", "dict_type"):
            lines.append(f"{where}={value}: expected a section (a [table] in TOML, an object "
                         "in JSON) of settings, not a single value")
        elif e["type"] in ("tuple_type", "list_type"):
            lines.append(f"{where}={value}: expected a list, e.g. "
                         f"{_EXAMPLES.get(e['loc'][-1], '[...]')}")
        else:
            lines.append(f"{where}={value}: {e['msg'].removeprefix('Value error, ')}")
    if len(errors) > _EXPLAINED_MAX:
        lines.append(f"... and {len(errors) - _EXPLAINED_MAX} more problems")
    return f"invalid job configuration ({source}):\n  " + "\n  ".join(lines)


_EXAMPLES = {"betas": "[0.9, 0.95] (beta1, beta2, each 0 <= b < 1)"}  # list-valued settings

# repr with bounded work: a YAML value of anchors can expand to gigabytes when printed whole
_BOUNDED_REPR = reprlib.Repr()
for _limit, _n in (("maxlevel", 3), ("maxlist", 12), ("maxtuple", 12), ("maxdict", 12),
                   ("maxset", 12), ("maxstring", 200), ("maxlong", 1000), ("maxother", 200)):
    setattr(_BOUNDED_REPR, _limit, _n)


def _short(value: Any) -> str:
    return _clip(value if isinstance(value, str) and value.isidentifier()
                 else _BOUNDED_REPR.repr(value))


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _quoted_value(kind: str, given: bool | str) -> bool:
    """The value was written as the wrong type but holds the right one ("8" for an integer,
    true for 1): the refusal says to write it unquoted. Anything else ("abc" for a number) is
    just not a value of the setting's type."""
    if isinstance(given, bool):
        return kind in ("int_type", "float_type", "string_type")
    text = given.strip().lower()
    if kind == "bool_type":
        return text in ("true", "false")
    if kind == "string_type":
        return True
    try:
        int(text) if kind == "int_type" else float(text)
    except ValueError:
        return False
    return True


def _range_hint(loc: tuple[Any, ...]) -> str:
    """"; allowed: 0 < train.lr <= 10" for the field at `loc` (docs/configuration.md lists
    every range), or "" where the field has none."""
    model: Any = JobConfig
    info = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            break
        info = fields[part]
        model = info.annotation
        while getattr(model, "__args__", None) and not hasattr(model, "model_fields"):
            model = next((a for a in model.__args__ if hasattr(a, "model_fields")), None)
    if info is None:
        return ""
    low = high = ""
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            low = f"{m.ge} <= "
        elif getattr(m, "gt", None) is not None:
            low = f"{m.gt} < "
        if getattr(m, "le", None) is not None:
            high = f" <= {m.le}"
        elif getattr(m, "lt", None) is not None:
            high = f" < {m.lt}"
    where = ".".join(p for p in loc if isinstance(p, str))
    return f"; allowed: {low}{where}{high}" if low or high else ""


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = _deep_merge(out[k], v) if both else v
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.lr=1e-4` -> (["train", "lr"], 1e-4). Values are TOML; bare words are strings."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=1e-4")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if not all(re.fullmatch(r"[a-z_][a-z0-9_]*", p) for p in path):
        raise ConfigError(f"--set {item!r}: {key!r} is not a dotted setting name like train.lr")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:
        from .ds_config_import import too_deep
        raise ConfigError(too_deep(f"--set {key}=...", "a setting's value")) from None
    return path, value


def build_job_config(source: str, overrides: list[str] | None = None,
                     name: str | None = None) -> JobConfig:
    """Preset name or TOML path -> validated JobConfig (overrides applied last)."""
    from .presets import PRESETS, preset_dict

    explicit: dict[tuple[str, ...], str] = {}  # fields the user wrote -> where
    if source.endswith((".json", ".yml", ".yaml")):
        from .neox_import import job_file_dict  # a NeoX YAML, or a JSON refused with the fix
        data, explicit = job_file_dict(source)
    elif source.endswith(".toml") or "/" in source:
        path = Path(source)
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {source!r} {what}; give a preset "
                              f"({', '.join(PRESETS)}) or the path of a TOML file")
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {source!r} cannot be read as a UTF-8 TOML file: "
                              f"{e}") from None
        except tomllib.TOMLDecodeError as e:
            from .neox_import import not_toml_message
            raise ConfigError(not_toml_message(path, e)) from None
        except RecursionError:
            from .ds_config_import import too_deep
            raise ConfigError(too_deep(source, "a TOML job file")) from None
        explicit = {k: source for k in _leaf_paths(raw) if k[0] != "preset"}
        base = raw.pop("preset", None)
        data = _deep_merge(preset_dict(base), raw) if base else raw
        if base:
            data["preset"] = base
    else:
        data = preset_dict(source)
        data["preset"] = source
    for item in overrides or []:
        path, value = parse_override(item)
        node = data
        for p in path[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is a value, not a section")
        written = _leaf_paths(value, tuple(path)) if isinstance(value, dict) else [tuple(path)]
        _one_deepspeed_config(node, path, value, explicit)
        if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
            # a table merges key by key, as a TOML file over its preset: replacing the section
            # would drop what the file (or an earlier --set) wrote there without a word
            value = _deep_merge(node[path[-1]], value)
        node[path[-1]] = value
        explicit.update({k: f"--set {item}" for k in written})
    if name is not None:
        data["name"] = name
    preset = data.get("preset")
    name_from_file = "name" not in data and not (isinstance(preset, str) and preset)
    data.setdefault("name", preset if isinstance(preset, str) and preset else Path(source).stem)
    translation, from_json = None, {}
    if isinstance(data.get("train"), dict) and data["train"].get("deepspeed_config"):
        from .ds_config_import import import_into, mapped_from_json
        translation = import_into(data, explicit)  # its keys become fields (one meaning)
        from_json = mapped_from_json(translation, explicit)
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as e:
        message = explain(e, source, from_json)
        if name_from_file and not valid_job_name(data["name"]):
            message += "\n  " + _file_name_hint(source, data["name"])
        if translation is not None and translation.problems:  # all of the file's at once
            from .ds_config_import import refusal
            message = refusal(data["train"]["deepspeed_config"], translation.problems) + \
                "\n" + message
        raise ConfigError(message) from None
    if translation is not None:
        from .ds_config_import import check_translated, refusal
        if translation.problems:
            raise ConfigError(refusal(cfg.train.deepspeed_config, translation.problems))
        check_translated(cfg, translation)
    validate_job(cfg)
    validate_tokenizer(cfg)
    if why := _s3_settings_problem(cfg):
        raise ConfigError(f"job {cfg.name!r} cannot run as configured:\n  - {why}")
    return cfg


def _one_deepspeed_config(node: dict[str, Any], path: list[str], value: Any,
                          explicit: dict[tuple[str, ...], str]) -> None:
    """Two DeepSpeed JSONs for one job (the TOML file's and --deepspeed, or --deepspeed and
    --set train.deepspeed_config) are refused: the later would drop every key of the
    earlier without a word, which a later --set never does to a whole file elsewhere."""
    key = ("train", "deepspeed_config")
    earlier = explicit.get(key)
    if tuple(path) == key and earlier is not None and node.get("deepspeed_config") != value:
        raise ConfigError(f"two DeepSpeed configs for one job: {node.get('deepspeed_config')!r} "
                          f"and {value!r}; give one (merge them into one file)")


def _file_name_hint(source: str, stem: str) -> str:
    """What to do when the name a job file left out was taken from its file name and is not a
    job name: the user never wrote that name, so say where it came from and offer one."""
    suggestion = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).lstrip("-._")[:63] or "job"
    return (f"(the name {stem!r} comes from the file name: write name = \"{suggestion}\" in "
            f"{source}, or give --name {suggestion})")


def _s3_settings_problem(cfg: JobConfig) -> str | None:
    """[checkpoint.s3] beside a store that is not s3:// would do nothing. Checked where a job
    is built or submitted (build_job_config, validate_for_daemon), not at a worker's start: a
    job stored before this rule stays runnable."""
    given = sorted(k for k, v in cfg.checkpoint.s3.model_dump().items() if v is not None)
    if not given or (cfg.checkpoint.store or "").startswith("s3://"):
        return None
    return (f"checkpoint.s3.{given[0]}" + (f" (and {len(given) - 1} more)" if len(given) > 1
                                           else "")
            + " applies to an s3:// store, and this job's checkpoint.store is "
            + (repr(cfg.checkpoint.store) if cfg.checkpoint.store else
               "unset (the job folder's file:// store)")
            + ": set checkpoint.store = \"s3://bucket/prefix\", or remove [checkpoint.s3]")


def job_warnings(cfg: JobConfig) -> list[str]:
    """Settings that run but are likely not what was meant; said by `ds3dctl check` and
    `ds3dctl start`, not refused: a preset's warm-up under a short smoke-test `--steps` is a
    legitimate job."""
    t, out = cfg.train, []
    if t.warmup_steps > t.steps:
        out.append(f"train.warmup_steps={t.warmup_steps} is more than train.steps={t.steps}: "
                   f"the learning rate rises only to {t.steps / t.warmup_steps:.0%} of "
                   f"train.lr={t.lr:g} and never decays; unless this is a smoke test, lower it "
                   f"(e.g. --set train.warmup_steps={max(1, t.steps // 20)})")
    return out


def _leaf_paths(raw: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for k, v in raw.items():
        out += _leaf_paths(v, prefix + (k,)) if isinstance(v, dict) else [prefix + (k,)]
    return out


def validate_job(cfg: JobConfig, world_size: int | None = None) -> None:
    """Refuses combinations that cannot run, before any process starts. Raises ConfigError
    listing every problem at once, each with what to change."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    problems: list[str] = []

    if p.zero_stage >= 2 and p.pp > 1:
        problems.append(
            f"parallel.zero_stage={p.zero_stage} with parallel.pp={p.pp}: DeepSpeed's pipeline "
            "engine supports only ZeRO-0/1 (ZeRO-2/3 shard gradients that pipeline stages "
            "accumulate across micro-batches). Use zero_stage=1 with pp>1, or pp=1 with "
            "zero_stage 2/3")
    if m.d_model % m.n_heads:
        problems.append(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
                        "pick d_model a multiple of n_heads")
    elif (m.d_model // m.n_heads) % 2:
        problems.append(f"head size d_model/n_heads={m.d_model // m.n_heads} is odd; rotary "
                        "positions need an even head size")
    if m.n_heads % p.tp:
        problems.append(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}: each "
                        "tensor-parallel rank holds whole heads; use tp dividing n_heads "
                        f"({_divisors(m.n_heads)})")
    if m.vocab_size % p.tp:
        problems.append(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={p.tp}: "
                        "the embedding is split by vocabulary; pad vocab_size to a multiple of "
                        f"{p.tp} (e.g. {(m.vocab_size + p.tp - 1) // p.tp * p.tp})")
    widths = m.block_ffn_widths()
    if m.layer_d_ff is not None and len(m.layer_d_ff) != m.n_layers:
        problems.append(f"model.layer_d_ff has {len(m.layer_d_ff)} entries for "
                        f"model.n_layers={m.n_layers}; give one width per block")
    elif any(w % p.tp for w in widths):
        problems.append(f"MLP widths {sorted(set(widths))} are not all divisible by parallel.tp="
                        f"{p.tp}; use widths that are multiples of {p.tp}")
    if isinstance(p.partition_method, list):
        parts = p.partition_method
        if len(parts) != p.pp or sum(parts) != m.n_layers or min(parts) < 1:
            problems.append(f"parallel.partition_method={parts} must list blocks per stage: "
                            f"{p.pp} positive numbers summing to model.n_layers={m.n_layers}")
    elif m.n_layers % p.pp:
        problems.append(
            f"model.n_layers={m.n_layers} cannot be divided into parallel.pp={p.pp} stages; use "
            f"n_layers a multiple of {p.pp}, or list blocks per stage explicitly, e.g. "
            f"parallel.partition_method={_even_split(m.n_layers, p.pp)}")

    dp = p.dp
    if t.grad_accum_steps is not None and t.global_batch_size is not None:
        want = t.micro_batch_size * t.grad_accum_steps * dp
        if want != t.global_batch_size:
            problems.append(
                f"train.global_batch_size={t.global_batch_size} != micro_batch_size "
                f"({t.micro_batch_size}) x grad_accum_steps ({t.grad_accum_steps}) x dp ({dp}) = "
                f"{want}; set global_batch_size={want}, or leave grad_accum_steps unset to "
                "derive it")
    elif t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
        problems.append(
            f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size "
            f"({t.micro_batch_size}) x dp ({dp}); use a multiple of {t.micro_batch_size * dp}")
    if p.activation_checkpoint_interval and t.compile:
        problems.append("train.compile=true with activation checkpointing is not supported; "
                        "set one of them off")

    launch = cfg.launch
    if launch.min_nodes is not None and launch.min_nodes > launch.nnodes:
        problems.append(f"launch.min_nodes={launch.min_nodes} > launch.nnodes={launch.nnodes}")
    elif cfg.elastic:
        problems += _elastic_problems(cfg)
        if p.zero_stage == 0:
            problems.append(
                f"launch.min_nodes={launch.min_nodes} < nnodes={launch.nnodes} (elastic) with "
                "parallel.zero_stage=0: a ZeRO-0 checkpoint cannot be reshaped to the smaller "
                "DP a lost node leaves (DeepSpeed's universal checkpoint needs ZeRO optimizer "
                "shards); use zero_stage=1, or set min_nodes = nnodes")
    if launch.nproc_per_node is not None:
        total = launch.nnodes * launch.nproc_per_node
        if total != p.world_size:
            problems.append(
                f"launch.nnodes ({launch.nnodes}) x nproc_per_node ({launch.nproc_per_node}) = "
                f"{total} processes, but tp x pp x dp = {p.tp} x {p.pp} x {p.dp} = "
                f"{p.world_size}; make them equal")
    elif p.world_size % launch.nnodes:
        problems.append(f"tp x pp x dp = {p.world_size} processes cannot be spread evenly over "
                        f"launch.nnodes={launch.nnodes} nodes")
    if world_size is not None and world_size != p.world_size:
        problems.append(
            f"the job has {world_size} processes but tp x pp x dp = {p.tp} x {p.pp} x {p.dp} = "
            f"{p.world_size}; the world size must be the product of the three degrees")
    problems += _memory_interval_problems(cfg.checkpoint)
    if cfg.checkpoint.store is not None and not re.match(r"^(file|s3)://", cfg.checkpoint.store):
        problems.append(f"checkpoint.store={cfg.checkpoint.store!r}: use file:///absolute/path "
                        "or s3://bucket/prefix")
    for start, end in cfg.data.skip_batches:
        if not 0 <= start < end:
            problems.append(f"data.skip_batches range [{start}, {end}) is empty or negative")
    problems += _data_problems(cfg)
    if cfg.data.source not in ("synthetic", "indexed") and not cfg.data.source.endswith(".bin"):
        problems.append(f"data.source={cfg.data.source!r}: use \"synthetic\", "
                        "\"indexed\" (Megatron "
                        "datasets listed in data.blend) or the path of a flat token file ending "
                        "in .bin (see docs/data.md)")
    if problems:
        raise ConfigError(f"job {cfg.name!r} cannot run as configured:\n  - "
                          + "\n  - ".join(problems))


def validate_tokenizer(cfg: JobConfig) -> None:
    """data.tokenizer, loaded to check that its vocabulary fits model.vocab_size, where the job
    is built (ds3dctl, a plain torchrun worker) and when ds3dd accepts it; not at a worker's
    (re)start under ds3dd (`validate_job`): no worker reads it (`ds3dctl export` does), so a
    tokenizer moved after submission, or absent on the job's other nodes, must not stop it.
    The datasets' token ids are scanned against model.vocab_size here too (token_scan.py: once
    per submission, not at every restart)."""
    from .data import tokenizer_problems
    from .token_scan import token_id_problems

    problems = tokenizer_problems(cfg) + token_id_problems(cfg)
    if problems:
        raise ConfigError(f"job {cfg.name!r} cannot run as configured:\n  - "
                          + "\n  - ".join(problems))


def validate_for_daemon(cfg: JobConfig) -> None:
    """What a job run by ds3dd needs beyond `validate_job`: absolute paths (ds3dctl, ds3dd and
    the workers each have their own folder), a store URL of a form storage opens (what ds3dd's
    store check would refuse at start), launch.hosts naming the daemons of its nodes, one
    per node, and for a multi-node job a store every node writes to. Checked by `ds3dctl
    check`/`start` and by ds3dd on receipt, not at every worker start (a job accepted before
    these rules stays runnable); a worker under plain torchrun (the user's folder, its own
    rendezvous, no daemons) does not need them."""
    problems = [f"{where}={path!r}: use an absolute path ({RELATIVE_PATH_WHY})"
                for where, path in (("data.source", cfg.data.source if
                                     cfg.data.source.endswith(".bin") else None),
                                    ("checkpoint.local_dir", cfg.checkpoint.local_dir),
                                    ("train.deepspeed_config", cfg.train.deepspeed_config))
                if path is not None and not Path(path).is_absolute()]
    local, url = cfg.checkpoint.local_dir, cfg.checkpoint.store or ""
    for where, value, path in (("checkpoint.local_dir", local, local),
                               ("checkpoint.store", url, urlparse(url).path
                                if url.startswith("file://") else None)):
        if path is not None and (kernel := _kernel_filesystem(path)):
            problems.append(f"{where}={value!r} is under {kernel}, a kernel filesystem that "
                            "holds no files; use a folder on a disk (or /dev/shm for a RAM disk)")
    store = cfg.checkpoint.store
    if store is not None and (why := _store_url_problem(store)):
        problems.append(f"checkpoint.store={store!r}: {why}")
    if s3_why := _s3_settings_problem(cfg):
        problems.append(s3_why)
    if problems:
        raise ConfigError(f"job {cfg.name!r} cannot run under ds3dd as configured:\n  - "
                          + "\n  - ".join(problems))
    launch = cfg.launch
    if (launch.nnodes > 1 or launch.hosts) and len(launch.hosts) != launch.nnodes:
        raise ConfigError(
            f"launch.nnodes={launch.nnodes} needs launch.hosts with one daemon address per node, "
            f"this (head) node first; got {len(launch.hosts)}"
            + ("" if launch.nnodes > 1 else ": set launch.nnodes to the number of hosts "
               "(`--hosts` alone does), or remove launch.hosts for a one-node job"))
    if launch.nnodes > 1 and not cfg.checkpoint.store:
        raise ConfigError(
            f"launch.nnodes={launch.nnodes} needs checkpoint.store: a durable tier every node "
            "writes to (s3://bucket/prefix, or file:///path on a shared filesystem); each rank "
            "saves its own shard there")


def _kernel_filesystem(path: str) -> str | None:
    """/proc, /sys or /dev (but /dev/shm, a tmpfs) when `path` lies under one: writes there
    fail or mean something else entirely (a probe's local_dir = "/proc/self" was accepted and
    every save then failed as "disk full")."""
    parts = Path(os.path.normpath(path)).parts
    if len(parts) > 1 and parts[1] in ("proc", "sys", "dev") and parts[1:3] != ("dev", "shm"):
        return "/" + parts[1]
    return None


def _store_url_problem(url: str) -> str | None:
    """The URL forms checkpoints/storage.py opens, checked here so that `ds3dctl check` refuses
    what ds3dd's store check would (`file://data/x` is host "data", path "/x")."""
    if not url.startswith(("file://", "s3://")):
        return "use file:///absolute/path or s3://bucket/prefix"
    parsed = urlparse(url)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost") and \
            parsed.path.startswith("/") and parsed.path.strip("/"):
        return None
    if parsed.scheme == "s3" and parsed.netloc:
        return None
    if parsed.scheme == "file":
        return ("a file URL needs an absolute path other than /, with three slashes, e.g. "
                "file:///data/ckpt")
    return "an S3 URL needs a bucket, e.g. s3://my-bucket/ckpt"


def _memory_interval_problems(c: CheckpointConfig) -> list[str]:
    """Memory-only snapshots are taken between durable saves, so they need durable saves more
    than `memory_interval` steps apart."""
    memory, interval = c.memory_interval, c.interval
    if memory == 0:
        return []
    if memory == "auto":
        if interval == 0:
            return ['checkpoint.memory_interval="auto" takes memory-only snapshots between '
                    "durable saves, but checkpoint.interval=0 makes none (only on demand); set "
                    'checkpoint.interval to "auto" or an integer step count (e.g. 100), or '
                    "memory_interval = 0"]
        if interval == 1:
            return ['checkpoint.memory_interval="auto" takes memory-only snapshots between '
                    "durable saves, but checkpoint.interval=1 saves every step durably: there "
                    'is no step between them; set checkpoint.interval to "auto" or above 1, '
                    "or memory_interval = 0"]
        return []
    if interval == 0:
        return [f"checkpoint.memory_interval={memory} takes memory-only snapshots between "
                "durable saves, but checkpoint.interval=0 makes none (only on demand); set "
                f"checkpoint.interval to an integer above {memory} (e.g. {memory * 4}) or "
                "\"auto\", or memory_interval = 0"]
    if isinstance(interval, int) and memory >= interval:
        return [f"checkpoint.memory_interval={memory} is not smaller than checkpoint.interval="
                f"{interval}: every step it names would be a durable save (or come after the "
                f"one it should back up); use a memory_interval below {interval} (e.g. "
                f"{max(1, interval // 4)}), or 0 for none"]
    return []


def _data_problems(cfg: JobConfig) -> list[str]:
    """Indexed datasets and the tokenizer are read here (headers only), so a wrong path or a
    foreign file is refused before launch rather than in every worker."""
    from .data import data_problems

    return data_problems(cfg)


def _elastic_problems(cfg: JobConfig) -> list[str]:
    """An elastic job must keep its global batch at every node count it may run on."""
    p, t, launch = cfg.parallel, cfg.train, cfg.launch
    if t.global_batch_size is None or t.grad_accum_steps is not None:
        return [f"launch.min_nodes={launch.min_nodes} < nnodes={launch.nnodes} (elastic) needs "
                "train.global_batch_size set and train.grad_accum_steps unset, so that the "
                "global batch stays the same when DP shrinks with the nodes"]
    nproc = launch.nproc_per_node or p.world_size // launch.nnodes
    bad = []
    for nodes in range(launch.min_nodes or launch.nnodes, launch.nnodes + 1):
        world = nodes * nproc
        if world % (p.tp * p.pp):
            bad.append(f"{nodes} nodes ({world} processes) is not a multiple of tp x pp = "
                       f"{p.tp * p.pp}")
        elif t.global_batch_size % (t.micro_batch_size * (world // (p.tp * p.pp))):
            bad.append(f"{nodes} nodes: global_batch_size={t.global_batch_size} is not divisible "
                       f"by micro_batch_size x dp = {t.micro_batch_size} x "
                       f"{world // (p.tp * p.pp)}")
    return [f"elastic launch.min_nodes={launch.min_nodes}..nnodes={launch.nnodes}: {b}; pick a "
            "global_batch_size (or min_nodes) that fits every node count" for b in bad]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _even_split(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]
