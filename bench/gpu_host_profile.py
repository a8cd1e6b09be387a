"""Issue 16: where the host time of an eager (mixed or prefill) forward goes. Usage:
    python bench/gpu_host_profile.py OUT_DIR [MODEL_DIR]      (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU)

Lease 3 saw the host time to launch a mixed step's forward at 23-31 ms (an eager batch-1 forward: 28 ms),
as long as the GPU work of a 1k-token prefill: at 12 req/s every step with a new prompt is host-bound. This
measures, on the GPU's own host, writing OUT_DIR/host_profile.{json,txt}:

1. launch costs: host microseconds per call of a torch op, a linear, one of our Triton kernels (RMSNorm) and
   the prefill attention wrappers, each on tiny tensors (so the GPU never holds the host back);
2. a mixed step (12 decodes at 1,100 tokens of context + one 1,024-token prompt), a lone 1,024-token prefill
   and an eager 12-sequence decode, per prefill kernel (v1, v2, v2-paged): host ms to launch the forward
   (the GPU idle at the start, no sync inside) against its GPU ms (CUDA events), and any implicit sync
   (torch's sync debug mode);
3. the mixed forward under cProfile (functions by own time) and torch.profiler (ops by own CPU time).
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Callable

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvfleet.engine.attention import build_attention_metadata, triton_backend  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import GpuReport  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
RUN = GpuReport(on_cuda=DEV.type == "cuda")
say, section = RUN.say, RUN.section
BF16 = torch.bfloat16
MIXED = (2, 40, 32) if DRY else (12, 1100, 1024)   # decodes, their context, the prompt


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def host_us(fn: Callable[[], Any], iters: int) -> float:
    """Host microseconds per call, the device drained before and after (not counted)."""
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t) / iters * 1e6
    sync()
    return host


@section("launch_costs")
def launch_costs() -> dict[str, float]:
    from kvfleet.engine import kernels
    from kvfleet.engine.kernels.prefill_attention import prefill_attention, prefill_work
    from kvfleet.engine.kernels.prefill_attention_v2 import prefill_attention_v2

    n = 50 if DRY else 2000
    x = torch.randn(4, 4096, dtype=BF16, device=DEV)
    w = torch.randn(4096, 4096, dtype=BF16, device=DEV)
    g = torch.ones(4096, dtype=BF16, device=DEV)
    md = build_attention_metadata([16], [16], [[0]], 16, DEV)
    q = torch.randn(16, 32, 128, dtype=BF16, device=DEV)
    kv = torch.zeros(2, 4, 16, 8, 128, dtype=BF16, device=DEV)
    out = torch.empty_like(q)
    work = prefill_work(md.query_start_loc_cpu, 16, False, DEV)
    args = (q, kv, md.block_tables, md.seq_lens, md.query_start_loc, 16, 0.1, out)

    def nothing() -> None:
        pass

    rows = {
        "python call": host_us(nothing, n),
        "torch add": host_us(lambda: x + x, n),
        "F.linear 4x4096x4096": host_us(lambda: F.linear(x, w), n),
        "Triton rms_norm": host_us(lambda: kernels.rms_norm(x, g, 1e-5), n),
        "prefill v1 wrapper": host_us(lambda: prefill_attention(*args, block_m=16, work=work), n),
        "prefill v2 wrapper": host_us(lambda: prefill_attention_v2(*args, block_m=16, block_n=16, work=work), n),
    }
    for k, v in rows.items():
        say(f"{k:28s} {v:8.1f} us per call (host)")
    return rows


def _engine(model: str) -> Any:
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device=DEV.type,
                       max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=8192,
                       num_kv_blocks=2048 if DRY else None, gpu_memory_utilization=0.5)
    t = time.monotonic()
    eng = LLMEngine(cfg)
    init_s = time.monotonic() - t
    w = eng.warm_up()
    say(f"engine init {init_s:.1f} s (KVFLEET_MIXED_CUDA_GRAPHS={os.environ.get('KVFLEET_MIXED_CUDA_GRAPHS', '')!r}), "
        f"warm-up {w.seconds:.2f} s")
    return eng


def _step_inputs(eng: Any, decodes: int, ctx: int, prompt: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Flat inputs of one step: `decodes` single-token rows at context `ctx`, then one `prompt`-token prefill."""
    bs = eng.runner.block_size
    per = -(-max(ctx, prompt) // bs)
    q_lens = [1] * decodes + ([prompt] if prompt else [])
    seq_lens = [ctx] * decodes + ([prompt] if prompt else [])
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(q_lens))]
    md = build_attention_metadata(q_lens, seq_lens, tables, bs, DEV)
    vocab = eng.model_config.vocab_size
    ids = torch.randint(0, vocab, (sum(q_lens),), device=DEV)
    pos = torch.cat([torch.full((decodes,), ctx - 1, dtype=torch.long),
                     torch.arange(prompt, dtype=torch.long)]).to(DEV)
    return md, ids, pos


