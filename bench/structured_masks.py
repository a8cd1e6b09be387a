"""Host cost of structured outputs per step, on CPU: the allowed-token bitmasks of B constrained sequences.

Every step, each constrained sequence asks its llguidance matcher for the tokens it may take next, on the host,
before the step can be launched (its mask needs the token the previous step sampled, so async scheduling does not
launch it ahead). This times that for B sequences with the real code (`model_runner.allowed_tokens`, which builds
the bitmask the sampler reads, one row at a time) and the embedded SmolLM2 tokenizer (49,152 tokens), beside
llguidance's own thread pool (`LLExecutor` with `fill_next_token_bitmask_par`) on the same rows:

- constraint: a JSON schema (an object with a string, an integer, an enum and a list of numbers), the states
  spread over the document: each sequence is advanced by a seeded random walk over allowed tokens of its own
  length (0-40 tokens), so some are inside strings (wide masks), some between keys (narrow ones);
- wall time (the pool's threads work for the caller), median of R rounds, per B.

    .venv/bin/python bench/structured_masks.py --label quiet-r2   # -> bench/results/host/structured-masks-<label>.json

(quiet-r1, r2: this 2-core machine idle; busy-r1: two `nice` CPU burners beside it.)

Applying the masks on the GPU is bench/gpu_token_bitmask.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from llguidance import LLExecutor
from llguidance.numpy import fill_next_token_bitmask_par

from kvfleet.engine.core.grammar import TokenGrammar
from kvfleet.engine.model_runner import allowed_tokens
from kvfleet.engine.sampling_params import StructuredOutputsParams
from kvfleet.engine.structured_outputs import GrammarCompiler, GuidedGrammar
from kvfleet.engine.tokenizer import find_default_model, load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tier": {"enum": ["free", "pro", "team"]},
    "scores": {"type": "array", "items": {"type": "number"}}},
    "required": ["name", "age", "tier", "scores"], "additionalProperties": False}


def walked(compiler: GrammarCompiler, rng: np.random.Generator, steps: int) -> GuidedGrammar:
    """A constraint advanced by `steps` random allowed tokens (fewer if it completes)."""
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    mask = np.zeros((1, grammar.bitmask_words()), dtype=np.int32)
    for _ in range(steps):
        grammar.fill_bitmask(mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
        token = int(rng.choice(allowed))
        if not grammar.accept(token) or grammar.is_terminated():
            break
    return grammar


def timed(fn: Callable[[], None], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a model folder or GGUF whose tokenizer to use (default: the "
                                                  "embedded SmolLM2)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results" / "host"))
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.model or find_default_model())
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    rng = np.random.default_rng(args.seed)
    biggest = max(int(b) for b in args.batches.split(","))
    grammars = [walked(compiler, rng, int(rng.integers(0, 41))) for _ in range(biggest)]
    words = grammars[0].bitmask_words()
    pool = LLExecutor()
    cpu = torch.device("cpu")
    rows: list[dict[str, Any]] = []
    for b in (int(x) for x in args.batches.split(",")):
        batch, out = grammars[:b], np.zeros((b, words), dtype=np.int32)
        constrained: list[tuple[int, TokenGrammar]] = list(enumerate(batch))
        pairs = [(g.matcher, j) for j, g in enumerate(batch)]
        serial = timed(lambda: allowed_tokens(constrained, cpu, False), args.rounds)   # noqa: B023
        engine_mask = allowed_tokens(constrained, cpu, False)
        pooled = timed(lambda: fill_next_token_bitmask_par(pool, pairs, out), args.rounds)   # noqa: B023
        assert engine_mask is not None and np.array_equal(out, engine_mask.bitmask.numpy()), "masks differ"
        rows.append({"batch": b, "one_by_one_ms": serial, "llguidance_pool_ms": pooled,
                     "one_by_one_us_per_row": 1e3 * serial / b, "pool_speedup": serial / pooled})
        print(f"B={b:4d}  one by one {serial:8.3f} ms ({1e3 * serial / b:6.1f} us/row)   llguidance pool "
              f"{pooled:8.3f} ms   x{serial / pooled:4.2f}")
    result = {"label": args.label, "cpus": os.cpu_count(), "load": os.getloadavg(),
              "machine": platform.processor() or platform.machine(),
              "vocab": len(tok), "rounds": args.rounds, "schema": SCHEMA, "rows": rows,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = Path(args.out_dir) / f"structured-masks-{args.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
