"""`kvfleet bench serve`: an online load generator for an OpenAI-compatible server (like
`vllm bench serve`).

Requests go to /v1/completions with streaming, `ignore_eos` and `min_tokens` so each
output has exactly the workload's length; arrivals are Poisson at `--request-rate`
(or all at once with `inf`), at most `--max-concurrency` in flight. Reported: request
and token throughput, TTFT, TPOT, inter-token latency and end-to-end latency
(mean, p50, p90, p99), and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger("kvfleet.bench")

_TINY_TEXTS = ("Once upon a time", "The capital of France is", "def fibonacci(n):", "In a hole in the ground",
               "The quick brown fox", "Water boils at", "My favourite colour is", "Kubernetes schedules pods")


@dataclass
class BenchRequest:
    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None  # known for token-id prompts; else taken from the server's usage


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    sent_s: float = 0.0   # when it was sent, from the benchmark's start


def per_request(results: Sequence[RequestResult]) -> list[dict[str, float | None]]:
    """Each finished request in send order: when it was sent and its first token came (seconds from the start) and
    its TTFT: under a burst this tells a late start (every first token later by the same time) from slower work."""
    ok = sorted((r for r in results if r.ok), key=lambda r: r.sent_s)
    return [{"sent_s": round(r.sent_s, 6),
             "first_token_s": None if r.ttft is None else round(r.sent_s + r.ttft, 6),
             "ttft_ms": None if r.ttft is None else round(r.ttft * 1e3, 3),
             "e2e_ms": round(r.e2e * 1e3, 3)} for r in ok]


def tiny_workload(num_prompts: int, seed: int) -> list[BenchRequest]:
    """A built-in workload small enough for tiny CPU models: short text prompts, 8-24 new tokens."""
    rng = random.Random(seed)
    return [BenchRequest(prompt=rng.choice(_TINY_TEXTS), output_len=rng.randint(8, 24)) for _ in range(num_prompts)]


def _from_record(record: Any, where: str) -> BenchRequest:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    prompt = record.get("prompt", record.get("prompt_token_ids"))
    if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
    out_len = record.get("output_len", record.get("max_tokens"))
    if not isinstance(out_len, int) or out_len < 1:
        raise ValueError(f"{where}: 'output_len' (or 'max_tokens') must be an int >= 1")
    return BenchRequest(prompt, out_len, len(prompt) if isinstance(prompt, list) else None)


def load_jsonl(path: Path) -> list[BenchRequest]:
    requests = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
            requests.append(_from_record(record, f"{path}:{n}"))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def _from_workloads_module(name: str, seed: int) -> list[BenchRequest]:
    """A named workload of `kvfleet.engine.bench.workloads` (token-id prompts), as `bench throughput` uses it;
    `n` is not sent (every request asks for one completion)."""
    from kvfleet.engine.bench import workloads

    if name not in workloads.NAMES:
        raise ValueError(f"not 'tiny', a file, or one of {', '.join(workloads.NAMES)}")
    items = workloads.named_workload(name, seed)
    return [BenchRequest(list(it.prompt_token_ids), int(it.max_tokens), len(it.prompt_token_ids)) for it in items]


def load_workload(name_or_file: str, num_prompts: int | None, seed: int) -> list[BenchRequest]:
    path = Path(name_or_file)
    if name_or_file == "tiny":
        requests = tiny_workload(num_prompts or 16, seed)
    elif path.suffix in (".jsonl", ".json") or path.exists():
        requests = load_jsonl(path)
    else:
        requests = _from_workloads_module(name_or_file, seed)
    return requests[:num_prompts] if num_prompts else requests


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, p50, p90, p99 (linear interpolation, like numpy), in ms by default; empty -> zeros."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    data = sorted(values)

    def pct(q: float) -> float:
        pos = (len(data) - 1) * q / 100.0
        lo, hi = math.floor(pos), math.ceil(pos)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)

    return {"mean": sum(data) / len(data) * scale, "p50": pct(50) * scale, "p90": pct(90) * scale,
            "p99": pct(99) * scale}


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2el_ms": percentiles([r.e2e for r in ok]),
        "per_request": per_request(results),
    }


async def send_one(client: Any, url: str, model: str, req: BenchRequest, headers: dict[str, str],
                   t0: float) -> RequestResult:
    """One streamed request; `t0`: the benchmark's start (`time.perf_counter`)."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "min_tokens": req.output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False, sent_s=start - t0)
    last: float | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message', '')[:200]}"
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # a token event even when its text is empty (no tokenizer, held bytes)
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except Exception as exc:  # network errors, bad JSON: counted, not fatal to the run
        result.error = f"{exc.__class__.__name__}: {exc}"[:200]
    return result


async def run_benchmark(base_url: str, model: str | None, requests: Sequence[BenchRequest], request_rate: float,
                        max_concurrency: int | None, seed: int, api_key: str | None,
                        timeout: float) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=max_concurrency or 100)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, limits=limits) as client:
        if model is None:
            resp = await client.get("/v1/models", headers=headers)
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        rng = random.Random(seed)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        start = time.perf_counter()

        async def limited(req: BenchRequest) -> RequestResult:
            if sem is None:
                return await send_one(client, "/v1/completions", model, req, headers, start)
            async with sem:
                return await send_one(client, "/v1/completions", model, req, headers, start)

        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary.update({"model": model, "base_url": base_url, "num_prompts": len(requests),
                    "request_rate": "inf" if not math.isfinite(request_rate) else request_rate,
                    "max_concurrency": max_concurrency})
    return summary


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 or inf")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="Server URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="Model name to send (default: the first in /v1/models)")
    parser.add_argument("--api-key", help="Bearer key, if the server needs one")
    parser.add_argument("--workload", default="tiny",
                        help="tiny (built in, text prompts), a name from kvfleet.engine.bench.workloads "
                             "(random-1024-128, chat-mix, long-prompt, shared-prefix, ...), or a JSONL file of "
                             "{prompt, output_len} (default: tiny)")
    parser.add_argument("--num-prompts", type=_positive, help="Requests to send (default: the workload's)")
    parser.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrival rate, req/s, or inf")
    parser.add_argument("--max-concurrency", type=_positive, help="Most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the workload and the arrivals")
    parser.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout in seconds")
    parser.add_argument("--out", help="Write the results as JSON to this file")


def main(args: argparse.Namespace) -> int:
    try:
        requests = load_workload(args.workload, args.num_prompts, args.seed)
    except (ValueError, OSError, AttributeError, ImportError) as exc:
        print(f"kvfleet bench serve: error: --workload {args.workload}: {exc}", file=sys.stderr)
        return 2
    summary = asyncio.run(run_benchmark(args.base_url, args.model, requests, args.request_rate,
                                        args.max_concurrency, args.seed, args.api_key, args.timeout))
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if summary["failed"] == 0 and summary["completed"] > 0 else 1