def _time_forward(model: Any, kv: list[torch.Tensor], md_fn: Callable[[], Any], ids: torch.Tensor,
                  pos: torch.Tensor, iters: int) -> dict[str, float]:
    """Host ms to launch the forward (GPU idle at the start) and its GPU ms (events), medians."""
    host, gpu = [], []
    for i in range(iters + 2):
        md = md_fn()   # fresh metadata: a step's plans are built by its first layer
        sync()
        a = b = None
        if DEV.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t = time.perf_counter()
        model(ids, pos, kv, md)
        h = (time.perf_counter() - t) * 1e3
        if a is not None and b is not None:
            b.record()
            b.synchronize()
            g = a.elapsed_time(b)
        else:
            g = float("nan")
        if i >= 2:
            host.append(h)
            gpu.append(g)
    host.sort()
    gpu.sort()
    return {"host_ms": host[len(host) // 2], "gpu_ms": gpu[len(gpu) // 2]}


@section("forwards")
def forwards() -> dict[str, Any]:
    model_dir = sys.argv[2] if len(sys.argv) > 2 else "bench/models/llama-3.1-8b"
    if DRY and len(sys.argv) <= 2:
        import tempfile

        from kvfleet.engine.testing import make_tiny_model
        model_dir = str(make_tiny_model("llama", Path(tempfile.gettempdir()) / "kvfleet-host-profile",
                                        max_position_embeddings=4096))
    eng = _engine(model_dir)
    runner = eng.runner
    model, kv = runner.executor.model, runner.kv_caches
    d, c, p = (2, 40, 32) if DRY else (12, 1100, 1024)
    cases = {"mixed 12x1100 + 1024": (d, c, p), "prefill 1024": (0, 0, p), "eager decode 12x1100": (d, c, 0)}
    res: dict[str, Any] = {}
    iters = 3 if DRY else 10
    with torch.inference_mode():
        for kernel in ("v2", "v1", "v2-paged"):
            triton_backend.PREFILL_KERNEL = kernel
            for name, (d, ctx, p) in cases.items():
                if kernel != "v2" and p == 0:
                    continue
                md0, ids, pos = _step_inputs(eng, d, ctx, p)
                t = _time_forward(model, kv, lambda d=d, ctx=ctx, p=p: _step_inputs(eng, d, ctx, p)[0], ids, pos,
                                  iters)
                res[f"{name} [{kernel}]"] = t
                say(f"{name:24s} [{kernel:8s}] host {t['host_ms']:7.2f} ms   GPU {t['gpu_ms']:7.2f} ms")
        triton_backend.PREFILL_KERNEL = "v2"
        # the same steps replayed from captured graphs (kvfleet.engine.mixed_graphs), through the executor
        executor = runner.executor
        graphs = executor.graphs
        res["mixed_graph_buckets"] = graphs.mixed.sizes if graphs is not None and graphs.mixed is not None else []
        for name, (d, ctx, p) in cases.items():
            if p == 0:
                continue
            md0, ids, pos = _step_inputs(eng, d, ctx, p)
            if not (graphs is not None and graphs.can_run(ids.shape[0], md0)):
                say(f"{name:24s} [graph   ] not capturable here")
                continue
            t = _time_forward(lambda i, q, k, m: executor.forward(i, q, k, m), kv,
                              lambda d=d, ctx=ctx, p=p: _step_inputs(eng, d, ctx, p)[0], ids, pos, iters)
            res[f"{name} [graph]"] = t
            say(f"{name:24s} [graph   ] host {t['host_ms']:7.2f} ms   GPU {t['gpu_ms']:7.2f} ms")
            # the replay against the eager forward on the same inputs: hidden rows and their greedy tokens
            eager = model(ids, pos, kv, _step_inputs(eng, d, ctx, p)[0]).float()
            replay = executor.forward(ids, pos, kv, _step_inputs(eng, d, ctx, p)[0]).float()
            err = ((replay - eager).norm() / eager.norm()).item()
            le, lr = executor.compute_logits(eager.to(BF16)), executor.compute_logits(replay.to(BF16))
            same = (le.argmax(-1) == lr.argmax(-1)).float().mean().item()
            res[f"{name} [graph] vs eager"] = {"rel_err": err, "greedy_agree": same}
            say(f"{name:24s} graph vs eager: hidden rel err {err:.2e}, "
                f"greedy tokens equal on {100 * same:.1f} % of rows")
        md, ids, pos = _step_inputs(eng, *MIXED)
        if DEV.type == "cuda":   # implicit host syncs inside the forward
            import warnings
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                model(ids, pos, kv, _step_inputs(eng, *MIXED)[0])
                torch.cuda.set_sync_debug_mode("default")
            res["implicit_syncs"] = [str(w.message)[:200] for w in caught][:10]
            say(f"implicit syncs in the mixed forward: {len(caught)}")
            for w in res["implicit_syncs"]:
                say(f"  {w}")
        # cProfile: own time per function over several mixed forwards
        mds = [_step_inputs(eng, *MIXED)[0] for _ in range(5)]
        sync()
        prof = cProfile.Profile()
        prof.enable()
        for m in mds:
            model(ids, pos, kv, m)
        prof.disable()
        sync()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumulative").print_stats(30)
        say("--- cProfile of 5 mixed forwards")
        say(buf.getvalue())
        res["cprofile"] = buf.getvalue()[-20000:]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tp:
            for m in [_step_inputs(eng, *MIXED)[0] for _ in range(3)]:
                model(ids, pos, kv, m)
            sync()
        table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
        say("--- torch.profiler (CPU) of 3 mixed forwards")
        say(table)
    eng.shutdown()
    return res


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "host-profile-out")
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("kvfleet.engine.cuda_graphs").setLevel(logging.INFO)   # the captures' times and memory
    launch_costs()
    forwards()
    RUN.write(out, "host_profile")
    print(f"host profile written to {out}; failed sections: {RUN.failed() or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
