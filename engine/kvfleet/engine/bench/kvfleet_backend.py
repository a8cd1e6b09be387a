"""The kvfleet side of the throughput benchmark: drive ``LLMEngine.step()`` over a workload.

Besides the wall time it samples the KV pool every step (peak blocks in use, and
the slots allocated but empty at that peak) and times each part of a step
(schedule, input preparation, forward, sampling, update) separately for decode
and mixed steps, to show where a step's time goes.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import logging
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

from kvfleet.engine.bench.stats import kv_fragmentation, percentiles, request_latencies
from kvfleet.engine.bench.step_trace import StepTrace
from kvfleet.engine.bench.workloads import BenchRequest

logger = logging.getLogger(__name__)


def default_max_model_len(reqs: list[BenchRequest], multiple: int = 256) -> int:
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    return -(-longest // multiple) * multiple


class StepTimers:
    """Wraps the engine's step parts with timers (a CUDA sync around the forward, so it is GPU time)."""

    def __init__(self, engine: Any, cuda: bool, sync_forward: bool = True) -> None:
        import torch

        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.kind = "decode"
        self._cur: dict[str, float] = {}
        sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        sched, runner = engine.scheduler, engine.runner
        executor = runner.executor

        def timed(name: str, fn: Callable[..., Any], synced: bool = False) -> Callable[..., Any]:
            def wrapper(*a: Any, **kw: Any) -> Any:
                if synced:
                    sync()
                t = time.perf_counter()
                res = fn(*a, **kw)
                if synced:
                    sync()
                self._cur[name] = self._cur.get(name, 0.0) + time.perf_counter() - t
                return res
            return wrapper

        orig_schedule = sched.schedule
        self._originals = [(sched, "schedule", sched.schedule), (sched, "update_from_output", sched.update_from_output),
                           (runner, "execute", runner.execute), (runner, "forward_step", runner.forward_step),
                           (runner, "sample_step", runner.sample_step),
                           (runner, "collect", runner.collect), (runner, "prepare", runner.prepare),
                           (executor, "forward", executor.forward),
                           (executor, "compute_logits", executor.compute_logits), (runner, "sampler", runner.sampler),
                           (runner, "_sampling_batch", runner._sampling_batch)]
        self._slowest: dict[str, list[tuple[float, int, int, dict[str, float]]]] = defaultdict(list)
        self._seq = 0
        self._gc_start = 0.0

        def schedule(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = orig_schedule(*a, **kw)
            self._cur["schedule"] = time.perf_counter() - t
            steps = out.scheduled
            self.kind = "decode" if steps and all(s.num_new_tokens == 1 for s in steps) else "mixed"
            self.batch = len(steps)
            return out

        sched.schedule = schedule
        if sync_forward:
            runner.execute = timed("execute", runner.execute)
        else:   # the async engine prepares and launches a step, then collects it (its wait) one step later
            runner.prepare = timed("prepare_async", runner.prepare)
            runner.forward_step = timed("execute", runner.forward_step)   # (launch calls both)
            runner.sample_step = timed("execute", runner.sample_step)
            runner.collect = timed("wait", runner.collect)
        executor.forward = timed("forward", executor.forward, synced=sync_forward)
        executor.compute_logits = timed("logits", executor.compute_logits, synced=sync_forward)
        runner.sampler = _TimedCallable(runner.sampler, self._cur, sync if sync_forward else (lambda: None))
        runner._sampling_batch = timed("sampling_batch", runner._sampling_batch)
        gc.callbacks.append(self._on_gc)
        sched.update_from_output = timed("update", sched.update_from_output)
        self.batch = 0

    def restore(self) -> None:
        """Put the engine's own methods back (the next workload's timers wrap them afresh)."""
        for obj, name, orig in self._originals:
            setattr(obj, name, orig)
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        """Time the interpreter's garbage collections (a full one can stall a step by itself)."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self._cur["gc"] = self._cur.get("gc", 0.0) + time.perf_counter() - self._gc_start
            self._gc_start = 0.0

    def end_step(self, step_s: float) -> None:
        if not self._cur:
            return
        tot = self.totals[self.kind]
        tot["steps"] += 1
        tot["step"] += step_s
        tot["batch_sum"] += self.batch
        for k, v in self._cur.items():
            tot[k] += v
        # the slowest steps of each kind with their parts: a mean can hide one stall
        self._seq += 1
        entry = (step_s, self._seq, self.batch, dict(self._cur))
        slow = self._slowest[self.kind]
        if len(slow) < 5:
            heapq.heappush(slow, entry)
        elif step_s > slow[0][0]:
            heapq.heapreplace(slow, entry)
        self._cur.clear()

    def report(self) -> dict[str, dict[str, Any]]:
        """Per kind of step: count, mean batch, mean milliseconds of each part, and the slowest steps."""
        out: dict[str, dict[str, Any]] = {}
        for kind, tot in self.totals.items():
            n = max(1.0, tot["steps"])
            fwd, smp, lgt = tot.get("forward", 0.0), tot.get("sample", 0.0), tot.get("logits", 0.0)
            bat = tot.get("sampling_batch", 0.0)
            prep = tot.get("execute", 0.0) - fwd - smp - lgt - bat
            prep_async = tot.get("prepare_async", 0.0)   # async: the step's inputs, built before its launch
            rest = (tot["step"] - tot.get("schedule", 0.0) - tot.get("execute", 0.0) - tot.get("wait", 0.0)
                    - tot.get("update", 0.0) - prep_async)
            out[kind] = {"steps": int(tot["steps"]), "mean_batch": tot["batch_sum"] / n,
                         "step_ms": 1e3 * tot["step"] / n, "schedule_ms": 1e3 * tot.get("schedule", 0.0) / n,
                         "prepare_ms": 1e3 * prep / n, "prepare_async_ms": 1e3 * prep_async / n,
                         "forward_ms": 1e3 * fwd / n, "logits_ms": 1e3 * lgt / n,
                         "sample_ms": 1e3 * smp / n, "sampling_batch_ms": 1e3 * bat / n,
                         "gc_ms": 1e3 * tot.get("gc", 0.0) / n,
                         "update_ms": 1e3 * tot.get("update", 0.0) / n, "outputs_ms": 1e3 * rest / n,
                         "wait_ms": 1e3 * tot.get("wait", 0.0) / n,
                         "slowest": [{"step": seq, "batch": batch, "step_ms": 1e3 * dt,
                                      **{f"{k}_ms": 1e3 * v for k, v in parts.items()}}
                                     for dt, seq, batch, parts in sorted(self._slowest[kind], reverse=True)]}
        return out


class SyncRecorder:
    """Where the host waits for the device during a run: `torch.cuda.set_sync_debug_mode("warn")` warns at
    each synchronizing call (pageable copies, `.item()`, `nonzero`...); the Python stacks are counted."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, ...]] = Counter()

    def __enter__(self) -> "SyncRecorder":
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)

    def _record(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                file: Any = None, line: str | None = None) -> None:
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                  if "kvfleet" in f.filename and "kvfleet_backend" not in f.filename]
        self.counts[tuple(frames[-4:]) + (str(message)[:80],)] += 1

    def report(self) -> list[dict[str, Any]]:
        return [{"count": n, "stack": list(k)} for k, n in self.counts.most_common(12)]


