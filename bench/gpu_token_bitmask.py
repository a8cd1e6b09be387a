"""Structured outputs on the GPU: applying B rows' allowed-token bitmasks to float32 logits of Llama 3's 128,256
tokens, the Triton kernel the sampler uses (kernels/token_bitmask.py: -inf written in place where a bit is clear)
against the plain-PyTorch way it replaced (unpack the words to an [N, V] mask, masked_fill the rows, copy them
back), with each one's extra device memory at its peak. Random words: the cost does not depend on what they allow.
The kernel's result must equal the reference's (status 1 if not).

    python bench/gpu_token_bitmask.py --label h200 --out-dir bench/results/v3   # -> token-bitmask-<label>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kvfleet.engine.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref_

Apply = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def timed(fn: Apply, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
          rounds: int) -> tuple[float, float]:
    """(median ms by CUDA events, MiB allocated beyond the inputs at the peak) of `fn` in place on `logits`."""
    fn(logits, bitmask, rows)   # warm-up: compiles the kernel
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(logits, bitmask, rows)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results" / "v3"))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out: list[dict[str, Any]] = []
    ok = True
    for b in (int(x) for x in args.batches.split(",")):
        logits = torch.randn(b, args.vocab, device=dev, generator=gen)
        words = torch.randint(-2**31, 2**31, (b, (args.vocab + 31) // 32), device=dev, generator=gen,
                              dtype=torch.int64).to(torch.int32)
        rows = torch.arange(b, device=dev)
        kernel_out, ref_out = logits.clone(), logits.clone()
        kernel_ms, kernel_mib = timed(apply_token_bitmask_, kernel_out, words, rows, args.rounds)
        ref_ms, ref_mib = timed(apply_token_bitmask_ref_, ref_out, words, rows, args.rounds)
        equal = bool(torch.equal(kernel_out, ref_out))
        ok &= equal
        rows_out.append({"batch": b, "kernel_ms": kernel_ms, "torch_ms": ref_ms, "speedup": ref_ms / kernel_ms,
                         "kernel_extra_mib": kernel_mib, "torch_extra_mib": ref_mib, "equal": equal})
        print(f"B={b:4d}  kernel {kernel_ms:.4f} ms ({kernel_mib:.0f} MiB)   torch {ref_ms:.4f} ms "
              f"({ref_mib:.0f} MiB)   x{ref_ms / kernel_ms:.1f}   {'equal' if equal else 'DIFFERENT'}", flush=True)
    result = {"label": args.label, "device": torch.cuda.get_device_name(), "vocab": args.vocab,
              "rounds": args.rounds, "rows": rows_out, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = Path(args.out_dir) / f"token-bitmask-{args.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", path)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
