"""Print the short table of a GPU run (bench/gpu_run.sh): throughput vs the issue's vLLM figures,
kernel checks, engine check, and the decode-step probe. Usage: python bench/summarize.py DIR
(DIR holds results.json, kernels.json, engine_check.json; or bench/results/ with one JSON per run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# The issue's figures: vLLM 0.26.0 on this H200 kind (output tok/s, total tok/s) and HF static batches.
VLLM = {("llama-3.1-8b", "chat-mix"): (8473, 22819), ("llama-3.1-8b", "random-1024-128"): (3730, 33567),
        ("qwen3-0.6b", "chat-mix"): (17299, 46589), ("qwen3-0.6b", "random-1024-128"): (15427, 138839)}
HF_ISSUE = {("llama-3.1-8b", "chat-mix"): 77, ("llama-3.1-8b", "random-1024-128"): 1065}


def load_runs(folder: Path) -> dict[str, Any]:
    combined = folder / "results.json"
    if combined.is_file():
        return json.loads(combined.read_text())
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    return {name: r for name, r in runs.items() if isinstance(r, dict) and "model" in r and "backend" in r}


def table(runs: dict[str, Any]) -> list[str]:
    lines = [f"{'backend':8} {'model':13} {'workload':16} {'req':>5} {'wall s':>7} {'out tok/s':>10} "
             f"{'tot tok/s':>10} {'vs vLLM out':>11} {'vs vLLM tot':>11} {'TTFT p50':>9} {'TPOT p50':>9}"]
    for _name, r in sorted(runs.items()):
        key = (r["model"], r["workload"])
        v = VLLM.get(key)
        ratio_o = f"{r['output_tokens_per_s'] / v[0]:.2f}x" if v and r["backend"] == "kvfleet" else ""
        ratio_t = f"{r['total_tokens_per_s'] / v[1]:.2f}x" if v and r["backend"] == "kvfleet" else ""
        if r["backend"] == "hf" and key in HF_ISSUE:
            ratio_o = f"(issue {HF_ISSUE[key]})"
        ttft = f"{r['ttft_ms']['p50']:.0f}ms" if r.get("ttft_ms") else "-"
        tpot = f"{r['tpot_ms']['p50']:.1f}ms" if r.get("tpot_ms") else "-"
        lines.append(f"{r['backend']:8} {r['model']:13} {r['workload']:16} {r['num_requests']:5d} "
                     f"{r['wall_s']:7.1f} {r['output_tokens_per_s']:10.0f} {r['total_tokens_per_s']:10.0f} "
                     f"{ratio_o:>11} {ratio_t:>11} {ttft:>9} {tpot:>9}")
    for name, r in sorted(runs.items()):
        if "decode_probe" in r:
            p = r["decode_probe"]
            if "step_ms" in p:
                lines.append(f"decode step {r['model']} B={p['batch']} ctx={p['ctx']}: {p['step_ms']:.2f} ms "
                             f"(eager {p['eager_step_ms']:.2f}), floor {p['floor_ms']:.2f} ms "
                             f"({p['weight_GB']:.1f} GB weights + {p['kv_read_GB']:.1f} GB KV at "
                             f"{p['copy_bw_GBps']:.0f} GB/s) -> {p['x_floor']:.2f}x floor"
                             + (f"; roofline {p['roofline_ms']:.2f} ms -> {p['x_roofline']:.2f}x"
                                if "roofline_ms" in p else ""))
        if r["backend"] == "kvfleet":
            k = r.get("kv_peak", {})
            d = r.get("step_breakdown_ms", {}).get("decode")
            if k:
                lines.append(f"KV {name}: {r['kv_blocks_total']} blocks, peak {k.get('kv_blocks_used')} used "
                             f"({100 * k.get('kv_cache_usage', 0):.0f}%), {k.get('num_running')} running, wasted "
                             f"{k.get('wasted_blocks_per_seq', 0):.2f} blocks/seq; preemptions {r['num_preemptions']}")
            if d:
                lines.append(f"  decode steps {d['steps']} (mean batch {d['mean_batch']:.0f}): "
                             f"step {d['step_ms']:.2f} ms = "
                             f"schedule {d['schedule_ms']:.2f} + prepare {d['prepare_ms']:.2f} + forward "
                             f"{d['forward_ms']:.2f} + sample {d['sample_ms']:.2f} + update {d['update_ms']:.2f} "
                             f"+ outputs {d['outputs_ms']:.2f}")
    return lines


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else "bench/results")
    kern = folder / "kernels.json"
    if kern.is_file():
        k = json.loads(kern.read_text())
        bad = [c["check"] for c in k["checks"] if not c["ok"]]
        print(f"kernel checks: {len(k['checks']) - len(bad)}/{len(k['checks'])} ok {bad if bad else ''}")
        best: dict[str, Any] = {}
        for t in k["timings"]:
            if "x_floor" in t and (t["kernel"] not in best or t["ms"] < best[t["kernel"]]["ms"]):
                best[t["kernel"]] = t
        for name, t in best.items():
            print(f"  {name}: best {t['ms']:.3f} ms [{t['config']}], {t['x_floor']:.2f}x its KV-read floor")
    eng = folder / "engine_check.json"
    if eng.is_file():
        e = json.loads(eng.read_text())
        print(f"engine greedy fp32 GPU==CPU==transformers on tiny llama/qwen3: {e.get('all_fp32_equal')}")
    for line in table(load_runs(folder)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
