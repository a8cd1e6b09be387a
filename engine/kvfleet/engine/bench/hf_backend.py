"""The naive baseline of the throughput benchmark: transformers ``generate`` in static batches.

Requests are taken in order, ``batch_size`` at a time, left-padded to the longest
prompt of the batch; each batch generates greedily until its longest request
has all its tokens (no early stop: EOS is disabled). Only each request's own
``max_tokens`` count as output tokens, as for the engine.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvfleet.engine.bench.stats import percentiles
from kvfleet.engine.bench.workloads import BenchRequest

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32", "auto": "bfloat16"}


def load_hf_model(model_dir: str, dtype_name: str, dummy: bool, device: Any) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, _DTYPES.get(dtype_name, dtype_name))
    if dummy:
        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _generate_batch(model: Any, batch: list[BenchRequest], device: Any) -> float:
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[i, width - n:] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n:] = 1
    new = max(r.max_tokens for r in batch)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    if out.shape[1] != width + new:
        raise RuntimeError(f"hf generate returned {out.shape[1] - width} new tokens, expected {new}")
    return time.perf_counter() - t


def run_hf(args: argparse.Namespace, reqs: list[BenchRequest], warm: list[BenchRequest]) -> dict[str, Any]:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and args.device in ("auto", "cuda") else "cpu")
    t = time.monotonic()
    model = load_hf_model(str(args.model), args.dtype, args.load_format == "dummy", device)
    init_s = time.monotonic() - t
    if warm:
        _generate_batch(model, warm, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    bs = args.hf_batch_size
    t0 = time.monotonic()
    batch_s = []
    for i in range(0, len(reqs), bs):
        batch_s.append(_generate_batch(model, reqs[i:i + bs], device))
    wall = time.monotonic() - t0
    generated = sum(max(r.max_tokens for r in reqs[i:i + bs]) * len(reqs[i:i + bs]) for i in range(0, len(reqs), bs))
    res: dict[str, Any] = {
        "wall_s": wall, "init_s": init_s, "hf_batch_size": bs, "batches": len(batch_s),
        "batch_wall_s": percentiles(batch_s), "generated_tokens_incl_padding": generated,
        "ttft_ms": None, "tpot_ms": None,
    }
    if device.type == "cuda":
        res["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res
