"""Two offline runs of one workload side by side, phase by phase (`--step-trace` in their JSON).

    python bench/offline_phases.py compare A.json B.json [--json OUT.json]

Issue 16's chat-mix and long-prompt rows are ~2 % behind vLLM while the step profiles of chosen shapes put our
kernels level or ahead. A run is a prefill phase (steps that start prompts, beside the decodes of those started)
and a decode tail whose batch shrinks to one: which one holds the difference? For each run (kvfleet or vLLM, the
trace recorded the same way: kvfleet.engine.bench.step_trace) this prints the prefill phase's length and steps, the
tail's, and the tail's steps by batch (how many tokens a step gave): median ms a step and seconds in all, side by
side with the ratio B / A.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvfleet.engine.bench.step_trace import PhaseSummary, StepTrace, phase_summary


def load(path: str) -> tuple[str, PhaseSummary]:
    d = json.loads(Path(path).read_text())
    if "step_trace" not in d:
        raise SystemExit(f"{path}: no step_trace (run the benchmark with --step-trace)")
    name = f"{d.get('backend', '?')} {d.get('workload', '?')}" + (f" [{d['label']}]" if d.get("label") else "")
    return name, phase_summary(StepTrace.from_json(d["step_trace"]))


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.3f}" if a > 0 else "-"


def render(names: tuple[str, str], a: PhaseSummary, b: PhaseSummary) -> str:
    rows = [
        ("steps", f"{a.steps}", f"{b.steps}", _ratio(a.steps, b.steps)),
        ("prefill phase s (to the last first token)", f"{a.prefill_end_s:.3f}", f"{b.prefill_end_s:.3f}",
         _ratio(a.prefill_end_s, b.prefill_end_s)),
        ("prefill phase steps", f"{a.prefill_steps}", f"{b.prefill_steps}", _ratio(a.prefill_steps, b.prefill_steps)),
        ("tail s", f"{a.tail_s:.3f}", f"{b.tail_s:.3f}", _ratio(a.tail_s, b.tail_s)),
        ("tail steps", f"{a.tail_steps}", f"{b.tail_steps}", _ratio(a.tail_steps, b.tail_steps)),
        ("end s (the last token)", f"{a.end_s:.3f}", f"{b.end_s:.3f}", _ratio(a.end_s, b.end_s)),
    ]
    out = [f"| figure | {names[0]} | {names[1]} | B / A |", "| --- | --- | --- | --- |"]
    out += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows]
    out += ["", f"the tail's steps by batch (tokens a step): steps, median ms a step, s in all; A = {names[0]}, "
                f"B = {names[1]}", "",
            "| batch | steps A | steps B | ms A | ms B | B / A | s A | s B |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    bins_a = {(x.lo, x.hi): x for x in a.tail_bins}
    bins_b = {(x.lo, x.hi): x for x in b.tail_bins}
    for key in sorted(set(bins_a) | set(bins_b)):
        x, y = bins_a.get(key), bins_b.get(key)
        out.append(f"| {key[0]}-{key[1] - 1} | {x.steps if x else 0} | {y.steps if y else 0} | "
                   f"{f'{x.median_ms:.2f}' if x else '-'} | {f'{y.median_ms:.2f}' if y else '-'} | "
                   f"{_ratio(x.median_ms, y.median_ms) if x and y else '-'} | "
                   f"{f'{x.total_s:.2f}' if x else '-'} | {f'{y.total_s:.2f}' if y else '-'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    cmp = sub.add_parser("compare", help="two runs' phases side by side")
    cmp.add_argument("a")
    cmp.add_argument("b")
    cmp.add_argument("--json", default=None, help="also write both summaries here")
    args = ap.parse_args(argv)
    (name_a, a), (name_b, b) = load(args.a), load(args.b)
    sys.stdout.write(render((name_a, name_b), a, b))
    if args.json:
        doc: dict[str, Any] = {"a": {"file": args.a, "name": name_a, **a.to_json()},
                               "b": {"file": args.b, "name": name_b, **b.to_json()}}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
