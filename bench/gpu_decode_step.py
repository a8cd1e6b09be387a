"""Issue 16's low-load TPOT: the graph-replayed decode step at batch 1, 4, 16 (context 1024) per variant of
the shorter decode step, side by side in one process. Usage:
    python bench/gpu_decode_step.py OUT_DIR [MODEL_DIR]      (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU)

Writes OUT_DIR/decode_step.json and OUT_DIR/decode_step.txt. Three sections, each on its own (one failure
leaves the others):

1. decode attention alone (Llama-3.1-8B heads 32/8, D 128, bf16, block size 16): 32 calls (one per layer,
   each over its own KV cache, so nothing stays in L2) captured in one CUDA graph, microseconds per call, for
   the merge of the key splits (a second kernel, "kernel", or the last split program, "fused") and the fewest
   keys per split (KVFLEET_DECODE_SPLIT_TOKENS); the split count is chosen for the engine's max_model_len, as
   the engine's graphs are captured (kernel/64 is the code before this change).
2. the KV-cache write: rotary kernel + reshape_and_cache (before) against the fused rotary_and_cache,
   32 calls in one graph.
3. the engine (Llama-3.1-8B, dummy weights, one engine): for each variant the knobs are set and the decode
   graphs recaptured, then the step (graph replay + LM head, as `probe_decode_step`) at batch 1, 4, 16 is
   timed against its weight+KV read floor; variants are cumulative from the code before the change
   (KVFLEET_FUSED_RESIDUAL=0 KVFLEET_ROTARY_CACHE=0 KVFLEET_ROPE_TABLES=0 KVFLEET_DECODE_MERGE=kernel) to all
   on, then split sizes; each also serves one 1024-token prompt's 64 greedy tokens alone (TPOT as the engine
   delivers it, and whether its tokens equal the first variant's).
   The fastest variant at batch 1 gets a torch.profiler kernel table of one eager batch-1 forward (metadata
   with the graphs' max_seq_len, so it runs the graph's kernels).

DECODE_SECTIONS=attention,cache,engine picks sections (by function name), DECODE_VARIANTS=0,4 engine
variants (by index in VARIANTS). The knobs are environment variables read once at import/construction;
this script sets the values they were read into (`apply_variant`) so every variant runs in one process on
one engine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kvfleet.engine.attention import build_attention_metadata, triton_backend  # noqa: E402
from kvfleet.engine.kernels import paged_decode  # noqa: E402
from kvfleet.engine.kernels.paged_decode import choose_num_splits, paged_attention_ref  # noqa: E402
from kvfleet.engine.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
from kvfleet.engine.kernels.rotary import apply_rotary_cos_sin  # noqa: E402
from kvfleet.engine.kernels.rotary_cache import rotary_and_cache  # noqa: E402
from kvfleet.engine.models import layers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import GpuReport  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
RUN = GpuReport(on_cuda=DEV.type == "cuda")
BF16 = torch.bfloat16
LAYERS = 2 if DRY else 32
CTX = 64 if DRY else 1024
BATCHES = (1, 4) if DRY else (1, 4, 16)
MAX_MODEL_LEN = 8192 + 512 + 64   # as gpu_profile_issue16.py's engine: the graphs' split count follows it
HQ, HKV, D, BLOCK = 32, 8, 128, 16


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    fused_residual: bool    # KVFLEET_FUSED_RESIDUAL
    rotary_cache: bool      # KVFLEET_ROTARY_CACHE
    rope_tables: bool       # KVFLEET_ROPE_TABLES
    merge: str              # KVFLEET_DECODE_MERGE
    split_tokens: int       # KVFLEET_DECODE_SPLIT_TOKENS


VARIANTS = [
    Variant("before (all off)", False, False, False, "kernel", 64),
    Variant("+ residual add in the norm", True, False, False, "kernel", 64),
    Variant("+ rotary fused with the cache write", True, True, False, "kernel", 64),
    Variant("+ rotary tables in one kernel (the defaults)", True, True, True, "kernel", 64),
    Variant("+ fused split merge (all on)", True, True, True, "fused", 64),
    Variant("all on, split >= 128 keys", True, True, True, "fused", 128),
    Variant("all on, split >= 256 keys", True, True, True, "fused", 256),
]


say, section = RUN.say, RUN.section


def graph_us_per_call(calls: list[Callable[[], Any]], iters: int = 20) -> float:
    """All calls captured in one CUDA graph (as the engine's step runs them); median replay / len(calls)."""
    if DRY:
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) / len(calls) * 1e6
    from kvfleet.engine.bench.decode_probe import median_cuda_ms

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:   # compile, settle allocators
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    ms = median_cuda_ms(g.replay, iters)
    del g
    return ms / len(calls) * 1e3


