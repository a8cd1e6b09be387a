"""The sampler's penalties on the GPU: `apply_penalties` (only the columns of each row's prompt and output ids,
gathered and scattered back) against `apply_penalties_ref` (the [B, V] counts and masks it replaced), on float32
logits of Llama 3's 128,256 tokens, at the batch sizes chat-mix runs (up to ~1,000 sequences) and its prompt and
output lengths. Median ms by CUDA events and the extra device memory at the peak, for a repetition penalty alone (the
bench's `--repetition-penalty`) and all three penalties; the two results must be equal (status 1 if not).

    python bench/gpu_penalties.py bench/results/issue16/leaseN/penalties     # -> penalties.json, penalties.txt
    python bench/gpu_penalties.py /tmp/p --device cpu --vocab 512 --batches 4 --rounds 2   # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kvfleet.engine.bench.decode_probe import median_cuda_ms
from kvfleet.engine.sampler import SamplingBatch, apply_penalties, apply_penalties_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import git_describe  # noqa: E402  (bench/provenance.py: the commit that ran)

Penalties = Callable[[torch.Tensor, SamplingBatch], torch.Tensor]


def token_lists(rows: int, lengths: torch.Tensor, width: int, vocab: int, gen: torch.Generator,
                device: torch.device) -> torch.Tensor:
    """[rows, width] ids padded with `vocab` as the runner builds them, row r holding lengths[r] random ids."""
    ids = torch.randint(0, vocab, (rows, width), generator=gen, device=device)
    cols = torch.arange(width, device=device).unsqueeze(0)
    return torch.where(cols < lengths.unsqueeze(1), ids, torch.full_like(ids, vocab))


def penalty_batch(rows: int, prompt_len: int, output_len: int, vocab: int, all_three: bool,
                  gen: torch.Generator, device: torch.device) -> SamplingBatch:
    """Prompt and output lengths uniform in [1, 2 x mean]: a mixed batch like chat-mix's, padded to its longest."""
    plen = torch.randint(1, 2 * prompt_len + 1, (rows,), generator=gen, device=device)
    olen = torch.randint(0, 2 * output_len + 1, (rows,), generator=gen, device=device)
    prompt = token_lists(rows, plen, int(plen.max()), vocab, gen, device)
    output = token_lists(rows, olen, max(1, int(olen.max())), vocab, gen, device)
    ones = torch.ones(rows, device=device)
    return SamplingBatch(
        temperature=torch.zeros(rows, device=device), top_k=None, top_p=None, min_p=None,
        presence_penalty=0.2 * ones if all_three else None, frequency_penalty=0.3 * ones if all_three else None,
        repetition_penalty=1.1 * ones, prompt_tokens=prompt, output_tokens=output, min_tokens_mask=None,
        logit_bias=None, allowed=None, generators={}, max_num_logprobs=-1, all_greedy=True)


def timed(fn: Penalties, logits: torch.Tensor, b: SamplingBatch, rounds: int) -> tuple[float, float | None]:
    """(median ms, MiB allocated beyond the inputs at the peak) of `fn` on the device; wall ms and None on a CPU."""
    if not logits.is_cuda:
        fn(logits, b)
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            fn(logits, b)
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times), None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = median_cuda_ms(lambda: fn(logits, b), rounds)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def mib(value: float | None) -> str:
    return f"{value:8.1f} MiB" if value is not None else "       - MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--prompt-len", type=int, default=343, help="mean prompt ids a row (chat-mix's mean)")
    ap.add_argument("--output-len", type=int, default=100, help="mean output ids a row so far")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(23)
    rows_out: list[dict[str, Any]] = []
    ok = True
    lines = [f"penalties on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, vocab "
             f"{args.vocab}, prompt ~{args.prompt_len} ids, output ~{args.output_len} (ms median, extra MiB at peak)"]
    for rows in (int(x) for x in args.batches.split(",")):
        for all_three in (False, True):
            b = penalty_batch(rows, args.prompt_len, args.output_len, args.vocab, all_three, gen, dev)
            logits = torch.randn(rows, args.vocab, generator=gen, device=dev)
            equal = torch.equal(apply_penalties(logits, b), apply_penalties_ref(logits, b))
            ok = ok and equal
            cols_ms, cols_mib = timed(apply_penalties, logits, b, args.rounds)
            ref_ms, ref_mib = timed(apply_penalties_ref, logits, b, args.rounds)
            kind = "repetition, frequency, presence" if all_three else "repetition"
            rows_out.append({"batch": rows, "penalties": kind, "equal": equal, "columns_ms": cols_ms,
                             "dense_ms": ref_ms, "columns_extra_mib": cols_mib, "dense_extra_mib": ref_mib,
                             "prompt_width": int(b.prompt_tokens.shape[1]) if b.prompt_tokens is not None else 0,
                             "output_width": int(b.output_tokens.shape[1]) if b.output_tokens is not None else 0})
            lines.append(f"B={rows:5d} {kind:32s} columns {cols_ms:8.3f} ms {mib(cols_mib)}   dense "
                         f"{ref_ms:8.3f} ms {mib(ref_mib)}   {ref_ms / cols_ms:5.1f}x  equal={equal}")
            print(lines[-1], flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "penalties.json").write_text(json.dumps({"rows": rows_out, "all_equal": ok, "args": vars(args),
                                                    "git": git_describe()}, indent=1))
    (out / "penalties.txt").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
