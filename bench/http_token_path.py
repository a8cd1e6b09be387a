"""Host cost per streamed token of the online path, on CPU (issue 16): what each token costs besides the GPU.

Measures, per token, with the real code: the engine side (`RequestGroup.record_token`: detokenization and
stop checks, then `make_output`: the cumulative `RequestOutput`), and the HTTP side (`/v1/completions`'
streaming body: delta text, chunk dict, `json.dumps`, SSE framing, as `server/completions._stream` runs it)
for S concurrent streams of N tokens, with and without a tokenizer (the benchmark's dummy models have none:
text "token_id:N"), and the event-loop hop (`call_soon_threadsafe` + queue put/get). Prints µs per token and
what that is per step at batch S. Timings from a shared 2-core machine are noisy (median of 5 rounds).

    python bench/http_token_path.py [--streams 256] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any


def _tokenizer() -> Any:
    from kvfleet.engine.testing import build_tokenizer

    return build_tokenizer(512)


def engine_side(tokenizer: Any, streams: int, tokens: int) -> tuple[float, list[list[Any]]]:
    """µs per token of record_token + make_output; and the outputs each stream would deliver."""
    from kvfleet.engine.core.request import Request
    from kvfleet.engine.core.request_group import RequestGroup
    from kvfleet.engine.outputs import RequestMetrics
    from kvfleet.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    groups = []
    for i in range(streams):
        g = RequestGroup(f"r{i}", None, [1, 2, 3], params, tokenizer, RequestMetrics(arrival_time=0.0))
        seq = Request(f"r{i}#0", [1, 2, 3], max_tokens=tokens, group_id=f"r{i}", sampling_params=params)
        groups.append((g, g.add_seq(seq), seq))
    outs: list[list[Any]] = [[] for _ in range(streams)]
    t = time.perf_counter()
    for step in range(tokens):
        for i, (g, st, seq) in enumerate(groups):
            tok = 40 + (i * 7 + step * 13) % 400
            seq.append_output_token(tok)
            g.record_token(st, tok, None, 0.0)
            outs[i].append(g.make_output(step == tokens - 1))
    return (time.perf_counter() - t) / (streams * tokens) * 1e6, outs


def http_side(outs: list[list[Any]], tokenizer: Any) -> float:
    """µs per token of the streaming completions body (all streams' chunks)."""
    from kvfleet.engine.server.completions import _stream
    from kvfleet.engine.server.protocol import CompletionRequest
    from kvfleet.engine.server.state import ServerState

    state = ServerState(model_name="m", model_path="m", keys=None)

    class _Engine:   # only what _stream reads: the tokenizer for logprobs (unused here)
        def __init__(self, tok: Any) -> None:
            self.tokenizer = tok

    state.engine = _Engine(tokenizer)
    req = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=len(outs[0]), stream=True,
                            stream_options={"include_usage": True})

    async def one(i: int) -> int:
        async def gen() -> Any:
            for o in outs[i]:
                yield o
        n = 0
        async for _ in _stream(state, req, [gen()], [""], f"cmpl-{i}", "m", 0):
            n += 1
        return n

    async def all_streams() -> None:
        await asyncio.gather(*(one(i) for i in range(len(outs))))

    t = time.perf_counter()
    asyncio.run(all_streams())
    return (time.perf_counter() - t) / (len(outs) * len(outs[0])) * 1e6


def loop_hop(n: int) -> float:
    """µs per item handed from another thread to an asyncio queue, one wake-up per batch of 256 (AsyncLLM)."""
    import threading

    async def main() -> float:
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in range(256)]

        def put_all(items: list[tuple[asyncio.Queue, int]]) -> None:
            for q, x in items:
                q.put_nowait(x)

        def producer() -> None:
            for k in range(n // 256):
                loop.call_soon_threadsafe(put_all, [(q, k) for q in queues])

        t = time.perf_counter()
        th = threading.Thread(target=producer)
        th.start()
        for _ in range(n // 256):
            for q in queues:
                await q.get()
        th.join()
        return (time.perf_counter() - t) / n * 1e6

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    tok = _tokenizer()
    rows = {}
    for name, t in (("no tokenizer (the benchmark's dummy models)", None), ("tiny BPE tokenizer", tok)):
        eng, http = [], []
        for _ in range(args.rounds):
            e, outs = engine_side(t, args.streams, args.tokens)
            eng.append(e)
            http.append(http_side(outs, t))
        rows[name] = (statistics.median(eng), statistics.median(http))
    hop = statistics.median(loop_hop(args.streams * args.tokens) for _ in range(args.rounds))
    print(f"{args.streams} streams x {args.tokens} tokens, median of {args.rounds} (shared CPU: noisy)")
    for name, (e, h) in rows.items():
        total = e + h + hop
        print(f"{name:45}: engine {e:6.1f} µs/token (detokenize + RequestOutput), HTTP body {h:6.1f} µs/token, "
              f"loop hop {hop:4.1f} µs: {total:6.1f} µs/token = {total * args.streams / 1e3:5.1f} ms of host "
              f"per step at batch {args.streams}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
