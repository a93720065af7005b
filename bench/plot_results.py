"""Plots of the committed benchmark results (docs/img/*.png), from bench/results/*.json.

    python bench/plot_results.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS, IMG = ROOT / "bench" / "results", ROOT / "docs" / "img"


def gpu_throughput() -> None:
    path = RESULTS / "gpu-train.json"  # one invocation: no rows from other runs beside them
    sections = json.loads(path.read_text())["sections"] if path.exists() else {}
    rows = [("minimal GPT", "minimal"), ("minimal GPT + torch.compile", "minimal_compile"),
            ("DeepSpeed + ds3d's model", "deepspeed"),
            ("DeepSpeed + ds3d's model + compile", "deepspeed_compile"),
            ("ds3d", "ds3d"), ("ds3d + compile", "ds3d_compile")]
    rows = [(label, sections[key]) for label, key in rows if "step_s" in sections.get(key, {})]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [r[0] for r in rows]
    mfu = [100 * r[1]["mfu_datasheet"] for r in rows]
    colors = ["#1f77b4" if "ds3d" in label else "#aaaaaa" for label in labels]
    ax.barh(labels[::-1], mfu[::-1], color=colors[::-1])
    for i, v in enumerate(mfu[::-1]):
        ax.text(v + 0.5, i, f"{v:.1f}%", va="center", fontsize=8)
    ax.set_xlabel("MFU (% of 989 TFLOP/s dense bf16)")
    ax.set_title("1.41B GPT, seq 2048, micro-batch 8, bf16, one H200", fontsize=9)
    fig.tight_layout()
    fig.savefig(IMG / "gpu-mfu.png", dpi=120)


def checkpoint_stall() -> None:
    path = RESULTS / "gpu-ckpt.json"
    if not path.exists():
        return
    c = json.loads(path.read_text())["sections"].get("checkpoint", {})
    if "sync_blocked_s" not in c:
        return
    bars = [("DeepSpeed save_checkpoint", c["sync_blocked_s"]),
            ("ds3d, first save", c["ds3d_blocked_s"][0]),
            ("ds3d, steady state", c["ds3d_blocked_s"][-1]),
            ("floor: bytes / pinned D2H", c.get("floor_s", 0))]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1],
            color=["#aaaaaa", "#1f77b4", "#1f77b4", "#2ca02c"][::-1])
    ax.set_xscale("log")
    for i, (_, v) in enumerate(bars[::-1]):
        ax.text(v * 1.1, i, f"{v:.2f} s", va="center", fontsize=8)
    ax.set_xlabel("seconds training is blocked by one save (log scale)")
    ax.set_title(f"checkpoint of {c.get('state_bytes', 0) / 1e9:.1f} GB (1.41B GPT, ZeRO-1 bf16)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(IMG / "gpu-checkpoint-stall.png", dpi=120)


if __name__ == "__main__":
    IMG.mkdir(parents=True, exist_ok=True)
    gpu_throughput()
    checkpoint_stall()
    print("wrote", sorted(p.name for p in IMG.glob("*.png")))
