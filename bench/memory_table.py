"""Predicted (trainer/memory_model.py) against measured peak GPU memory, from the `memory_*`
sections of a gpu_bench.py result file:

    python bench/memory_table.py bench/results/gpu-train.json   # markdown table to stdout
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results")
    args = ap.parse_args()
    import gpu_bench

    from ds3d.trainer.config import build_job_config
    from ds3d.trainer.memory_model import GiB, estimate

    report = json.loads(Path(args.results).read_text())
    bench_args = argparse.Namespace(device="cuda", quick=report.get("quick", False))
    print("| configuration | parameters | predicted peak | max allocated | error | max reserved |")
    print("|---|---|---|---|---|---|")
    for name, r in report["sections"].items():
        if not name.startswith("memory_") or "max_allocated_GiB" not in r:
            continue
        cfg = build_job_config("gpt1b", gpu_bench.job_sets(bench_args) + r["sets"], name="bench")
        predicted = estimate(cfg).peak.gpu_total / GiB
        measured = r["max_allocated_GiB"]
        print(f"| `{name[7:]}` ({', '.join(r['sets'])}) | {r['parameters'] / 1e9:.2f}B | "
              f"{predicted:.2f} GiB | {measured:.2f} GiB | {predicted / measured - 1:+.1%} | "
              f"{r['max_reserved_GiB']:.2f} GiB |")


if __name__ == "__main__":
    main()
