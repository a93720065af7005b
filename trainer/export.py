"""Consolidated model weights out of any committed checkpoint, whatever its (TP, PP, DP) layout.

DeepSpeed's `zero_to_fp32` fails on pipeline checkpoints, so this is ds3d's own path. The
pipeline engine (ZeRO-0/1) writes every layer's weights per TP rank
(`layer_LL-model_TT-model_states.pt`); the plain engine (PP = 1, ZeRO-2) writes the whole
module per TP rank (`mp_rank_TT_model_states.pt`); DP replicas are identical and written once.
The shards of each parameter are joined along the axis the trainer split them on (the same
patterns the universal checkpoint uses), replicated parameters are taken once. ZeRO-3 keeps no
module weights (they live partitioned in the optimizer state): its fp32 weights are gathered per
TP rank by DeepSpeed's own `zero_to_fp32` from the optimizer shards, then joined the same way.

Two output formats:
  * "ds3d" (default): model.safetensors with the names of the single-process model
    (`GPTSequential`, "<layer>.<param>") and a config.json stating the architecture, loadable
    by plain PyTorch with `load_exported(DIR)`;
  * "hf": a Hugging Face `GPTNeoXForCausalLM` folder (config.json, model.safetensors, and the
    tokenizer's files when the tokenizer is known) that `transformers.AutoModelForCausalLM`
    loads; the mapping is exact (trainer/hf_export.py).

    python -m ds3d.trainer.export --store file:///…/store/JOB [--step N] --out DIR \
        [--format hf [--tokenizer tokenizer.json]]

It lives in the trainer because it needs the model (its TP split patterns, `GPTSequential`,
the Hugging Face mapping); what it reads from the store goes through storage's `Catalog`
(the newest committed checkpoint whose files verify), which knows no model.

Weights are exported in the dtype the engine holds its module in (fp32 for fp32 jobs; bf16 or
fp16 module weights for mixed-precision jobs, whose fp32 master copies live in the optimizer
state); ZeRO-3 exports are fp32.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.layout import CKPT_ROOT
from ds3d.checkpoints.storage import join_url, open_storage

from .errors import CheckpointError, ConfigError, Ds3dError

_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_MODEL_STATES = "mp_rank_00_model_states.pt"  # pipeline and ZeRO-0/1/2 engines, TP rank 0
_ZERO3_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO-3: one per DP rank


def _join_axis(name: str) -> int | None:
    """The axis TP shards of `name` join on (None: replicated on every TP rank)."""
    from .checkpoint_info import JOIN_ON_DIM_1, TP_REPLICATED

    qualified = "0." + name  # the patterns expect the "<layer>." prefix
    if any(re.match(p, qualified) for p in TP_REPLICATED):
        return None
    if any(re.match(p, qualified) for p in JOIN_ON_DIM_1):
        return 1
    if name.endswith("embed.weight"):
        return 0
    return None


def consolidate(ckpt_dir: Path, tp: int) -> dict[str, Any]:
    """{"<layer>.<param>": full tensor} from one tag's files, whichever engine wrote them."""
    if any(_LAYER_FILE.match(f.name) for f in ckpt_dir.iterdir()):
        return _join_tp(_pipeline_shards(ckpt_dir), tp)
    if (ckpt_dir / _ZERO3_STATES).is_file():  # ZeRO-3: the weights live in the optimizer shards
        modules = {r: _zero3_weights(ckpt_dir, r) for r in range(tp)}
    elif (ckpt_dir / _MODEL_STATES).is_file():
        modules = {r: _module_of(ckpt_dir, r) for r in range(tp)}
    else:
        raise CheckpointError(f"{ckpt_dir} holds neither pipeline layer files (layer_*-model_*) "
                              f"nor {_MODEL_STATES} / {_ZERO3_STATES}: not a DeepSpeed checkpoint "
                              "written by ds3d")
    by_layer: dict[int, dict[int, dict[str, Any]]] = {}
    for r, module in modules.items():
        for qualified, tensor in module.items():
            layer, name = qualified.split(".", 1)
            by_layer.setdefault(int(layer), {}).setdefault(r, {})[name] = tensor
    return _join_tp(by_layer, tp)


