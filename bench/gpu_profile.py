"""Where a Qwen3-0.6B step's GPU time goes: torch.profiler over one mixed step (prefill chunk +
decodes) and one decode step of the engine at batch 256, top kernels by device time.
Usage: python bench/gpu_profile.py OUT.txt [MODEL_DIR]"""

from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kvfleet.engine.bench.workloads import random_workload
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"


def main(argv: list[str]) -> int:
    out = argv[1] if len(argv) > 1 else "profile.txt"
    model = argv[2] if len(argv) > 2 else "bench/models/qwen3-0.6b"
    n = 8 if DRY else 256
    cfg = EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device="cpu" if DRY else "cuda",
                       max_model_len=512 if DRY else 1280, max_num_seqs=n,
                       max_num_batched_tokens=8192 if not DRY else 64,
                       num_kv_blocks=2048 if DRY else None)
    eng = LLMEngine(cfg)
    reqs = random_workload(num=n + 16, prompt_len=64 if DRY else 1024, output_len=64)
    for i, r in enumerate(reqs):
        ids = [t % eng.model_config.vocab_size for t in r.prompt_token_ids]
        eng.add_request(f"p{i}", {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    acts = [ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])
    key = "self_cpu_time_total" if DRY else "self_device_time_total"
    lines = []
    found = {"mixed": False, "decode": False}
    for _ in range(400):
        if all(found.values()) or not eng.has_unfinished_requests():
            break
        sched_probe = eng.scheduler.stats()
        kind = "decode" if sched_probe["num_waiting"] == 0 else "mixed"
        if found[kind] or (kind == "mixed" and sched_probe["num_running"] < n // 2):
            eng.step()
            continue
        with profile(activities=acts) as prof:
            eng.step()
            if not DRY:
                torch.cuda.synchronize()
        found[kind] = True
        lines.append(f"=== one {kind} step (running {sched_probe['num_running']}, "
                     f"waiting {sched_probe['num_waiting']})")
        lines.append(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    text = "\n".join(lines)
    with open(out, "w") as f:
        f.write(text)
    print(text[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
