"""Host cost of taking one request in, on CPU (issue 16, the burst's HTTP path): body bytes to the engine's queue.

A burst of 300 requests at once is taken in one after another by the server's event loop, which shares the GIL with
the step loop (`AsyncLLM`): what each request costs there delays every request behind it. This measures that cost
with the real code, per part, for a `/v1/completions` body with a token-id prompt of L tokens:

  parse      json.loads + `CompletionRequest` validation (what FastAPI runs before the handler)
  handler    the prompt field, `build_inputs` (limits, and the engine's own check, `LLMEngine.process_inputs`, which
             `AsyncLLM.generate` then takes as it is), the prompt's text
  engine     `LLMEngine.add_checked` on the step loop's thread (abort not counted)

(Before `EngineInputs`, the engine's check ran three times a request: in the handler, in `generate` and in
`add_request` on the step loop's thread; `intake-before-checked-once-N.json` measured that code, as parts "handler",
"generate" and "engine", alternated with `intake-checked-once-N.json`: a 1,024-token request 395-575 -> 255-380 us of
host time, of it on the step loop's thread 90-130 -> 20-30; 8,192 tokens 2.75-3.40 -> 1.68-1.80 ms, 547-672 -> 86-99
us.)

Median of R rounds of N requests each (a shared 2-core machine is noisy), with and without a tokenizer (the GPU
benchmark's dummy models have none). Writes JSON (`--out`, e.g. bench/results/host/intake-<label>.json).
(`intake-ab-before-*.json` ran this harness against `b9550a0`'s engine, whose handler decoded every token-id
prompt where `prompt_texts` now stands.)

    python bench/http_intake.py [--lengths 16,1024,8192] [--requests 200] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import git_describe  # noqa: E402

PARTS = ("parse", "handler", "engine")


@dataclass
class EngineHandle:
    """What `ServerState` reads of an `AsyncLLM`, over an `LLMEngine` driven from this thread (no step loop)."""

    engine: Any

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    def stats(self) -> dict[str, Any]:
        return dict(self.engine.stats())

    def process_inputs(self, prompt: Any, sampling_params: Any = None) -> Any:
        """As `AsyncLLM.process_inputs`: the engine's admission rules, nothing started."""
        return self.engine.process_inputs(prompt, sampling_params)


def build_engine(model_dir: Path, tokenizer: bool) -> Any:
    """The tiny model with its tokenizer, or (like the GPU benchmark's folders) its config alone, dummy weights."""
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    load_format = "auto"
    if not tokenizer:
        bare = model_dir.with_name(model_dir.name + "-config-only")
        bare.mkdir(exist_ok=True)
        (bare / "config.json").write_bytes((model_dir / "config.json").read_bytes())
        model_dir, load_format = bare, "dummy"
    return LLMEngine(EngineConfig(model=str(model_dir), max_model_len=16384, max_num_seqs=1024,
                                  max_num_batched_tokens=16384, load_format=load_format,
                                  kv_cache_memory_bytes=1 << 30))


def one_round(state: Any, bodies: list[bytes]) -> dict[str, float]:
    """µs per request of each part, over `bodies`."""
    from kvfleet.engine.server.completions import _prompts, prompt_texts
    from kvfleet.engine.server.protocol import CompletionRequest
    from kvfleet.engine.server.serving import build_inputs

    engine = state.engine.engine
    spent = dict.fromkeys(PARTS, 0.0)
    added: list[str] = []

    async def run() -> None:
        for n, body in enumerate(bodies):
            t0 = time.perf_counter()
            req = CompletionRequest.model_validate(json.loads(body))
            t1 = time.perf_counter()
            prompts = await _prompts(state, req.prompt)
            inputs = [build_inputs(state, req, ids, req.max_tokens, "prompt", "max_tokens", req.logprobs, None, text)
                      for text, ids in prompts]
            prompt_texts(state, prompts, req.echo)
            t2 = time.perf_counter()
            rid = f"intake-{n}"
            engine.add_checked(rid, inputs[0])
            t3 = time.perf_counter()
            added.append(rid)
            for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                spent[part] += dt

    asyncio.run(run())
    engine.abort_request(added)
    return {part: total / len(bodies) * 1e6 for part, total in spent.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16,1024,8192", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from kvfleet.engine.server.state import ServerState
    from kvfleet.engine.testing import make_tiny_model

    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    rng = random.Random(0)
    results: dict[str, Any] = {"git": git_describe(), "label": args.label, "requests": args.requests,
                               "rounds": args.rounds, "us_per_request": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model("llama", tmp, max_position_embeddings=16384)
        for tokenizer in (False, True):
            engine = build_engine(model_dir, tokenizer)
            state = ServerState(model_name="m", model_path=str(model_dir), keys=None)
            state.engine, state.ready = EngineHandle(engine), True
            vocab = int(engine.model_config.vocab_size)
            for length in lengths:
                bodies = [json.dumps({"model": "m", "prompt": [rng.randrange(vocab) for _ in range(length)],
                                      "max_tokens": 128, "stream": True, "ignore_eos": True}).encode()
                          for _ in range(args.requests)]
                rounds = [one_round(state, bodies) for _ in range(args.rounds)]
                med = {part: statistics.median(r[part] for r in rounds) for part in PARTS}
                med["event_loop"] = med["parse"] + med["handler"]
                key = f"{'tokenizer' if tokenizer else 'no tokenizer'}, {length} tokens"
                results["us_per_request"][key] = med
                print(f"{key:30}: " + "  ".join(f"{k} {v:7.1f}" for k, v in med.items()) + "  µs/request",
                      flush=True)
            engine.shutdown()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
