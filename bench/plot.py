"""Throughput by backend and workload (with the issue's vLLM figures) as a PNG.

Usage: python bench/plot.py OUT.png [NAME=]RESULTS_DIR [[NAME=]RESULTS_DIR ...]
(one kvfleet series per results folder, named after it, or per variant of an A/B folder whose labels
end in -sync / -async; hf runs from any folder)
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
KV_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e")


Series = dict[tuple[str, str, str], tuple[float, float]]


def collect(folders: list[tuple[str, Path]]) -> tuple[Series, list[tuple[str, str]]]:
    """(series, model, workload) -> (output tok/s, total tok/s), and the series with their colours."""
    data: dict[tuple[str, str, str], tuple[float, float]] = {}
    series: list[tuple[str, str]] = []
    for series_name, folder in folders:
        for label, r in sorted(load_runs(folder).items()):
            if r["backend"] == "kvfleet":
                # an A/B run in one folder (labels ending -sync / -async) gives a series per variant
                variant = label.rsplit("-", 1)[1] if label.endswith(("-sync", "-async")) else ""
                name = f"kvfleet {series_name}" + (f" {variant}" if variant else "")
                if all(name != s for s, _ in series):
                    series.append((name, KV_COLORS[len(series) % len(KV_COLORS)]))
            else:
                name = "hf static batches"
            data[(name, r["model"], r["workload"])] = (r["output_tokens_per_s"], r["total_tokens_per_s"])
    series += [("vLLM 0.26 (issue)", "#999999"), ("hf static batches", "#d62728")]
    for (model, wl), (out, tot) in VLLM.items():
        data[("vLLM 0.26 (issue)", model, wl)] = (float(out), float(tot))
    return data, series


def plot(folders: list[tuple[str, Path]], out_png: Path) -> None:
    data, series_list = collect(folders)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in ((axes[0], 0, "output tokens/s"), (axes[1], 1, "total tokens/s")):
        groups = [(m, w) for m in MODELS for w in WORKLOADS]
        width = 0.8 / len(series_list)
        for i, (series, color) in enumerate(series_list):
            xs, ys = [], []
            for g, (m, w) in enumerate(groups):
                if (series, m, w) in data:
                    xs.append(g + (i - (len(series_list) - 1) / 2) * width)
                    ys.append(data[(series, m, w)][metric])
            bars = ax.bar(xs, ys, width, label=series, color=color)
            ax.bar_label(bars, labels=[f"{y / 1000:.1f}k" if y >= 1000 else f"{y:.0f}" for y in ys], fontsize=6,
                         padding=1)
        ax.set_xticks(range(len(groups)), [f"{m}\n{w}" for m, w in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{title} (H200, bf16, dummy weights; hf on a subset)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    # NAME=DIR names a folder's series (default: the folder's name)
    plot([(a.split("=", 1)[0], Path(a.split("=", 1)[1])) if "=" in a else (Path(a).name, Path(a))
          for a in argv[2:]], out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