def _decode_case(batch: int) -> dict[str, Any]:
    per_seq = math.ceil(CTX / BLOCK)
    nb = batch * per_seq + 1
    tables = torch.randperm(nb - 1)[: batch * per_seq].view(batch, per_seq).tolist()
    md = build_attention_metadata([1] * batch, [CTX] * batch, tables, BLOCK, DEV)
    caches = [torch.randn(2, nb, BLOCK, HKV, D, device=DEV).to(BF16) for _ in range(LAYERS)]
    qs = [torch.randn(batch, HQ, D, device=DEV).to(BF16) for _ in range(LAYERS)]
    return {"md": md, "caches": caches, "qs": qs, "outs": [torch.empty_like(q) for q in qs]}


@section("decode attention (one call per layer, in a CUDA graph)")
def decode_attention() -> list[dict[str, Any]]:
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count if DEV.type == "cuda" else 4
    rows = []
    variants = [(m, st) for m in ("kernel", "fused") for st in (64, 128, 256)]
    for batch in BATCHES:
        c = _decode_case(batch)
        md = c["md"]
        ref = paged_attention_ref(c["qs"][0], c["caches"][0], md.block_tables, md.seq_lens, md.query_start_loc,
                                  D ** -0.5).float()
        line = [f"B={batch:2d}:"]
        for merge, st in variants:
            splits = choose_num_splits(batch, HKV, MAX_MODEL_LEN, sms, min_tokens_per_split=st)
            calls = [functools.partial(paged_decode.paged_decode_attention, c["qs"][i], c["caches"][i],
                                       md.block_tables, md.seq_lens, md.query_start_loc, D ** -0.5, c["outs"][i],
                                       num_splits=splits, merge=merge, split_tokens=st) for i in range(LAYERS)]
            us = graph_us_per_call(calls)
            out = c["outs"][0].float()
            err = float((out - ref).norm() / ref.norm())
            rows.append({"batch": batch, "ctx": CTX, "merge": merge, "split_tokens": st, "num_splits": splits,
                         "us_per_call": us, "rel_err": err})
            line.append(f"{merge}/{st}: {us:.2f} us (err {err:.1e})")
        say("  ".join(line))
    say("(merge/split_tokens; kernel/64 is the code before this change)")
    return rows


