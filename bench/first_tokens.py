"""When each request of an online run got its first token, for runs side by side (`kvfleet bench serve`'s JSON,
its `per_request` list).

    python bench/first_tokens.py compare A.json B.json ... [--json OUT.json]

Issue 16's 300-at-once row: kvfleet's TTFT is 5-9 % above vLLM's, while the same work in process is level and
kvfleet's online steps are its in-process ones (lease 29's step timeline). Ranked by when it came, a burst's first
tokens arrive a step's prompts at a time. A line through (rank, first-token time) has an intercept, when the first
tokens began (the intake and the first steps), and a slope, the time a request's prefill adds (the steps' pace): a
later start moves the intercept, slower work the slope.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class FirstTokens:
    requests: int
    sent_span_ms: float        # the first send to the last
    first_ms: float            # the first first token, from the first send
    median_ms: float           # the median request's first token
    last_ms: float             # the last first token
    intercept_ms: float        # the fitted line at rank 0
    slope_ms: float            # the fitted line's ms a request
    ttft_mean_ms: float


def summarize(per_request: list[dict[str, float | None]]) -> FirstTokens:
    """The shape of the first tokens of one run (`per_request` of `kvfleet bench serve`'s JSON)."""
    done = [r for r in per_request if r["first_token_s"] is not None and r["ttft_ms"] is not None]
    if len(done) < 2:
        raise ValueError(f"per_request: needs two requests with a first token, got {len(done)}")
    t0 = min(float(r["sent_s"] or 0.0) for r in done)
    firsts = sorted((float(r["first_token_s"] or 0.0) - t0) * 1e3 for r in done)
    sent = [(float(r["sent_s"] or 0.0) - t0) * 1e3 for r in done]
    fit = statistics.linear_regression(range(len(firsts)), firsts)
    return FirstTokens(len(done), round(max(sent), 3), round(firsts[0], 3), round(statistics.median(firsts), 3),
                       round(firsts[-1], 3), round(fit.intercept, 3), round(fit.slope, 4),
                       round(statistics.fmean(float(r["ttft_ms"] or 0.0) for r in done), 3))


def read_run(path: Path) -> list[dict[str, float | None]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if "per_request" not in data:
        raise ValueError(f"{path}: no per_request list (written by kvfleet bench serve since lease 29)")
    return list(data["per_request"])


def table(names: list[str], runs: list[FirstTokens]) -> str:
    lines = ["| figure | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for field in asdict(runs[0]):
        lines.append(f"| {field} | " + " | ".join(str(asdict(r)[field]) for r in runs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare", help="runs side by side")
    cmp.add_argument("runs", nargs="+", type=Path, help="JSON files of kvfleet bench serve (compare's online-*.json)")
    cmp.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    names, runs = [], []
    for path in args.runs:   # runs of earlier leases have no per_request list: left out, said so
        try:
            runs.append(summarize(read_run(path)))
            names.append(path.stem)
        except (OSError, ValueError) as exc:
            print(f"first_tokens: skipped: {exc}", file=sys.stderr)
    if not runs:
        print("first_tokens: error: no run to compare", file=sys.stderr)
        return 2
    print(table(names, runs))
    if args.json is not None:
        args.json.write_text(json.dumps({n: asdict(r) for n, r in zip(names, runs, strict=True)}, indent=1) + "\n",
                             encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
