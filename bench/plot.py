"""Throughput by backend and workload (with the issue's vLLM figures) as a PNG.

Usage: python bench/plot.py [RESULTS_DIR] [OUT.png]   (default bench/results/final, bench/results/throughput.png)
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize import VLLM, load_runs  # noqa: E402

MODELS = ("llama-3.1-8b", "qwen3-0.6b")
WORKLOADS = ("random-1024-128", "chat-mix")
SERIES = (("kvfleet", "#1f77b4"), ("vLLM 0.26 (issue)", "#999999"), ("hf static batches", "#d62728"))


def collect(folder: Path) -> dict[tuple[str, str, str], tuple[float, float]]:
    """(series, model, workload) -> (output tok/s, total tok/s)."""
    data: dict[tuple[str, str, str], tuple[float, float]] = {}
    for r in load_runs(folder).values():
        series = "kvfleet" if r["backend"] == "kvfleet" else "hf static batches"
        data[(series, r["model"], r["workload"])] = (r["output_tokens_per_s"], r["total_tokens_per_s"])
    for (model, wl), (out, tot) in VLLM.items():
        data[("vLLM 0.26 (issue)", model, wl)] = (float(out), float(tot))
    return data


def plot(folder: Path, out_png: Path) -> None:
    data = collect(folder)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in ((axes[0], 0, "output tokens/s"), (axes[1], 1, "total tokens/s")):
        groups = [(m, w) for m in MODELS for w in WORKLOADS]
        width = 0.27
        for i, (series, color) in enumerate(SERIES):
            xs, ys = [], []
            for g, (m, w) in enumerate(groups):
                if (series, m, w) in data:
                    xs.append(g + (i - 1) * width)
                    ys.append(data[(series, m, w)][metric])
            bars = ax.bar(xs, ys, width, label=series, color=color)
            ax.bar_label(bars, labels=[f"{y / 1000:.1f}k" if y >= 1000 else f"{y:.0f}" for y in ys], fontsize=7, padding=1)
        ax.set_xticks(range(len(groups)), [f"{m}\n{w}" for m, w in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{title} (H200, bf16, dummy weights; hf on a subset)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else "bench/results/final")
    out = Path(argv[2] if len(argv) > 2 else "bench/results/throughput.png")
    plot(folder, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
