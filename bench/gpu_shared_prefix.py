"""The shared-prefix pass of decode attention on the GPU (issue 16's shared-prefix and parallel-sampling rows).

1. Correctness: Llama-3.1-8B's attention shapes in bf16 (32 query heads, 8 KV heads, D 128, 16-token blocks),
   decode rows sharing prefixes, with and without the pass, against the float32 reference.
2. Time of one layer's decode attention, replayed in a CUDA graph, with and without the pass, at the shapes of
   the offline workloads: shared-prefix (512 sequences, 8 prefixes of 2,048 tokens, ~330 tokens each after),
   parallel sampling (1,024 sequences, 256 prompts of 512 tokens sampled 4 times, 64 tokens each after), and
   the plan's host time (also for a batch that shares nothing).
3. The engine (Qwen3-0.6B shapes, dummy weights, CUDA graphs): greedy tokens of 64 requests over 8 shared
   prefixes and of n=4 requests with the pass on and off, and how many decode steps replayed with it.

    python bench/gpu_shared_prefix.py OUT_DIR [QWEN_MODEL_DIR]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfleet.engine.attention import shared_prefix as sp
from kvfleet.engine.bench.decode_probe import capture_graph
from kvfleet.engine.kernels.paged_decode import (
    SharedPrefixArgs,
    choose_num_splits,
    paged_attention_ref,
    paged_decode_attention,
)
from kvfleet.engine.kernels.shared_prefix import members_per_item, shared_prefix_attention

HQ, HKV, D, BS = 32, 8, 128, 16


def make_step(groups: int, members: int, prefix: int, suffix: tuple[int, int], seed: int = 0
              ) -> dict[str, Any]:
    """Decode rows: `groups` prefixes of `prefix` tokens, each shared by `members` sequences, then each
    sequence's own suffix (uniform in `suffix`); physical blocks shuffled."""
    rng = np.random.default_rng(seed)
    pblocks = prefix // BS
    tables, seq_lens, nxt = [], [], 0
    prefixes = []
    for _ in range(groups):
        prefixes.append(list(range(nxt, nxt + pblocks)))
        nxt += pblocks
    for g in range(groups):
        for _ in range(members):
            n = prefix + int(rng.integers(suffix[0], suffix[1] + 1))
            own = -(-n // BS) - pblocks
            tables.append(prefixes[g] + list(range(nxt, nxt + own)))
            nxt += own
            seq_lens.append(n)
    perm = rng.permutation(nxt)
    width = max(len(t) for t in tables)
    host = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        host[i, :len(t)] = perm[t]
    order = rng.permutation(len(tables))   # groups interleaved in the batch, as a scheduler leaves them
    host, seq_lens_np = host[order], np.asarray(seq_lens, dtype=np.int32)[order]
    b = len(tables)
    return {"tables": host, "seq_lens": seq_lens_np, "num_blocks": nxt, "batch": b,
            "kv_tokens_read": int(seq_lens_np.sum()),
            "kv_tokens_read_shared": int(seq_lens_np.sum() - (members - 1) * groups * prefix)}


def device_step(step: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    b = step["batch"]
    return {
        "q": torch.randn(b, HQ, D, device=dev, generator=gen).to(dtype),
        "cache": torch.randn(2, step["num_blocks"], BS, HKV, D, device=dev, generator=gen).to(dtype),
        "tables": torch.from_numpy(step["tables"]).to(dev),
        "seq_lens": torch.from_numpy(step["seq_lens"]).to(dev),
        "qsl": torch.arange(b + 1, dtype=torch.int32, device=dev),
    }


def attention(t: dict[str, Any], shared: sp.SharedPrefixTensors | None, out: torch.Tensor, splits: int) -> None:
    if shared is not None:
        shared_prefix_attention(t["q"], t["cache"], t["tables"], t["qsl"], shared.items, shared.members,
                                shared.part_out, shared.part_lse, 0.088)
    args = SharedPrefixArgs(shared.kv_start, shared.part_out, shared.part_lse) if shared is not None else None
    paged_decode_attention(t["q"], t["cache"], t["tables"], t["seq_lens"], t["qsl"], 0.088, out,
                           num_splits=splits, merge="kernel", shared=args)


def plan_for(step: dict[str, Any]) -> sp.SharedPrefixPlan | None:
    return sp.plan_shared_prefixes(step["tables"], step["seq_lens"], np.ones(step["batch"], dtype=bool), BS,
                                   members_per_item(HQ, HKV), min_tokens=64)


def check(name: str, step: dict[str, Any]) -> dict[str, Any]:
    t = device_step(step)
    plan = plan_for(step)
    assert plan is not None
    shared = sp.plan_to_device(plan, HQ, D, torch.device("cuda"), non_blocking=False)
    ref = paged_attention_ref(t["q"], t["cache"], t["tables"], t["seq_lens"], t["qsl"], 0.088).float()
    row: dict[str, Any] = {"check": name, "items": plan.num_items}
    for splits in (1, 4):
        for label, s in (("off", None), ("on", shared)):
            out = torch.zeros_like(t["q"])
            attention(t, s, out, splits)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row[f"rel_err_{label}_splits{splits}"] = err
    row["ok"] = all(row[f"rel_err_on_splits{s}"] <= 1.5 * row[f"rel_err_off_splits{s}"] + 1e-3 for s in (1, 4))
    return row


def graph_time(fn: Any, iters: int = 50) -> float:
    """ms per replay of `fn` captured in a CUDA graph."""
    g = capture_graph(fn)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def timing(name: str, step: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    t = device_step(step)
    b = step["batch"]
    host = []
    for _ in range(20):
        t0 = time.perf_counter()
        plan_for(step)
        host.append(1e3 * (time.perf_counter() - t0))
    buffers = sp.SharedPrefixBuffers(b, HQ, D, torch.device("cuda"))
    shared_plan = sp.plan_shared_prefixes(step["tables"], step["seq_lens"], np.ones(b, dtype=bool), BS,
                                          members_per_item(HQ, HKV), min_tokens=64,
                                          max_items=sp.SharedPrefixBuffers.capacity(b))
    assert shared_plan is not None
    buffers.load(shared_plan, b)
    splits = choose_num_splits(b, HKV, max_model_len, torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.zeros_like(t["q"])
    off = graph_time(lambda: attention(t, None, out, splits))
    tens = buffers.tensors(b)
    on = graph_time(lambda: attention(t, tens, out, splits))
    prefix_only = graph_time(lambda: shared_prefix_attention(t["q"], t["cache"], t["tables"], t["qsl"], tens.items,
                                                             tens.members, tens.part_out, tens.part_lse, 0.088))
    rest_only = graph_time(lambda: paged_decode_attention(
        t["q"], t["cache"], t["tables"], t["seq_lens"], t["qsl"], 0.088, out, num_splits=splits, merge="kernel",
        shared=SharedPrefixArgs(tens.kv_start, tens.part_out, tens.part_lse)))
    kv_bytes = 2 * HKV * D * 2   # K and V of one token, one layer, bf16
    return {"timing": name, "batch": b, "splits": splits, "items": shared_plan.num_items,
            "off_ms": off, "on_ms": on, "speedup": off / on, "prefix_kernel_ms": prefix_only,
            "decode_kernel_after_prefix_ms": rest_only,
            "off_tb_s": step["kv_tokens_read"] * kv_bytes / off / 1e9,
            "on_effective_tb_s": step["kv_tokens_read"] * kv_bytes / on / 1e9,
            "on_tb_s": step["kv_tokens_read_shared"] * kv_bytes / on / 1e9,
            "plan_host_ms_median": float(np.median(host))}


def engine_check(model: str) -> dict[str, Any]:
    """Greedy tokens with the pass on and off (one engine each, same prompts), and its replays."""
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.sampling_params import SamplingParams

    rng = np.random.default_rng(3)
    prefixes = [rng.integers(1, 500, size=400).tolist() for _ in range(8)]
    prompts = [{"prompt_token_ids": prefixes[i % 8] + rng.integers(1, 500, size=int(rng.integers(5, 60))).tolist()}
               for i in range(64)]
    forked = [{"prompt_token_ids": rng.integers(1, 500, size=300).tolist()} for _ in range(8)]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    fork = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, n=4)
    result: dict[str, Any] = {}
    tokens: dict[bool, list[list[int]]] = {}
    for enabled in (False, True):
        sp.ENABLED = enabled
        llm = LLM(model=model, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.85, max_num_seqs=256,
                  max_model_len=4096, enable_prefix_caching=True)
        graphs = llm.llm_engine.runner.executor.graphs
        before = graphs.shared_replays if graphs is not None else 0
        outs = llm.generate(prompts[:8], greedy)   # the prefixes enter the prefix cache first
        outs += llm.generate(prompts[8:], greedy)
        outs += llm.generate(forked, fork)
        tokens[enabled] = [list(c.token_ids) for o in outs for c in o.outputs]
        result[f"shared_replays_{'on' if enabled else 'off'}"] = (graphs.shared_replays - before
                                                                   if graphs is not None else None)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    sp.ENABLED = True
    pairs = list(zip(tokens[False], tokens[True], strict=True))
    result["sequences"] = len(pairs)
    result["identical_sequences"] = sum(a == b for a, b in pairs)
    result["token_agreement"] = (sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True))
                                 / sum(len(a) for a, _ in pairs))
    # greedy decoding diverges for good after the first differing token: where do they first differ?
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None) for a, b in pairs]
    result["first_difference_at"] = [f for f in firsts if f is not None]
    return result