def _rotary_then_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The two kernels before the fusion."""
    apply_rotary_cos_sin(q, k, cos, sin)
    reshape_and_cache(k, v, cache, slots)


@section("KV-cache write with rotary (one call per layer, in a CUDA graph)")
def cache_write() -> list[dict[str, Any]]:
    rows = []
    for batch in BATCHES:
        c = _decode_case(batch)
        slots = c["md"].slot_mapping
        qkv = [torch.randn(batch, (HQ + 2 * HKV) * D, device=DEV).to(BF16) for _ in range(LAYERS)]
        views = [(x[:, :HQ * D].view(batch, HQ, D), x[:, HQ * D:(HQ + HKV) * D].view(batch, HKV, D),
                  x[:, (HQ + HKV) * D:].view(batch, HKV, D)) for x in qkv]
        cos, sin = torch.randn(batch, D, device=DEV).to(BF16), torch.randn(batch, D, device=DEV).to(BF16)
        args = [(*views[i], cos, sin, c["caches"][i], slots) for i in range(LAYERS)]
        b_us = graph_us_per_call([functools.partial(_rotary_then_cache, *a) for a in args])
        f_us = graph_us_per_call([functools.partial(rotary_and_cache, *a) for a in args])
        rows.append({"batch": batch, "before_us": b_us, "fused_us": f_us})
        say(f"B={batch:2d}: rotary + reshape_and_cache {b_us:.2f} us, rotary_and_cache {f_us:.2f} us per layer")
    rows.append(_same_results())
    return rows


def _same_results() -> dict[str, Any]:
    """On this device: the fused kernels give the same bits as the paths they replace."""
    from kvfleet.engine.kernels.rotary import rope_tables
    from kvfleet.engine.rope import rope_inv_freq

    c = _decode_case(4)
    slots = c["md"].slot_mapping
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    inv = rope_inv_freq(D, 500000.0, scaling).to(DEV)
    pos = torch.tensor([0, 1, 1023, 131071], device=DEV)
    cos, sin = rope_tables(pos, inv, BF16)
    freqs = pos[:, None].to(torch.float32) * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    tables_equal = torch.equal(cos, emb.cos().to(BF16)) and torch.equal(sin, emb.sin().to(BF16))
    qkv = torch.randn(4, (HQ + 2 * HKV) * D, device=DEV).to(BF16)
    q, k, v = qkv[:, :HQ * D].view(4, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(4, HKV, D), qkv[:, (HQ + HKV) * D:]
    q2, k2 = q.clone(), k.clone()
    cache1, cache2 = c["caches"][0].clone(), c["caches"][0].clone()
    _rotary_then_cache(q2, k2, v.view(4, HKV, D), cos, sin, cache2, slots)
    rotary_and_cache(q, k, v.view(4, HKV, D), cos, sin, cache1, slots)
    fused_equal = torch.equal(q, q2) and torch.equal(cache1, cache2)
    say(f"rope_tables == torch's cos/sin (bf16, bitwise): {tables_equal}; "
        f"rotary_and_cache == rotary + reshape_and_cache (bitwise): {fused_equal}")
    return {"rope_tables_bitwise": tables_equal, "rotary_cache_bitwise": fused_equal}


def apply_variant(eng: Any, v: Variant) -> None:
    """Set the values the knobs were read into, then recapture the decode graphs with them."""
    eng.runner.executor.model.model.defer_residual_add = v.fused_residual
    layers.ROPE_TABLE_KERNEL = v.rope_tables
    triton_backend.FUSED_ROTARY_CACHE = v.rotary_cache
    paged_decode.DEFAULT_MERGE = v.merge
    paged_decode.DEFAULT_SPLIT_TOKENS = v.split_tokens
    graphs = eng.runner.executor.graphs
    if graphs is not None:
        graphs.release()
        torch.cuda.empty_cache()
        graphs.capture()


def _profile_table(fn: Callable[[], Any], rows: int = 22) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if DEV.type == "cuda" else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def _dry_model() -> str:
    from kvfleet.engine.testing import make_tiny_model

    return str(make_tiny_model("llama", Path(tempfile.gettempdir()) / "kvfleet-decode-step-llama"))


@section("engine decode step per variant")
def engine_variants() -> dict[str, Any]:
    from kvfleet.engine.bench.decode_probe import probe_decode_step
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    model = sys.argv[2] if len(sys.argv) > 2 else ("" if DRY else "bench/models/llama-3.1-8b")
    model = model or _dry_model()
    t0 = time.monotonic()
    cfg = EngineConfig(model=model, load_format="dummy", dtype="bfloat16" if not DRY else "float32",
                       device=DEV.type, max_model_len=MAX_MODEL_LEN if not DRY else 256,
                       max_num_seqs=max(BATCHES), num_kv_blocks=256 if DRY else None)
    eng = LLMEngine(cfg)
    res: dict[str, Any] = {"engine_init_s": time.monotonic() - t0, "variants": []}
    say(f"engine init {res['engine_init_s']:.1f} s")
    from kvfleet.engine.sampling_params import SamplingParams

    prompt = torch.randint(0, min(eng.model_config.vocab_size, 32000), (CTX,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    baseline_tokens: list[int] | None = None

    def solo(name: str) -> tuple[float, list[int]]:
        """One 1024-token prompt, 64 greedy tokens alone: TPOT as the engine delivers it, and its tokens."""
        eng.add_request(name, {"prompt_token_ids": prompt},
                        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        done = []
        while eng.has_unfinished_requests():
            done += [o for o in eng.step() if o.finished]
        eng.kv.reset_prefix_cache()
        m = done[0].metrics
        return 1e3 * (m.finished_time - m.first_token_time) / 63, list(done[0].outputs[0].token_ids)

    best: tuple[float, Variant] | None = None
    pick = [int(i) for i in os.environ.get("DECODE_VARIANTS", "").split(",") if i.strip()]
    for v in [VARIANTS[i] for i in pick] if pick else VARIANTS:
        t = time.monotonic()
        apply_variant(eng, v)
        row: dict[str, Any] = {"variant": dataclasses.asdict(v), "steps": []}
        parts = []
        for batch in BATCHES:
            if DEV.type == "cuda":
                p = probe_decode_step(eng, batch, CTX)
            else:   # the interpreter: check the script runs, time nothing real
                p = {"batch": batch, "step_ms": float("nan"), "floor_ms": float("nan"), "x_floor": float("nan")}
            row["steps"].append(p)
            parts.append(f"B={batch}: {p.get('step_ms', float('nan')):.3f} ms ({p.get('x_floor', float('nan')):.2f}x"
                         f" floor {p.get('floor_ms', float('nan')):.3f})")
        tpot, tokens = solo(f"solo-{len(res['variants'])}")
        baseline_tokens = baseline_tokens or tokens
        row["solo_tpot_ms"], row["greedy_tokens_as_first_variant"] = tpot, tokens == baseline_tokens
        res["variants"].append(row)
        say(f"{v.name:42s} " + "  ".join(parts) + f"  solo TPOT {tpot:.3f} ms, tokens = first variant's: "
            f"{tokens == baseline_tokens}   [{time.monotonic() - t:.1f} s]")
        b1 = row["steps"][0].get("step_ms", float("nan"))
        if best is None or (b1 == b1 and b1 < best[0]):
            best = (b1, v)
    assert best is not None
    v = best[1]
    apply_variant(eng, v)
    runner = eng.runner
    md = build_attention_metadata([1], [CTX], [list(range(math.ceil(CTX / runner.block_size)))],
                                  runner.block_size, DEV)
    md = dataclasses.replace(md, max_seq_len=MAX_MODEL_LEN if not DRY else 256)   # the graphs' split count
    ids, pos = torch.tensor([5], device=DEV), torch.tensor([CTX - 1], device=DEV)
    with torch.inference_mode():
        for _ in range(3):
            runner.executor.model(ids, pos, runner.kv_caches, md)
        table = _profile_table(lambda: runner.executor.model(ids, pos, runner.kv_caches, md))
    say(f"--- eager batch-1 forward, best variant at batch 1: {v.name}")
    say(table)
    res["best_b1"] = dataclasses.asdict(v)
    eng.shutdown()
    return res


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "decode-step-out")
    out.mkdir(parents=True, exist_ok=True)
    say(f"KVFLEET_COMMIT={os.environ.get('KVFLEET_COMMIT', '?')} layers={LAYERS} ctx={CTX} batches={BATCHES}")
    only = [w for w in os.environ.get("DECODE_SECTIONS", "").split(",") if w]
    for fn in (decode_attention, cache_write, engine_variants):
        if not only or any(w in fn.__name__ for w in only):
            fn()
    RUN.write(out, "decode_step")
    failed = RUN.failed()
    print(f"written to {out}; failed sections: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