def _pipeline_shards(ckpt_dir: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """layer -> TP rank -> {param: tensor}, from the pipeline engine's per-layer files."""
    import torch

    shards: dict[int, dict[int, dict[str, Any]]] = {}
    for f in ckpt_dir.iterdir():
        m = _LAYER_FILE.match(f.name)
        if m:
            shards.setdefault(int(m.group(1)), {})[int(m.group(2))] = torch.load(
                f, map_location="cpu", weights_only=False)
    return shards


def _module_of(ckpt_dir: Path, tp_rank: int) -> dict[str, Any]:
    """The plain engine's module state of one TP rank ("<layer>.<param>" names)."""
    path = ckpt_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"
    if not path.is_file():
        raise CheckpointError(f"{path.name} is missing from {ckpt_dir}: TP rank {tp_rank}'s "
                              "weights are not in this checkpoint")
    module = _load(path).get("module")
    if not isinstance(module, dict) or not module:
        raise CheckpointError(f"{path} holds no module weights")
    return module


def _zero3_weights(ckpt_dir: Path, tp_rank: int) -> dict[str, Any]:
    """fp32 weights of one TP rank of a ZeRO-3 checkpoint, gathered from its DP ranks' optimizer
    shards by DeepSpeed's zero_to_fp32 (which expects one TP rank per folder: it is given a
    folder of links to this rank's files only)."""
    import os

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    suffix = f"mp_rank_{tp_rank:02d}_"
    mine = [f for f in ckpt_dir.iterdir() if suffix in f.name]
    with tempfile.TemporaryDirectory(prefix="ds3d-zero3-") as tmp:
        tag_dir = Path(tmp) / ckpt_dir.name
        tag_dir.mkdir()
        for f in mine:
            os.symlink(f.resolve(), tag_dir / f.name)
        try:
            return dict(get_fp32_state_dict_from_zero_checkpoint(tmp, tag=ckpt_dir.name))
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise CheckpointError(f"gathering the ZeRO-3 weights of TP rank {tp_rank} from "
                                  f"{ckpt_dir} failed: {e}") from None


def _join_tp(shards: dict[int, dict[int, dict[str, Any]]], tp: int) -> dict[str, Any]:
    import torch

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


def _load(path: Path) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return state


FORMATS = ("ds3d", "hf")


def export(store_url: str, out_dir: str | Path, step: int | None = None, fmt: str = "ds3d",
           tokenizer: str | None = None, tokenizer_from: str = "--tokenizer") -> dict[str, Any]:
    """Writes the weights of the job whose store prefix is `store_url` to OUT: format "ds3d"
    (model.safetensors + config.json for `load_exported`) or "hf" (a transformers GPT-NeoX
    folder, with the tokenizer's files when `tokenizer` is given; `tokenizer_from` names where
    it came from in an error). Returns a summary: step, parameters, dtype, source_layout,
    files, config."""
    if fmt not in FORMATS:
        raise CheckpointError(f"export format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    if tokenizer is not None and fmt != "hf":
        raise CheckpointError("a tokenizer is written only with the hf format; add --format hf "
                              "or leave --tokenizer out")
    if step is not None and step < 0:
        raise CheckpointError(f"--step {step}: a step is a whole number from 0")
    out, created = _output_folder(out_dir)  # both checked before a checkpoint is downloaded
    try:
        return _export_into(out, store_url, step, fmt, tokenizer, tokenizer_from)
    except BaseException:
        for folder in reversed(created):  # a failed export leaves no empty folder behind
            try:
                folder.rmdir()
            except OSError:
                break  # not empty (something else was written there): kept
        raise


def _export_into(out: Path, store_url: str, step: int | None, fmt: str,
                 tokenizer: str | None, tokenizer_from: str) -> dict[str, Any]:
    from .hf_export import save_weights

    if tokenizer is not None:
        from .text_tokenizer import TextTokenizer

        try:
            TextTokenizer(tokenizer)
        except ConfigError as e:
            fix = ("" if tokenizer_from == "--tokenizer" else "; give --tokenizer with the "
                   "tokenizer the data was made with (its new path, if it was moved)")
            raise CheckpointError(f"{tokenizer_from}: {e}{fix}") from None
    storage = open_storage(store_url)
    with tempfile.TemporaryDirectory(prefix="ds3d-export-") as scratch:
        catalog = Catalog(storage, scratch)
        found = catalog.newest_restorable(checksums=True, download=True, only_step=step)
        if found is None:
            raise CheckpointError(_nothing_to_export(catalog, storage, store_url, step))
        m = found.manifest
        tag_dir = Path(scratch) / m.tag
        ds_state = _read_model_states(tag_dir)
        job = ds_state.get("ds_config", {})
        tensors = consolidate(tag_dir, m.layout.tp)
        model_cfg = _model_config(tag_dir)
    dtype = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    summary = {"job": m.job, "step": m.step, "tokens_seen": m.tokens_seen,
               "source_layout": m.layout.model_dump(), "model_hash": m.model_hash,
               "dtype": dtype, "train_batch_size": job.get("train_batch_size"),
               "zero_stage": job.get("zero_optimization", {}).get("stage"),
               "parameters": sum(t.numel() for t in tensors.values()), "format": fmt}
    if fmt == "hf":
        from .config import ModelConfig
        from .hf_export import write_hf

        try:
            written = write_hf(out, tensors, ModelConfig.model_validate(model_cfg), tokenizer,
                               {k: summary[k] for k in ("job", "step", "tokens_seen",
                                                        "source_layout", "model_hash")})
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        return {**summary, "files": written["files"], "config": written["config"],
                "tokenizer": tokenizer}
    config = {"architecture": "ds3d-gpt", "format": 1, "model": model_cfg,
              "positions": "rotary", "norm": "pre-layernorm", "mlp": "gelu",
              "tied_embeddings": False, **{k: v for k, v in summary.items() if k != "format"}}
    out.mkdir(parents=True, exist_ok=True)
    save_weights(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {**config, "files": ["config.json", "model.safetensors"], "config": config}


def _nothing_to_export(catalog: Catalog, storage: Any, url: str, step: int | None) -> str:
    """Why no checkpoint was found, with what to give instead: the steps that are committed,
    or the job's prefix when `url` is the store's root (the folder above the job's)."""
    what = f"step {step}" if step is not None else "any step"
    msg = f"no complete, verified checkpoint of {what} in {url}"
    found = catalog.list()
    committed = [i.step for i in found if i.state == CkptState.COMMITTED]
    if committed:
        shown = ", ".join(map(str, committed[-10:]))
        more = f" (the newest 10 of {len(committed)})" if len(committed) > 10 else ""
        return (f"{msg}; its committed steps are {shown}{more}"
                + ("" if step is None else ": give one of them as --step, or leave --step out"))
    jobs = sorted({key.split("/", 1)[0] for key in (o.key for o in storage.list(""))
                   if key.count("/") >= 2 and key.split("/", 2)[1] + "/" == CKPT_ROOT})
    if jobs:
        return (f"{msg}: it is a store's root holding the job folder(s) {', '.join(jobs)}; "
                f"give the job's prefix, e.g. --store {join_url(url, jobs[0])}")
    return msg + ("" if found else "; it holds no checkpoint (is it the job's store "
                  "prefix, e.g. file:///state/jobs/JOB/store/JOB?)")


def _output_folder(out_dir: str | Path) -> tuple[Path, list[Path]]:
    """The export's folder, created, and the folders made for it (outermost first): an empty
    --out (an unset shell variable) would write into the current folder, and a path that is a
    file or cannot be made was a traceback. A folder holding files is refused: an export's
    files beside another's (an old tokenizer.json beside a new model) load as one."""
    if not str(out_dir).strip():
        raise CheckpointError("the export folder (--out) is empty; give a folder, e.g. "
                              "--out exports/step-100")
    if "://" in str(out_dir):
        raise CheckpointError(f"--out {str(out_dir)!r} is not a local folder; export here and "
                              "copy it, or use `ds3dctl export JOB --out s3://bucket/prefix`, "
                              "which uploads the export")
    out = Path(out_dir)
    if out.is_dir() and (held := sorted(p.name for p in out.iterdir())):
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise CheckpointError(f"--out {str(out)!r} is not empty (it holds {shown}); give a new "
                              "or empty folder, so that no earlier export's files mix with "
                              "this one's")
    created = [p for p in (out, *out.parents) if not p.exists()][::-1]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CheckpointError(f"--out {str(out)!r} is a file; give a folder for the export") \
            from None
    except OSError as e:
        raise CheckpointError(f"--out {str(out)!r}: cannot create the folder ({e.strerror}); "
                              "give a folder you can write") from None
    return out, created


def _read_model_states(tag_dir: Path) -> dict[str, Any]:
    for name in (_MODEL_STATES, _ZERO3_STATES):
        if (tag_dir / name).exists():
            return _load(tag_dir / name)
    return {}


def _model_config(tag_dir: Path) -> dict[str, Any]:
    """The architecture, from the job config the trainer recorded next to the checkpoint."""
    state = _read_model_states(tag_dir)
    model: dict[str, Any] | None = state.get("ds3d", {}).get("model")
    if model is None:
        raise CheckpointError(f"{tag_dir} does not record its model configuration (saved by an "
                              "older ds3d); export needs it")
    return model


def load_exported(path: str | Path) -> Any:
    """The exported model as a plain single-process torch module (TP = PP = 1)."""
    import torch
    from safetensors.torch import load_file

    from .config import JobConfig, ModelConfig
    from .model import GPTSequential
    from .tensor_parallel import TPGroup

    path = Path(path)
    m = ModelConfig.model_validate(json.loads((path / "config.json").read_text())["model"])
    with torch.device("meta"):  # no initialisation: every weight comes from the file
        model = GPTSequential(JobConfig(model=m), TPGroup(None, 0, 1))
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True, assign=True)
    return model.eval()  # rotary tables are derived per device at the first call (kernels.py)


def _step(value: str) -> int:
    """--step as ds3dctl takes it: a whole number from 0 (argparse's refusal, exit 2)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number from 0")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds3d.trainer.export",
                                 description="consolidated weights (safetensors + config.json) "
                                 "from a committed ds3d checkpoint of any (TP, PP, DP) layout "
                                 "and ZeRO stage, as ds3d's format or Hugging Face GPT-NeoX")
    ap.add_argument("--store", required=True, help="the job's store prefix, e.g. "
                    "s3://bucket/ds3d/JOB or file:///state/jobs/JOB/store/JOB")
    ap.add_argument("--step", type=_step, help="default: the newest committed checkpoint")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--format", choices=FORMATS, default="ds3d", help="ds3d: safetensors for "
                    "load_exported; hf: a transformers GPT-NeoX folder")
    ap.add_argument("--tokenizer", help="hf format: the tokenizer the data was made with "
                    "(tokenizer.json or folder), written beside the model")
    args = ap.parse_args(argv)
    try:
        cfg = export(args.store, args.out, args.step, args.format, args.tokenizer)
    except Ds3dError as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    print(f"exported step {cfg['step']} ({cfg['parameters']:,} parameters, {cfg['dtype']}) "
          f"to {args.out} as {args.format}: {', '.join(cfg['files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
