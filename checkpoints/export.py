"""Consolidated model weights out of any committed checkpoint, whatever its (TP, PP, DP) layout.

DeepSpeed's `zero_to_fp32` fails on pipeline checkpoints, so this is ds3d's own path: the
pipeline engine writes every layer's weights per TP rank (`layer_LL-model_TT-model_states.pt`,
DP replicas are identical and written once); the shards of each parameter are joined along the
axis the trainer split them on (the same patterns the universal checkpoint uses), replicated
parameters are taken once. The result is a safetensors file with the names of the
single-process model (`GPTSequential`, "<layer>.<param>") and a config.json stating the
architecture, loadable by plain PyTorch:

    python -m ds3d.checkpoints.export --store file:///…/store/JOB [--step N] --out DIR
    model = load_exported(DIR)            # a torch.nn.Module, TP = PP = 1

Weights are exported in the dtype the engine holds its module in (fp32 for fp32 jobs; bf16 or
fp16 module weights for mixed-precision jobs, whose fp32 master copies live in the optimizer
state). ZeRO-3 checkpoints (weights partitioned across DP) are refused.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from ds3d.trainer.errors import CheckpointError, Ds3dError

from .catalog import Catalog
from .storage import open_storage

_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


def _join_axis(name: str) -> int | None:
    """The axis TP shards of `name` join on (None: replicated on every TP rank)."""
    from ds3d.trainer.checkpoint_info import JOIN_ON_DIM_1, TP_REPLICATED

    qualified = "0." + name  # the patterns expect the "<layer>." prefix
    if any(re.match(p, qualified) for p in TP_REPLICATED):
        return None
    if any(re.match(p, qualified) for p in JOIN_ON_DIM_1):
        return 1
    if name.endswith("embed.weight"):
        return 0
    return None


def consolidate(ckpt_dir: Path, tp: int) -> dict[str, Any]:
    """{"<layer>.<param>": full tensor} from the per-layer, per-TP-rank files of one tag."""
    import torch

    shards: dict[int, dict[int, dict[str, Any]]] = {}
    for f in ckpt_dir.iterdir():
        m = _LAYER_FILE.match(f.name)
        if m:
            shards.setdefault(int(m.group(1)), {})[int(m.group(2))] = torch.load(
                f, map_location="cpu", weights_only=False)
    if not shards:
        raise CheckpointError(f"{ckpt_dir} has no pipeline layer files (layer_*-model_*): only "
                              "pipeline-engine checkpoints (ZeRO-0/1) can be exported")
    out: dict[str, Any] = {}
    for layer in sorted(shards):
        ranks = shards[layer]
        if sorted(ranks) != list(range(tp)):
            raise CheckpointError(f"layer {layer}: TP shards {sorted(ranks)} of {tp} present")
        for name, first in ranks[0].items():
            axis = _join_axis(name)
            full = first if axis is None else torch.cat([ranks[r][name] for r in range(tp)], axis)
            out[f"{layer}.{name}"] = full.contiguous()
    return out


def export(store_url: str, out_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """Writes OUT/model.safetensors and OUT/config.json from the job whose store prefix is
    `store_url`; returns the config written."""
    from safetensors.torch import save_file

    storage = open_storage(store_url)
    with tempfile.TemporaryDirectory(prefix="ds3d-export-") as scratch:
        catalog = Catalog(storage, scratch)
        found = catalog.newest_restorable(checksums=True, download=True, only_step=step)
        if found is None:
            what = f"step {step}" if step is not None else "any step"
            raise CheckpointError(f"no complete, verified checkpoint of {what} in {store_url}")
        m = found.manifest
        ds_state = _read_model_states(Path(scratch) / m.tag)
        job = ds_state.get("ds_config", {})
        tensors = consolidate(Path(scratch) / m.tag, m.layout.tp)
        model_cfg = _model_config(Path(scratch) / m.tag)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"))
    config = {"architecture": "ds3d-gpt", "format": 1, "model": model_cfg,
              "positions": "rotary", "norm": "pre-layernorm", "mlp": "gelu",
              "tied_embeddings": False, "job": m.job, "step": m.step,
              "tokens_seen": m.tokens_seen, "source_layout": m.layout.model_dump(),
              "model_hash": m.model_hash,
              "dtype": str(next(iter(tensors.values())).dtype).replace("torch.", ""),
              "train_batch_size": job.get("train_batch_size"),
              "parameters": sum(t.numel() for t in tensors.values())}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def _read_model_states(tag_dir: Path) -> dict[str, Any]:
    import torch

    path = tag_dir / "mp_rank_00_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else {}


def _model_config(tag_dir: Path) -> dict[str, Any]:
    """The architecture, from the job config the trainer recorded next to the checkpoint."""
    state = _read_model_states(tag_dir)
    model = state.get("ds3d", {}).get("model")
    if model is None:
        raise CheckpointError(f"{tag_dir} does not record its model configuration (saved by an "
                              "older ds3d); export needs it")
    return model


def load_exported(path: str | Path):
    """The exported model as a plain single-process torch module (TP = PP = 1)."""
    import torch
    from safetensors.torch import load_file

    from ds3d.trainer.config import JobConfig, ModelConfig
    from ds3d.trainer.model import GPTSequential, Rotary
    from ds3d.trainer.tensor_parallel import TPGroup

    path = Path(path)
    m = ModelConfig.model_validate(json.loads((path / "config.json").read_text())["model"])
    with torch.device("meta"):  # no initialisation: every weight comes from the file
        model = GPTSequential(JobConfig(model=m), TPGroup(None, 0, 1))
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True, assign=True)
    for module in model.modules():  # rotary tables are derived, not saved
        if isinstance(module, Rotary):
            fresh = Rotary(m.d_model // m.n_heads, m.seq_len, m.rope_theta)
            module.cos, module.sin = fresh.cos, fresh.sin
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds3d.checkpoints.export",
                                 description="consolidated weights (safetensors + config.json) "
                                 "from a committed ds3d checkpoint of any (TP, PP, DP) layout")
    ap.add_argument("--store", required=True, help="the job's store prefix, e.g. "
                    "s3://bucket/ds3d/JOB or file:///state/jobs/JOB/store/JOB")
    ap.add_argument("--step", type=int, help="default: the newest committed checkpoint")
    ap.add_argument("--out", required=True, help="output folder")
    args = ap.parse_args(argv)
    try:
        cfg = export(args.store, args.out, args.step)
    except Ds3dError as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    print(f"exported step {cfg['step']} ({cfg['parameters']:,} parameters, {cfg['dtype']}) "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