class _TimedCallable:
    def __init__(self, fn: Any, cur: dict[str, float], sync: Callable[[], None]) -> None:
        self.fn, self.cur, self.sync = fn, cur, sync

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        res = self.fn(*a, **kw)
        self.sync()
        self.cur["sample"] = self.cur.get("sample", 0.0) + time.perf_counter() - t
        return res


def _params(r: BenchRequest) -> Any:
    from kvfleet.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=r.max_tokens, n=r.n, temperature=r.temperature, ignore_eos=True,
                          repetition_penalty=r.repetition_penalty)


_ALLOCATOR_COUNTS = {"device": ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams"),
                     "host": ("num_host_alloc", "num_host_free")}


def _allocator_counts(cuda: bool) -> dict[str, int]:
    """Counters of PyTorch's CUDA caching allocators (device and pinned host) that mean a call into the driver."""
    if not cuda:
        return {}
    import torch

    dev = torch.cuda.memory_stats()
    counts = {f"device.{k}": int(dev.get(k, 0)) for k in _ALLOCATOR_COUNTS["device"]}
    host = torch.cuda.host_memory_stats()
    counts.update({f"host.{k}": int(host.get(k, 0)) for k in _ALLOCATOR_COUNTS["host"]})
    return counts


def _write_profile(prof: Any, path: str) -> None:
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(35)
    Path(path).write_text(buf.getvalue())


