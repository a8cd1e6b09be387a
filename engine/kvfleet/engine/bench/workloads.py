"""Seeded benchmark workloads: lists of (prompt token ids, output length).

- ``random-1024-128``: 1000 requests of 1024 random prompt tokens and 128 output tokens.
- ``chat-mix``: 1000 requests; prompt length ``clip(round(lognormal(5.5, 0.9)), 16, 4096)``,
  output length ``clip(round(lognormal(5.0, 0.8)), 8, 1024)``, both drawn (1000 at a time,
  prompt lengths first) from ``numpy.random.default_rng(0)``, then each prompt's tokens
  from the same generator in request order.

Three more classes, where prefill or sharing dominates (issue 16), each from ``default_rng(0)``:

- ``long-prompt``: 96 requests of ``integers(4096, 8192)`` prompt tokens (lengths first) and
  128 output tokens: prefill-bound, attention over long contexts.
- ``shared-prefix``: 8 system prompts of 2048 tokens; 512 requests, each one system prompt
  (``integers(0, 8)``) followed by ``integers(128, 512)`` tokens of its own, 128 output tokens:
  what prefix caching saves (both engines cache prefixes by default).
- ``parallel-sampling``: 256 prompts of 512 tokens, ``n = 4`` samples each at temperature
  ``SAMPLE_TEMPERATURE`` (random sampling: vLLM refuses n > 1 when greedy), 128 output tokens each.

Token ids are drawn uniformly from ``[0, TOKEN_HIGH)``, below every benchmark model's
vocabulary. ``python -m kvfleet.engine.bench.workloads --out bench/workloads`` writes
them as JSONL (``{"prompt_token_ids": [...], "max_tokens": N}`` per line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKEN_HIGH = 32000
NAMES = ("random-1024-128", "chat-mix", "long-prompt", "shared-prefix", "parallel-sampling")
SAMPLE_TEMPERATURE = 1.0   # requests with n > 1 sample at this temperature; the others are greedy


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1   # sequences sampled from this prompt (each max_tokens long)
    repetition_penalty: float = 1.0   # 1.0: none (`--repetition-penalty` sets it for a whole run)

    @property
    def output_tokens(self) -> int:
        return self.n * self.max_tokens

    @property
    def temperature(self) -> float:
        return SAMPLE_TEMPERATURE if self.n > 1 else 0.0


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


def long_prompt_workload(num: int = 96, low: int = 4096, high: int = 8192, output_len: int = 128,
                         seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(low, high, size=num)
    return [BenchRequest(rng.integers(0, TOKEN_HIGH, size=int(n)).tolist(), output_len) for n in lens]


def shared_prefix_workload(num: int = 512, num_prefixes: int = 8, prefix_len: int = 2048, suffix_low: int = 128,
                           suffix_high: int = 512, output_len: int = 128, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, TOKEN_HIGH, size=(num_prefixes, prefix_len))
    which = rng.integers(0, num_prefixes, size=num)
    suffix_lens = rng.integers(suffix_low, suffix_high, size=num)
    return [BenchRequest(prefixes[p].tolist() + rng.integers(0, TOKEN_HIGH, size=int(s)).tolist(), output_len)
            for p, s in zip(which, suffix_lens, strict=True)]


def parallel_sampling_workload(num: int = 256, prompt_len: int = 512, n: int = 4, output_len: int = 128,
                               seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TOKEN_HIGH, size=(num, prompt_len))
    return [BenchRequest(row.tolist(), output_len, n) for row in tokens]


BUILDERS: dict[str, Callable[..., list[BenchRequest]]] = {
    "random-1024-128": random_workload, "chat-mix": chat_mix_workload, "long-prompt": long_prompt_workload,
    "shared-prefix": shared_prefix_workload, "parallel-sampling": parallel_sampling_workload}


def named_workload(name: str, seed: int = 0) -> list[BenchRequest]:
    """One of NAMES, drawn from ``default_rng(seed)`` (seed 0: the published workloads)."""
    if name not in BUILDERS:
        raise ValueError(f"workload: {name!r} is not one of {NAMES}")
    return BUILDERS[name](seed=seed)


def load_workload(name_or_file: str) -> list[BenchRequest]:
    """A named workload, or a JSONL file of ``{"prompt_token_ids", "max_tokens"[, "n"]}`` lines."""
    if name_or_file in BUILDERS:
        return named_workload(name_or_file)
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
        samples = rec.get("n", 1)
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"workload: line {i + 1}: n must be a positive int")
        out.append(BenchRequest(ids, n, samples))
    return out


def write_jsonl(reqs: list[BenchRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in reqs:
            rec: dict[str, object] = {"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
            if r.n != 1:
                rec["n"] = r.n
            f.write(json.dumps(rec) + "\n")


def summary(reqs: list[BenchRequest]) -> dict[str, float]:
    p = np.array([len(r.prompt_token_ids) for r in reqs])
    o = np.array([r.max_tokens for r in reqs])
    n = np.array([r.n for r in reqs])
    return {"requests": len(reqs), "prompt_tokens": int(p.sum()), "output_tokens": int((o * n).sum()),
            "prompt_mean": float(p.mean()), "output_mean": float(o.mean()), "samples_per_request": float(n.mean()),
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
