"""Engine greedy outputs on the GPU against the CPU path and transformers, on tiny models.

For each tiny architecture (float32, so the paths can agree token for token):
kvfleet on CUDA with decode CUDA graphs, kvfleet on CUDA eager, kvfleet on CPU,
and transformers ``generate`` on the GPU, all greedy on the same prompts (of
several lengths, so steps mix prefill chunks and decodes). Also a bfloat16 run
on CUDA against transformers in bfloat16 (agreement reported, not required).
Writes one JSON (argv[1]) and prints a summary.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"

import torch  # noqa: E402

from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402
from kvfleet.engine.testing import hf_greedy_tokens, make_tiny_model  # noqa: E402

GPU = "cpu" if DRY else "cuda"


def prompts(vocab: int, n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lens = [3, 17, 40, 64, 5, 33, 90, 1][:n]
    return [torch.randint(3, vocab - 1, (L,), generator=g).tolist() for L in lens]


def run_kvfleet(model: str, device: str, dtype: str, ps: list[list[int]], max_tokens: int,
                enforce_eager: bool = False) -> list[list[int]]:
    llm = LLM(model, device=device, dtype=dtype, num_kv_blocks=256, max_num_seqs=8, max_model_len=512,
              max_num_batched_tokens=64, enforce_eager=enforce_eager)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp)
    graphs = llm.llm_engine.runner.executor.graphs is not None
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], graphs


def run_hf(model: str, dtype: torch.dtype, ps: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    return hf_greedy_tokens(AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(GPU).eval(), ps, max_tokens)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Exact sequences equal, and mean length of the common prefix."""
    equal = sum(int(x == y) for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"equal": equal, "of": len(a), "mean_common_prefix": sum(prefix) / len(prefix)}


def main(argv: list[str]) -> int:
    out_path = argv[1] if len(argv) > 1 else "engine_check.json"
    root = tempfile.mkdtemp(prefix="kvfleet-tiny-")
    res: dict[str, Any] = {}
    ok = True
    for arch in ("llama", "qwen3"):
        model = str(make_tiny_model(arch, root, num_layers=3))
        ps = prompts(400)
        n = 24
        hf = run_hf(model, torch.float32, ps, n)
        gpu_graph, graphs = run_kvfleet(model, GPU, "float32", ps, n)
        gpu_eager, _ = run_kvfleet(model, GPU, "float32", ps, n, enforce_eager=True)
        cpu, _ = run_kvfleet(model, "cpu", "float32", ps, n)
        r = {"cuda_graphs_used": graphs,
             "fp32 kvfleet-gpu-graphs vs transformers-gpu": agreement(gpu_graph, hf),
             "fp32 kvfleet-gpu-graphs vs kvfleet-gpu-eager": agreement(gpu_graph, gpu_eager),
             "fp32 kvfleet-gpu vs kvfleet-cpu": agreement(gpu_graph, cpu),
             "fp32 kvfleet-cpu vs transformers-gpu": agreement(cpu, hf)}
        hf16 = run_hf(model, torch.bfloat16, ps, n)
        bf16, _ = run_kvfleet(model, GPU, "bfloat16", ps, n)
        r["bf16 kvfleet-gpu vs transformers-gpu (info)"] = agreement(bf16, hf16)
        r["sample"] = {"kvfleet_gpu": gpu_graph[1][:12], "transformers": hf[1][:12]}
        res[arch] = r
        for k, v in r.items():
            if k.startswith("fp32") and v["equal"] != v["of"]:
                ok = False
    res["all_fp32_equal"] = ok
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    for arch in ("llama", "qwen3"):
        for k, v in res[arch].items():
            if isinstance(v, dict) and "equal" in v:
                print(f"  {arch}: {k}: {v['equal']}/{v['of']} sequences equal, mean common prefix "
                      f"{v['mean_common_prefix']:.1f}/24")
        print(f"  {arch}: CUDA graphs used: {res[arch]['cuda_graphs_used']}")
    print("engine greedy check:", "ALL fp32 EQUAL" if ok else "MISMATCH (see engine_check.json)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
