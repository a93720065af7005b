"""Checkpoint cost, measured against baselines in the same run (CPU, gloo, one rank).

For each model (the `tiny` preset and a ~34M-parameter CPU model):
  * blocked time of a save: DeepSpeed's synchronous `engine.save_checkpoint` (its default
    TorchCheckpointEngine) vs ds3d's snapshot save (training resumes after the host copy);
    also the time until ds3d's checkpoint is committed in the store (upload + manifest);
  * upload throughput of the checkpoint's files to a real S3 server (moto_server on loopback):
    one boto3 `upload_file` per file, single-threaded, vs ds3d's S3Storage (transfer manager,
    parallel multipart).

    python -m torch.distributed.run --standalone --nproc-per-node 1 bench/checkpoint_bench.py \
        --out bench/results/checkpoint.json

`--section local-complete` (no DeepSpeed, no S3 server): a save's time from the end of its host
copy to its local-complete record, for a host state of `--state-gib` GiB written by ds3d's
snapshot writer into a local folder, with the writer hashing each file while it writes it
(hashing_writer.py) against the path before it (write, fsync, then read back and hash),
alternating in the same run:

    python bench/checkpoint_bench.py --section local-complete \
        --out bench/results/checkpoint-local-complete.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
import torch
from boto3.s3.transfer import TransferConfig

from ds3d.checkpoints.engine_io import CheckpointManager, Rank
from ds3d.checkpoints.identity import new_job_id
from ds3d.checkpoints.manifest import CheckpointMeta, Layout
from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine
from ds3d.checkpoints.storage import open_storage
from ds3d.checkpoints.upload import Uploader, UploadEvent
from ds3d.trainer.config import build_job_config
from ds3d.trainer.engine import TrainStep
from ds3d.trainer.layout import ParallelLayout, ProcessEnv, init_distributed

MODELS = {
    "tiny": [],
    "cpu-34m": ["model.vocab_size=8192", "model.d_model=512", "model.n_layers=8",
                "model.n_heads=8", "model.seq_len=128", "train.micro_batch_size=2",
                "train.global_batch_size=2"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto_server did not start")


def start_rgw(work: Path):
    """Ceph RGW (a production S3 server) through the test suite's own fixture code."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fixtures.rgw import CephRgw, missing_binaries

    if missing_binaries():
        raise SystemExit(f"Ceph RGW needs {missing_binaries()} (apt-get install radosgw ceph-mon "
                         "ceph-osd uuid-runtime)")
    cluster = CephRgw(work / "ceph")
    ep = cluster.start()
    return cluster, ep.url, (ep.access_key, ep.secret_key)