def _drain(engine: Any, on_step: Callable[[list[Any], float], None] | None = None) -> list[Any]:
    done: list[Any] = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step(final_only=True)  # offline: only finished outputs are read
        dt = time.perf_counter() - t
        done.extend(o for o in outs if o.finished)
        if on_step is not None:
            on_step(outs, dt)
    return done


class KvfleetBench:
    """One engine for several workloads (its start, graph capture and warm-up paid once)."""

    def __init__(self, args: argparse.Namespace, max_model_len: int, warm: list[BenchRequest]) -> None:
        from kvfleet.engine.config import EngineConfig
        from kvfleet.engine.llm_engine import LLMEngine
        from kvfleet.engine.warmup import TRITON_COMPILES

        self.args = args
        self.max_model_len = max_model_len
        block = {"block_size": args.block_size} if args.block_size is not None else {}
        cfg = EngineConfig(**block, model=str(args.model), dtype=args.dtype, device=args.device,
                           load_format=args.load_format, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
                           enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
                           tensor_parallel_size=args.tensor_parallel_size,
                           async_scheduling=getattr(args, "async_scheduling", None),
                           quantization=getattr(args, "quantization", None))
        t = time.monotonic()
        self.engine = engine = LLMEngine(cfg)
        # the server's warm-up too (every step shape, so no kernel compiles inside a timed run), as vLLM's
        # LLM() compiles and warms up before generate(); counted in init_s, as vLLM's is
        self.warmup = engine.warm_up()
        self.init_s = time.monotonic() - t
        self.cuda = engine.device.type == "cuda"
        for i, r in enumerate(warm):
            engine.add_request(f"warm{i}", {"prompt_token_ids": r.prompt_token_ids}, _params(r))
        _drain(engine)
        self.engine.kv.reset_prefix_cache()   # the timed runs find nothing cached by the warm-up
        TRITON_COMPILES.serving()   # from here each kernel variant readied is logged by name: the warm-up missed it

    def run(self, reqs: list[BenchRequest]) -> dict[str, Any]:
        import torch

        from kvfleet.engine.warmup import TRITON_COMPILES

        engine, args, cuda = self.engine, self.args, self.cuda
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        alloc_before = _allocator_counts(cuda)
        compiles_before = TRITON_COMPILES.count
        before = engine.stats()
        graphs_before = engine.runner.executor.graphs
        shared_before = graphs_before.shared_replays if graphs_before is not None else 0
        short_before = graphs_before.short_replays if graphs_before is not None else 0
        # With async scheduling the forward is not synchronised (that would undo the overlap): its
        # timer is then launch time only, and "outputs" is the host time not hidden behind the device.
        timers = StepTimers(engine, cuda, sync_forward=not engine.config.async_scheduling)
        block_size = engine.config.block_size
        peak: dict[str, Any] = {"kv_blocks_used": -1}

        trace = StepTrace() if args.step_trace else None
        tokens_before = engine.generation_tokens

        def on_step(outs: list[Any], dt: float) -> None:
            nonlocal tokens_before
            timers.end_step(dt)
            if trace is not None:   # the tokens this call read (with async scheduling: the step before's)
                trace.add_step(time.monotonic() - t0, engine.generation_tokens - tokens_before)
                tokens_before = engine.generation_tokens
            st = engine.stats()
            if st["kv_blocks_used"] > peak["kv_blocks_used"]:
                running = engine.scheduler.running
                tokens = sum(r.num_computed_tokens for r in running)
                peak.update(kv_blocks_used=st["kv_blocks_used"], kv_cache_usage=st["kv_cache_usage"],
                            num_running=len(running), tokens_in_kv=tokens,
                            **kv_fragmentation(st["kv_blocks_used"], block_size, tokens, len(running)))

        ahead_before, forwarded_before = engine.num_launched_ahead, engine.num_forwarded_ahead
        t0 = time.monotonic()
        for i, r in enumerate(reqs):
            engine.add_request(f"r{i}", {"prompt_token_ids": r.prompt_token_ids}, _params(r), arrival_time=t0)
        prof_path = getattr(args, "profile_host", None)
        sync_rec = SyncRecorder() if cuda and getattr(args, "sync_debug", False) else None
        try:
            if prof_path:  # where the host's time goes on the real machine (slows the run: not for reported figures)
                import cProfile

                prof = cProfile.Profile()
                done = prof.runcall(_drain, engine, on_step)
            elif sync_rec is not None:
                with sync_rec:
                    done = _drain(engine, on_step)
            else:
                done = _drain(engine, on_step)
            if cuda:
                torch.cuda.synchronize()
            wall = time.monotonic() - t0
        finally:
            timers.restore()
        if prof_path:
            _write_profile(prof, prof_path)
        by_id = {o.request_id: o for o in done}
        ttft, tpot, short = [], [], 0
        for i, r in enumerate(reqs):
            o = by_id.get(f"r{i}")
            if o is None:
                raise RuntimeError(f"request r{i} did not finish")
            lens = [len(c.token_ids) for c in o.outputs]
            short += int(len(lens) != r.n or any(n != r.max_tokens for n in lens))
            m = o.metrics
            a, b = request_latencies(m.arrival_time, m.first_token_time, m.finished_time, lens[0] if lens else 0)
            ttft.append(a)
            tpot.append(b)
            if trace is not None and m.first_token_time is not None and m.finished_time is not None:
                trace.first_token_s.append(m.first_token_time - t0)
                trace.finished_s.append(m.finished_time - t0)
        stats = engine.stats()
        res: dict[str, Any] = {
            "wall_s": wall, "init_s": self.init_s, "warmup_s": self.warmup.seconds,
            "warmup_triton_compiles": self.warmup.triton_compiles, "max_model_len": self.max_model_len,
            # kernel variants first launched inside this timed run (each a compile or a module load on its time;
            # None without Triton's hook, i.e. off CUDA)
            "triton_variants_in_run": TRITON_COMPILES.count - compiles_before if TRITON_COMPILES.installed else None,
            "requests_with_wrong_length": short,
            "ttft_ms": _ms(percentiles(ttft)), "tpot_ms": _ms(percentiles(tpot)),
            "kv_blocks_total": stats["kv_blocks_total"], "kv_block_size": block_size,
            "kv_peak": peak, "num_preemptions": stats["num_preemptions"] - before["num_preemptions"],
            "prefix_cache_hits": stats["prefix_cache_hits"] - before["prefix_cache_hits"],
            "step_breakdown_ms": timers.report(),
            "cuda_graphs": engine.runner.executor.graphs is not None,
            # async scheduling: steps launched before the last one's tokens were read, and those whose forward only
            # was (KVFLEET_FORWARD_AHEAD: a penalty or a grammar in the batch)
            "steps_launched_ahead": engine.num_launched_ahead - ahead_before,
            "steps_forwarded_ahead": engine.num_forwarded_ahead - forwarded_before,
        }
        if trace is not None:
            res["step_trace"] = trace.to_json()
        graphs = engine.runner.executor.graphs
        if graphs is not None:
            # decode steps replayed with the shared-prefix pass (cascade attention), during the timed run
            res["shared_prefix_replays"] = graphs.shared_replays - shared_before
            # decode steps replayed from the graphs for short contexts (KVFLEET_DECODE_LONG_SPLIT on)
            res["short_context_replays"] = graphs.short_replays - short_before
        if cuda:
            # allocator events during the run: a device allocation retry (cudaFree) or a new pinned host block
            # (cudaHostAlloc) makes the host wait for the device, undoing async scheduling's overlap
            after = _allocator_counts(cuda)
            res["allocator_events"] = {k: after[k] - alloc_before.get(k, 0) for k in after}
            res["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            res["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            free, total = torch.cuda.mem_get_info()
            res["gpu_mem_used_gib"] = (total - free) / 2**30
        if cuda and getattr(args, "decode_probe", None):
            from kvfleet.engine.bench.decode_probe import probe_decode_step

            b, ctx = (int(x) for x in args.decode_probe.lower().split("x"))
            res["decode_probe"] = probe_decode_step(engine, b, ctx)
        if sync_rec is not None:
            res["sync_points"] = sync_rec.report()
        res["tensor_parallel_size"] = args.tensor_parallel_size
        res["async_scheduling"] = bool(engine.config.async_scheduling)
        engine.kv.reset_prefix_cache()   # the next workload starts from an empty prefix cache
        return res

    def close(self) -> None:
        self.engine.shutdown()  # stops tensor-parallel workers


def run_kvfleet(args: argparse.Namespace, reqs: list[BenchRequest], warm: list[BenchRequest]) -> dict[str, Any]:
    bench = KvfleetBench(args, args.max_model_len or default_max_model_len(reqs), warm)
    try:
        return bench.run(reqs)
    finally:
        bench.close()


def _ms(p: dict[str, float] | None) -> dict[str, float] | None:
    return None if p is None else {k: 1e3 * v for k, v in p.items()}
