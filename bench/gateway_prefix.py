"""Prefix-aware routing against round-robin, in one run: the engines' prefix-cache hit rate and TTFT.

Workload (seeded): `--groups` long shared prefixes (a system prompt or document of `--prefix-chars`
characters each), `--per-group` requests per prefix, each the prefix plus its own question, sent in a
random order by `kvfleet bench serve` (streaming, `--max-concurrency` in flight) through the gateway to
`--replicas` real `kvfleet serve` engines (CPU).

The engines' KV caches are sized (`--kv-blocks`) to hold about 40 % of the prefixes each (24 prefixes of ~63
blocks, 600 blocks per engine): together they hold all of them. That is the case prefix routing exists for
(more shared prefixes than one replica's cache, as with many applications' system prompts or RAG documents):
round-robin sends every prefix to every replica and each cache thrashes, the prefix router keeps each prefix
on one replica (spilling when it is hot). With caches big enough to hold every prefix everywhere, round-robin
loses only each prefix's first request per replica.

Each phase starts fresh engines (empty caches) and a gateway with `--routing round-robin` or `prefix`;
hit rate = prefix-cache hit tokens / looked-up prompt tokens, summed over the engines' /metrics deltas.

    .venv/bin/python bench/gateway_prefix.py --label v1   # -> bench/results/gateway/prefix-v1.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kvfleet.gateway.testing import Engine, GatewayProcess, start_engines

KEY = "bench-key-0123456789abcdef"
RESULTS = Path(__file__).resolve().parent / "results" / "gateway"
WORDS = ("the of and to in is was for on that with as by at from his her an are were be this which or had not but "
         "have it all they cache replica prefix tenant model request token block engine cluster").split()


def workload(groups: int, per_group: int, prefix_chars: int, seed: int, output_len: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)

    def text(chars: int) -> str:
        out: list[str] = []
        while sum(len(w) + 1 for w in out) < chars:
            out.append(rng.choice(WORDS))
        return " ".join(out)

    prefixes = [f"Document {g}: " + text(prefix_chars) for g in range(groups)]
    requests = [{"prompt": f"{prefixes[g]}\nQuestion {g}.{i}: {text(60)}?\nAnswer:", "output_len": output_len}
                for g in range(groups) for i in range(per_group)]
    rng.shuffle(requests)
    return requests


def cache_counters(engines: list[Engine]) -> list[dict[str, float]]:
    return [{"hits": e.metric("kvfleet:prefix_cache_hits_total"),
             "queries": e.metric("kvfleet:prefix_cache_queries_total"),
             "requests": e.metric("kvfleet:request_success_total")} for e in engines]


def run_phase(policy: str, model: str, args: argparse.Namespace, wl: Path, tmp: Path) -> dict[str, Any]:
    logs = tmp / policy
    logs.mkdir(parents=True, exist_ok=True)
    engines = start_engines(Path(model), logs, args.replicas, "--max-model-len", str(args.max_model_len),
                            "--num-gpu-blocks-override", str(args.kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
                            timeout=900)
    config = tmp / f"{policy}.yaml"
    config.write_text(yaml.safe_dump({"tenants": {"bench": {"keys": [KEY], "models": {"tiny": {
        "replicas": [e.url for e in engines]}}}}}))
    gw = GatewayProcess(logs / "gateway.log", config=config, args=["--routing", policy, "--log-level", "warning"])
    try:
        gw.start()
        before = cache_counters(engines)
        out = logs / "bench.json"
        cmd = [sys.executable, "-m", "kvfleet.engine.cli", "bench", "serve", "--base-url", gw.url, "--api-key", KEY,
               "--model", "tiny", "--workload", str(wl), "--max-concurrency", str(args.concurrency),
               "--seed", str(args.seed), "--out", str(out)]
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # noqa: S603
        if proc.returncode != 0:
            raise RuntimeError(f"kvfleet bench serve failed ({proc.returncode}): {proc.stderr[-2000:]}")
        wall = time.monotonic() - start
        after = cache_counters(engines)
        summary = json.loads(out.read_text())
        rules = {r: gw.metric("kvfleet_gateway_routing_decisions_total", rule=r)
                 for r in ("prefix", "ring", "least_load", "round_robin")}
    finally:
        gw.stop()
        for e in engines:
            e.stop()
    per = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    hits, queries = sum(p["hits"] for p in per), sum(p["queries"] for p in per)
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits,
            "prompt_tokens_looked_up": queries, "per_replica": per, "routing_rules": rules, "wall_s": wall,
            "ttft_ms": summary["ttft_ms"], "e2el_ms": summary["e2el_ms"], "completed": summary["completed"],
            "failed": summary["failed"], "request_throughput": summary["request_throughput"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="local")
    parser.add_argument("--model", default="tiny",
                        help="tiny (a tiny random-weight llama), embedded (SmolLM2-135M-Instruct) or a model path")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-chars", type=int, default=2400, help="~1000 tokens with the tiny tokenizer")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=600, help="KV blocks (16 tokens) per engine")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1, help="round-robin/prefix pairs, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gw-prefix-"))
    model = args.model
    if model == "tiny":
        from kvfleet.engine.testing import make_tiny_model

        model = str(make_tiny_model("llama", tmp / "models", max_position_embeddings=args.max_model_len))
    elif model == "embedded":
        from kvfleet.engine.tokenizer import find_default_model

        model = str(find_default_model())
    wl = tmp / "workload.jsonl"
    requests = workload(args.groups, args.per_group, args.prefix_chars, args.seed, args.output_len)
    wl.write_text("".join(json.dumps(r) + "\n" for r in requests))
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for policy in ("round-robin", "prefix"):
            phase = run_phase(policy, model, args, wl, tmp / f"r{rep}")
            phase["repeat"] = rep
            runs.append(phase)
            print(f"[{rep}] {policy}: hit rate {phase['hit_rate']:.3f}, TTFT p50 {phase['ttft_ms']['p50']:.1f} ms, "
                  f"{phase['completed']} ok / {phase['failed']} failed, rules {phase['routing_rules']}", flush=True)

    def med(policy: str, key: str, sub: str | None = None) -> float:
        vals = [r[key][sub] if sub else r[key] for r in runs if r["policy"] == policy]
        return statistics.median(vals)

    ratios = {"hit_rate_prefix_over_round_robin": med("prefix", "hit_rate") / max(med("round-robin", "hit_rate"), 1e-9),
              "ttft_p50_round_robin_over_prefix": med("round-robin", "ttft_ms", "p50") / max(
                  med("prefix", "ttft_ms", "p50"), 1e-9)}
    result = {"label": args.label, "model": args.model, "cpus": os.cpu_count(), "python": platform.python_version(),
              "workload": {"groups": args.groups, "per_group": args.per_group, "prefix_chars": args.prefix_chars,
                           "output_len": args.output_len, "concurrency": args.concurrency, "seed": args.seed,
                           "requests": len(requests)},
              "engines": {"replicas": args.replicas, "kv_blocks": args.kv_blocks, "block_size": 16,
                          "max_num_seqs": args.max_num_seqs, "device": "cpu"},
              "note": "CPU engines, client and gateway share this machine's cores (noisy); ratios are side by side",
              "runs": runs, "ratios": ratios}
    path = args.out or RESULTS / f"prefix-{args.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(ratios), f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
