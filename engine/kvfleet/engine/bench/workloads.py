"""Seeded benchmark workloads: lists of (prompt token ids, output length).

- ``random-1024-128``: 1000 requests of 1024 random prompt tokens and 128 output tokens.
- ``chat-mix``: 1000 requests; prompt length ``clip(round(lognormal(5.5, 0.9)), 16, 4096)``,
  output length ``clip(round(lognormal(5.0, 0.8)), 8, 1024)``, both drawn (1000 at a time,
  prompt lengths first) from ``numpy.random.default_rng(0)``, then each prompt's tokens
  from the same generator in request order.

Token ids are drawn uniformly from ``[0, TOKEN_HIGH)``, below every benchmark model's
vocabulary. ``python -m kvfleet.engine.bench.workloads --out bench/workloads`` writes
them as JSONL (``{"prompt_token_ids": [...], "max_tokens": N}`` per line).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKEN_HIGH = 32000
NAMES = ("random-1024-128", "chat-mix")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def random_workload(num: int = 1000, prompt_len: int = 1024, output_len: int = 128,
                    seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TOKEN_HIGH, size=(num, prompt_len))
    return [BenchRequest(row.tolist(), output_len) for row in tokens]


def chat_mix_workload(num: int = 1000, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(np.round(rng.lognormal(5.5, 0.9, num)), 16, 4096).astype(np.int64)
    output_lens = np.clip(np.round(rng.lognormal(5.0, 0.8, num)), 8, 1024).astype(np.int64)
    return [BenchRequest(rng.integers(0, TOKEN_HIGH, size=int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def load_workload(name_or_file: str) -> list[BenchRequest]:
    """A named workload, or a JSONL file of ``{"prompt_token_ids", "max_tokens"}`` lines."""
    if name_or_file == "random-1024-128":
        return random_workload()
    if name_or_file == "chat-mix":
        return chat_mix_workload()
    path = Path(name_or_file)
    if not path.is_file():
        raise ValueError(f"workload: {name_or_file!r} is neither one of {NAMES} nor a JSONL file")
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        ids, n = rec.get("prompt_token_ids"), rec.get("max_tokens")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"workload: line {i + 1}: prompt_token_ids must be a non-empty list of ints")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"workload: line {i + 1}: max_tokens must be a positive int")
        out.append(BenchRequest(ids, n))
    return out


def write_jsonl(reqs: list[BenchRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in reqs:
            f.write(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}) + "\n")


def summary(reqs: list[BenchRequest]) -> dict[str, float]:
    p = np.array([len(r.prompt_token_ids) for r in reqs])
    o = np.array([r.max_tokens for r in reqs])
    return {"requests": len(reqs), "prompt_tokens": int(p.sum()), "output_tokens": int(o.sum()),
            "prompt_mean": float(p.mean()), "output_mean": float(o.mean()),
            "max_total_len": int((p + o).max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfleet-workloads", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/workloads", help="folder for <name>.jsonl")
    ap.add_argument("--names", nargs="*", default=list(NAMES), choices=NAMES)
    args = ap.parse_args(argv)
    for name in args.names:
        reqs = load_workload(name)
        write_jsonl(reqs, Path(args.out) / f"{name}.jsonl")
        print(name, json.dumps(summary(reqs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