def main(out_dir: str, qwen: str | None) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if qwen:   # first: the engine sizes its KV cache from the memory free, before this script's tensors take any
        rows.append({"engine": qwen, **engine_check(qwen)})
        print(json.dumps(rows[-1]), flush=True)
    rows.append(check("groups of 24 over 1,024 tokens", make_step(4, 24, 1024, (1, 200))))
    rows.append(check("groups of 3 over 64 tokens", make_step(40, 3, 64, (1, 40), seed=2)))
    print(json.dumps(rows[-2:], indent=1), flush=True)
    for name, step, mml in (
        ("shared-prefix: 8 x 64 over 2,048", make_step(8, 64, 2048, (290, 450)), 8192),
        ("parallel sampling: 256 x 4 over 512", make_step(256, 4, 512, (1, 128)), 8192),
        ("one prefix, 128 over 2,048", make_step(1, 128, 2048, (50, 300)), 8192),
    ):
        rows.append(timing(name, step, mml))
        print(json.dumps(rows[-1]), flush=True)
    nothing = make_step(512, 1, 512, (1, 400))
    host = []
    for _ in range(20):
        t0 = time.perf_counter()
        assert plan_for(nothing) is None
        host.append(1e3 * (time.perf_counter() - t0))
    rows.append({"timing": "plan of 512 rows sharing nothing", "plan_host_ms_median": float(np.median(host))})
    print(json.dumps(rows[-1]), flush=True)
    (out / "shared_prefix.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r.get("ok") is False]
    if bad:
        sys.exit(f"shared-prefix pass: wrong results {bad}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