def bench_model(name: str, sets: list[str], work: Path, endpoint: str, repeats: int,
                keys: tuple[str, str] = ("bench", "bench")) -> dict:
    os.environ.update(AWS_ACCESS_KEY_ID=keys[0], AWS_SECRET_ACCESS_KEY=keys[1],
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    bucket = f"bench-{name}"
    s3.create_bucket(Bucket=bucket)
    cfg = build_job_config("tiny", sets + [f'checkpoint.store="s3://{bucket}/ds3d"',
                                           "checkpoint.keep_last=100"], name=name)
    env = ProcessEnv.from_env()
    layout = ParallelLayout(cfg, env)
    device = torch.device("cpu")
    run_dir = work / name
    step_fn = TrainStep(cfg, layout, device)
    engine = step_fn.engine
    ckpt = CheckpointManager(cfg.checkpoint_settings(), run_dir, Rank(0, 1, 0, 1, 1, 1), device,
                             lambda *a, **k: None)
    n_params = sum(p.numel() for p in engine.module.parameters())

    sync_blocked, ours_blocked, ours_durable, ours_copy = [], [], [], []
    step = 0
    for i in range(repeats):
        step_fn.run(step)
        step += 1
        # baseline: DeepSpeed's own synchronous save (its default checkpoint engine)
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )
        engine.checkpoint_engine = TorchCheckpointEngine()
        t0 = time.perf_counter()
        engine.save_checkpoint(str(work / f"{name}-sync"), tag=f"sync{i}", save_latest=False)
        sync_blocked.append(time.perf_counter() - t0)
        step_fn.run(step)
        step += 1
        t0 = time.perf_counter()
        blocked = ckpt.save(engine, step, {"iteration": step}, step, {"step": step})
        ours_blocked.append(blocked)
        ours_copy.append(ckpt.snapshot.copy_seconds)
        ckpt.wait_uploads(600)
        ours_durable.append(time.perf_counter() - t0)
    ckpt.close()

    # upload throughput on the same files: single-threaded upload_file per file vs S3Storage
    tag_dir = run_dir / "ckpt" / f"global_step{step}"
    files = sorted(p for p in tag_dir.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    single = TransferConfig(use_threads=False, multipart_threshold=8 << 30)
    t0 = time.perf_counter()
    for p in files:
        s3.upload_file(str(p), bucket, f"baseline/{p.name}", Config=single)
    base_s = time.perf_counter() - t0
    storage = open_storage(f"s3://{bucket}/ours")
    t0 = time.perf_counter()
    for p in files:
        storage.put_file(p, p.name)
    ours_s = time.perf_counter() - t0
    state_bytes = sum(p.stat().st_size for p in (work / f"{name}-sync" / "sync0").rglob("*")
                      if p.is_file())
    return {
        "model": name, "parameters": n_params, "checkpoint_bytes": state_bytes,
        "saves": repeats,
        "sync_save_blocked_s": statistics.median(sync_blocked),
        "ds3d_blocked_s": statistics.median(ours_blocked),
        "ds3d_host_copy_s": statistics.median(ours_copy),
        "ds3d_time_to_committed_s": statistics.median(ours_durable),
        "blocked_ratio_vs_sync": statistics.median(ours_blocked) / statistics.median(sync_blocked),
        "upload_bytes": total,
        "upload_single_upload_file_MiBps": total / base_s / 2**20,
        "upload_ds3d_MiBps": total / ours_s / 2**20,
        "upload_speedup": base_s / ours_s,
    }


class _Info:
    def __init__(self, tag: str) -> None:
        self.tag = tag


def bench_local_complete(work: Path, state_gib: float, repeats: int) -> dict:
    """Save -> local-complete through the real writer thread and Uploader (file store), the
    same state each time: `repeats` saves hashed while written and `repeats` written then read
    back and hashed, in the order AB BA AB ... so that drift of a shared machine hits both."""
    # DeepSpeed-like: a model-states file (1/3) and an optimizer-states file (2/3) of this rank
    tensor_bytes = 256 << 20
    n_tensors = max(3, round(state_gib * (1 << 30) / tensor_bytes))
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(tensor_bytes // 4, generator=gen) for _ in range(n_tensors)]
    model = {"module": {f"w{i}": t for i, t in enumerate(tensors[:n_tensors // 3])}, "step": 1}
    optim = {"state": {f"m{i}": t for i, t in enumerate(tensors[n_tensors // 3:])}}
    local = work / "local"
    events: dict[int, UploadEvent] = {}
    got = threading.Condition()

    def on_event(ev: UploadEvent) -> None:
        if ev.kind == "local_complete":
            with got:
                events[ev.step] = ev
                got.notify_all()

    uploader = Uploader(open_storage(f"file://{work}/store"), local, 0, 1, on_event=on_event)
    layout = Layout(tp=1, pp=1, dp=1, world_size=1)
    job_id = new_job_id()
    metas: dict[str, tuple[int, CheckpointMeta]] = {}

    def on_durable(tag: str, paths: list[str]) -> None:
        step, meta = metas.pop(tag)
        uploader.submit(step, sorted(os.path.relpath(p, local) for p in paths), meta,
                        written=engine.written(tag))

    engine = SnapshotCheckpointEngine(on_durable=on_durable)
    runs: dict[str, list[dict]] = {"read_back": [], "while_writing": []}
    step = 0
    for i in range(repeats):
        for mode in ("read_back", "while_writing")[::1 if i % 2 == 0 else -1]:
            step += 1
            tag = f"global_step{step}"
            (local / tag).mkdir(parents=True)
            metas[tag] = (step, CheckpointMeta(job="bench", job_id=job_id, tag=tag,
                                               layout=layout))
            engine.hash_while_writing = mode == "while_writing"
            engine.create(_Info(tag))  # type: ignore[arg-type]
            engine.save(model, str(local / tag / "mp_rank_00_model_states.pt"))
            engine.save(optim, str(local / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
            engine.commit(_Info(tag))  # type: ignore[arg-type]
            t0 = time.monotonic()
            with got:
                got.wait_for(lambda s=step: s in events, timeout=600)
            took = time.monotonic() - t0
            uploader.wait(600)
            ev = events[step]
            runs[mode].append({"save_to_local_complete_s": round(took, 3),
                               "copy_s": round(engine.copy_seconds, 3), **ev.timings})
            # keep the disk and the page cache to one save's files (the store hard-links them)
            shutil.rmtree(local / tag)
            shutil.rmtree(work / "store" / "ckpt", ignore_errors=True)
    engine.close()
    uploader.close(10)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    med = {m: statistics.median(r["save_to_local_complete_s"] for r in rs)
           for m, rs in runs.items()}
    return {"state_bytes": nbytes, "files": 2, "saves_per_mode": repeats, "runs": runs,
            "median_save_to_local_complete_s": med,
            "ratio_while_writing_vs_read_back": med["while_writing"] / med["read_back"]}


def main_local_complete(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="ds3d-ckpt-bench-", dir=args.work_dir))
    load_before = os.getloadavg()[0]
    try:
        result = bench_local_complete(work, args.state_gib, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": socket.gethostname(),
              "cpus": os.cpu_count(), "torch": torch.__version__, "section": "local-complete",
              "load_average_1min": [load_before, os.getloadavg()[0]],  # a shared machine
              **result}
    out = Path(args.out or "bench/results/checkpoint-local-complete.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'mode':14} {'save->local-complete s':>22} {'write s':>8} {'hash s':>7} "
          f"{'hash wait s':>11}")
    for mode, rs in result["runs"].items():
        for r in rs:
            print(f"{mode:14} {r['save_to_local_complete_s']:>22.2f} {r['write_s']:>8.2f} "
                  f"{r['hash_s']:>7.2f} {r['hash_wait_s']:>11.2f}")
    print(f"ratio (hashed while written / read back), medians: "
          f"{result['ratio_while_writing_vs_read_back']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--section", choices=["models", "local-complete"], default="models",
                    help="models: blocked time and commit of DeepSpeed saves to an S3 server "
                         "(under torch.distributed.run); local-complete: save -> local-complete "
                         "record, hashing while writing vs reading back")
    ap.add_argument("--out", default=None, help="default bench/results/checkpoint.json (models) "
                    "or bench/results/checkpoint-local-complete.json")
    ap.add_argument("--repeats", type=int, default=None,
                    help="saves per model (default 3) or per mode (local-complete, default 2)")
    ap.add_argument("--server", choices=["moto", "rgw"], default="moto",
                    help="S3 server on loopback: moto_server, or Ceph RGW (production server)")
    ap.add_argument("--state-gib", type=float, default=2.0, help="local-complete: state size")
    ap.add_argument("--work-dir", default=None, help="local-complete: where the files go "
                    "(default: the system's temporary folder)")
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 2 if args.section == "local-complete" else 3
    if args.state_gib <= 0 or args.repeats < 1:
        ap.error("--state-gib must be > 0 and --repeats >= 1")
    if args.section == "local-complete":
        main_local_complete(args)
        return
    init_distributed(torch.device("cpu"), timeout=__import__("datetime").timedelta(minutes=5))
    work = Path(tempfile.mkdtemp(prefix="ds3d-ckpt-bench-"))
    keys = ("bench", "bench")
    if args.server == "moto":
        server, endpoint = start_moto()
        stop = server.terminate
    else:
        cluster, endpoint, keys = start_rgw(work)
        stop = cluster.stop
    try:
        results = [bench_model(n, s, work, endpoint, args.repeats, keys)
                   for n, s in MODELS.items()]
    finally:
        stop()
        shutil.rmtree(work, ignore_errors=True)
    report = {"date": time.strftime("%Y-%m-%d"), "host": socket.gethostname(),
              "s3_server": args.server,
              "cpus": os.cpu_count(), "torch": torch.__version__,
              "deepspeed": __import__("deepspeed").__version__, "results": results}
    out = Path(args.out or "bench/results/checkpoint.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'model':10} {'params':>10} {'ckpt MB':>8} {'sync s':>8} {'ds3d s':>8} {'ratio':>6} "
          f"{'commit s':>8} {'up base':>8} {'up ds3d':>8}")
    for r in results:
        print(f"{r['model']:10} {r['parameters']:>10} {r['checkpoint_bytes'] / 1e6:>8.1f} "
              f"{r['sync_save_blocked_s']:>8.3f} {r['ds3d_blocked_s']:>8.3f} "
              f"{r['blocked_ratio_vs_sync']:>6.2f} {r['ds3d_time_to_committed_s']:>8.2f} "
              f"{r['upload_single_upload_file_MiBps']:>8.1f} {r['upload_ds3d_MiBps']:>8.1f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
