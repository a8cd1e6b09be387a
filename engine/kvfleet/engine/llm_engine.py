"""`LLMEngine`: one `step()` = schedule -> run the model -> update -> outputs.

It turns user requests into sequences (forking for `n`/`best_of`/beam search),
applies what the scheduler cannot see (stop strings, beam choices), and builds the
`RequestOutput`s. `LLM` and `AsyncLLM` sit on it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import torch

from kvfleet.engine import gc_policy
from kvfleet.engine.async_step import FORWARD_AHEAD, LAUNCH_AHEAD, InFlight
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.beam_search import Beam, BeamSearchState, Hypothesis
from kvfleet.engine.core.grammar import TokenGrammar
from kvfleet.engine.core.inputs import PromptType, check_prompt, check_text, split_prompt
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request, RequestStatus
from kvfleet.engine.core.request_group import RequestGroup
from kvfleet.engine.core.runner_output import ModelRunnerOutput
from kvfleet.engine.core.scheduler import RequestUpdate, Scheduler, SchedulerOutput
from kvfleet.engine.gpu_step_clock import GpuStepClock, GpuStepTimes, StepEvents
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvfleet.engine.step_timeline import StepShape, StepTimeline, shape_of
from kvfleet.engine.token_rules import all_of, token_rules
from kvfleet.engine.warmup import WarmupReport, Wave, run_warmup

if TYPE_CHECKING:
    from kvfleet.engine.model_runner import Forwarded, Prepared
    from kvfleet.engine.structured_outputs import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineInputs:
    """A request as `LLMEngine.process_inputs` checked it: its text (if it came as text), its token ids, its own
    copy of the sampling parameters, and the output tokens it may have (``max_tokens`` resolved)."""

    text: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    grammar: Optional[TokenGrammar] = None   # structured outputs: the constraint's initial state, compiled
    token_rules: Optional[TokenGrammar] = None   # allowed_token_ids and bad_words (token_rules.py)


class StepError(RuntimeError):
    """A model step failed; the requests in it (`request_ids`) were aborted."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"engine: step failed for {len(request_ids)} request(s): {cause}")
        self.request_ids = request_ids


def public_stop_reason(reason: Optional[object], params: SamplingParams, eos_token_ids: frozenset[int]
                       ) -> Optional[object]:
    """vLLM's `stop_reason`: the stop string or stop_token_ids entry that matched, None for EOS.

    The scheduler records whichever token stopped a sequence (EOS ids are among its stop ids);
    as in vLLM, EOS wins unless `ignore_eos`, even when the user also listed that id."""
    if isinstance(reason, int) and not params.ignore_eos and reason in eos_token_ids:
        return None
    return reason


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from kvfleet.engine.model_runner import ModelRunner
        from kvfleet.engine.tokenizer import load_tokenizer

        config.validate()
        self.device = resolve_device(config.device)
        async_scheduling = config.async_scheduling
        if async_scheduling is None:  # auto: overlap where there is a device to overlap with
            async_scheduling = self.device.type == "cuda"
            config = dataclasses.replace(config, async_scheduling=async_scheduling)
        self.config = config
        torch.manual_seed(config.seed)
        self.model_config = ModelConfig.from_pretrained(str(config.model), config.max_model_len, config.dtype,
                                                        self.device)
        try:
            self.tokenizer: Any = load_tokenizer(config.tokenizer or str(config.model))
        except Exception as e:  # dummy-weight benchmark configs may have no tokenizer
            if config.load_format != "dummy":
                raise
            logger.info("no tokenizer for %s (%s); prompts must be token ids", config.model, e)
            self.tokenizer = None
        max_len = self.model_config.max_model_len
        budget = config.resolve_batched_tokens(max_len, on_gpu=self.device.type == "cuda")
        if config.quantization == "fp8":
            from kvfleet.engine.models.fp8 import check_fp8_supported

            check_fp8_supported(self.device)   # before loading: a clear error, not a failing matmul later
        # The executor loads the weights in their serving form (FP8 quantized by each rank, if asked) before the
        # KV cache is sized and graphs captured: the memory bf16 weights free goes to the cache.
        self.runner = ModelRunner(self.model_config, config, self.device, budget)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.init_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, budget, max_len, config.enable_chunked_prefill)
        self.scheduler.async_placeholders = async_scheduling
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.groups: dict[str, RequestGroup] = {}
        self._grammars: Optional[GrammarCompiler] = None   # structured outputs: made on first use
        self._grammars_lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.idle_steps = 0          # consecutive steps that scheduled nothing (a stall if it grows)
        # Async scheduling: the launched step whose sampled ids are not collected yet.
        self._inflight: Optional[tuple[SchedulerOutput, InFlight]] = None
        self.num_overlapped_steps = 0   # steps scheduled and prepared while the previous one ran
        self.num_launched_ahead = 0     # of those, steps launched before the previous one's tokens were collected
        self.forward_ahead = FORWARD_AHEAD   # the others: forward queued before, sampler after (async_step)
        self.num_forwarded_ahead = 0    # of the others, steps whose forward was queued before the collect
        self.timeline = StepTimeline.from_env()   # KVFLEET_STEP_TIMELINE: a line per step, for diagnosis
        self._launched_shape: Optional[StepShape] = None
        self._collect_ms = 0.0         # how long this call waited for the step before's tokens (async scheduling)
        self._added_since_step = 0   # requests taken in since the last step() call (the timeline's intake)
        # The timeline's device side (a GPU): events around each launched step, read when its tokens are collected.
        self._gpu_clock = GpuStepClock() if self.timeline is not None and self.device.type == "cuda" else None
        self._events_inflight: Optional[StepEvents] = None   # the launched step's, as `_inflight`
        self._forward_begin: Optional[torch.cuda.Event] = None   # a forwarded step's first event, until it samples
        self._gpu_times: Optional[GpuStepTimes] = None   # of the step this call collected
        gc_policy.apply_once()

    # --- requests ------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        text, ids = split_prompt(prompt)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            assert text is not None   # split_prompt gives the text when it gives no ids
            check_text(text, "prompt")   # else the tokenizer raises a TypeError
            ids = self.tokenizer.encode(text) if text else []
        return text, ids

    def process_inputs(self, prompt: PromptType, params: Optional[SamplingParams]) -> EngineInputs:
        """Validate and tokenize (no engine state touched; a ValueError names the field)."""
        params = (params or SamplingParams()).clone()
        params.validate(self.model_config.vocab_size)
        if params.num_samples > self.config.max_num_seqs:
            name = "n" if params.n >= params.num_samples else "best_of"
            raise ValueError(f"{name}: {params.num_samples} sequences exceed max_num_seqs={self.config.max_num_seqs}")
        text, ids = self.tokenize(prompt)
        kv_tokens = self.kv.num_blocks * self.config.block_size
        beams = params.beam_width if params.use_beam_search else 1
        max_tokens = check_prompt(ids, self.model_config.vocab_size, self.model_config.max_model_len,
                                  params.max_tokens, kv_tokens, beams, self.config.block_size)
        grammar = None if params.structured_outputs is None else self.compile_grammar(params.structured_outputs)
        rules = token_rules(params, self.model_config.vocab_size, self.tokenizer)
        return EngineInputs(text, ids, params, max_tokens, grammar, rules)

    def compile_grammar(self, spec: StructuredOutputsParams) -> TokenGrammar:
        """A structured-output constraint for this model's tokenizer (a ValueError names the field)."""
        return self._grammar_compiler().compile(spec)

    def prepare_structured_outputs(self) -> bool:
        """Build the structured-outputs token table now (0.3 s for a 49k vocabulary, ~1 s for 128k, on one core)
        rather than on the first constrained request's time; the server runs it beside its warm-up. False
        when this model cannot constrain outputs (no tokenizer, or no llguidance): its requests say why."""
        try:
            self._grammar_compiler().token_table()
        except ValueError:
            return False
        return True

    def _grammar_compiler(self) -> "GrammarCompiler":
        """The compiler, and llguidance with it, loaded on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    from kvfleet.engine.structured_outputs import GrammarCompiler
                except ImportError as exc:
                    raise ValueError(f"structured_outputs: this server cannot constrain outputs ({exc}); "
                                     "install llguidance") from None
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                 self.eos_token_ids)
            return self._grammars

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None) -> None:
        """Validate and queue a request; bad input raises ValueError naming the field."""
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.add_checked(request_id, self.process_inputs(prompt, params), priority, arrival_time, cache_salt)

    def add_checked(self, request_id: str, inputs: EngineInputs, priority: int = 0,
                    arrival_time: Optional[float] = None, cache_salt: Optional[str] = None) -> None:
        """Queue a request that `process_inputs` of this engine checked (not again: the server checks each request
        on its event loop, and this runs on the step loop's thread)."""
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already running")
        text, ids, params, max_tokens = inputs.text, inputs.prompt_token_ids, inputs.params, inputs.max_tokens
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        now = arrival_time if arrival_time is not None else time.monotonic()
        group = RequestGroup(request_id, text, ids, params, self.tokenizer, RequestMetrics(arrival_time=now))
        samples = params.num_samples
        num_logprobs = params.logprobs if params.logprobs is not None else -1
        if samples > params.n:
            num_logprobs = max(num_logprobs, 0)   # best_of ranks by cumulative logprob

        def sequence(index: int, max_new: int = max_tokens, stops: frozenset[int] = stop_ids,
                     compute_limit: Optional[int] = None, external_tokens: bool = False,
                     logprobs: int = num_logprobs) -> Request:
            """Sequence `index` of this request (`<request_id>#<index>`)."""
            return Request(f"{request_id}#{index}", ids, max_tokens=max_new, min_tokens=params.min_tokens,
                           stop_token_ids=stops, priority=priority, arrival_time=now, cache_salt=cache_salt,
                           group_id=request_id, index=index, compute_limit=compute_limit,
                           external_tokens=external_tokens, sampling_params=params,
                           seed=None if params.seed is None else params.seed + index, num_logprobs=logprobs,
                           grammar=all_of([g.fork() for g in (inputs.grammar, inputs.token_rules) if g is not None]))

        if params.use_beam_search:
            # One beam to start; the engine picks every token from its top logprobs and stops it itself.
            beam = BeamSearchState(params.beam_width, max_tokens, stop_ids, params.length_penalty,
                                   params.early_stopping)
            seqs = [sequence(0, max_tokens + 1, frozenset(), external_tokens=True,
                             logprobs=max(num_logprobs, beam.num_candidates))]
            group.beam = beam
            group.beam_live = [Beam(seqs[0].request_id, [], 0.0)]
        elif samples > 1 and len(ids) > 1:
            # One parent computes all but the last prompt token, then forks (shared blocks).
            seqs = [sequence(0, compute_limit=len(ids) - 1)]
        else:
            seqs = [sequence(i) for i in range(samples)]
        for seq in seqs:
            group.add_seq(seq)
        self.groups[request_id] = group
        for seq in seqs:
            self.scheduler.add_request(seq)
        self.prompt_tokens += len(ids)
        self._added_since_step += 1

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """End requests now (their blocks are freed at once); returns their final outputs."""
        outs = []
        for rid in request_ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            seq_ids = [st.seq.request_id for st in group.seqs.values()]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            self.runner.release(seq_ids)
            group.aborted = True
            outs.append(group.make_output())
        if not self.groups and self._inflight is not None:
            # Async scheduling: the launched step only holds discarded work now.
            sched, step = self._inflight
            self._inflight = None
            self.scheduler.update_from_output(sched, self.runner.collect(step))
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def warm_up(self, plan: Optional[list[Wave]] = None) -> WarmupReport:
        """Run every step shape and sampler path once (kvfleet.engine.warmup), or only ``plan``, leaving nothing
        behind: the server calls it before /health says ready, so no request pays a first-use compile."""
        timeline, self.timeline = self.timeline, None   # the step timeline is of the work, not of the warm-up
        try:
            return run_warmup(self, plan)
        finally:
            self.timeline = timeline
            self._added_since_step = 0

    # --- the step ------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; outputs of the requests it advanced (only finished ones if `final_only`).

        With `async_scheduling` the outputs are those of the previous step (kvfleet.engine.async_step)."""
        if self.timeline is None:
            return self._step(final_only)
        start = time.monotonic()
        self._launched_shape, self._collect_ms, self._gpu_times = None, 0.0, None
        added, self._added_since_step = self._added_since_step, 0
        ahead_before = self.num_launched_ahead
        outs = self._step(final_only)
        self.timeline.add(start, time.monotonic(), self._launched_shape, self.num_launched_ahead > ahead_before,
                          self._collect_ms, len(self.scheduler.waiting), len(self.scheduler.running), len(outs), added,
                          self._gpu_times.busy_ms if self._gpu_times is not None else None,
                          self._gpu_times.idle_before_ms if self._gpu_times is not None else None)
        return outs

    def _step(self, final_only: bool) -> list[RequestOutput]:
        if self.config.async_scheduling:
            return self._step_overlapped(final_only)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.idle_steps += 1
            return []
        self.idle_steps = 0
        self._mark_scheduled(sched)
        try:
            result = self.runner.execute(sched)
        except Exception as e:
            self._fail_step(sched, e)
        updates = self.scheduler.update_from_output(sched, result)
        return self._process(sched, updates, result, final_only)

    def _step_overlapped(self, final_only: bool) -> list[RequestOutput]:
        """Async scheduling: schedule and prepare step N+1 while step N (launched by the last call)
        runs on the device, launch N+1 behind it (or, where its sampler needs N's token values, after
        the next part; with `forward_ahead`, only its sampler after), wait for N's ids and update the
        scheduler, then process N's outputs while N+1 runs. Returns step N's outputs."""
        prev, self._inflight = self._inflight, None
        prev_events, self._events_inflight = self._events_inflight, None
        sched = self.scheduler.schedule()
        if sched.is_empty and prev is None:
            self.idle_steps += 1
            return []
        self.idle_steps = 0
        prepared = None
        if not sched.is_empty:
            self._mark_scheduled(sched)
            try:
                prepared = self.runner.prepare(sched, prev[1] if prev is not None else None)
            except Exception as e:
                self._inflight, self._events_inflight = prev, prev_events
                self._fail_step(sched, e)
            if prev is not None:
                self.num_overlapped_steps += 1
        ahead = (prepared is not None and prev is not None and LAUNCH_AHEAD
                 and not self.runner.needs_token_values(sched))
        forwarded: Optional[Forwarded] = None
        if ahead and prepared is not None and prev is not None:
            self._launch(sched, prepared, prev, ahead=True)
            self.num_launched_ahead += 1
        elif prepared is not None and prev is not None and LAUNCH_AHEAD and self.forward_ahead:
            forwarded = self._forward(sched, prepared, prev)   # its sampler waits for N's tokens (below)
            self.num_forwarded_ahead += 1
        updates: list[RequestUpdate] = []
        result = None
        if prev is not None:
            try:
                collect_from = time.monotonic()
                result = self.runner.collect(prev[1])
                self._collect_ms = (time.monotonic() - collect_from) * 1e3
                if prev_events is not None and self._gpu_clock is not None:
                    times = self._gpu_clock.read(prev_events)
                    self._gpu_times = times if self._gpu_times is None else self._gpu_times.plus(times)
            except Exception as e:   # N+1 was planned on N's tokens: its requests end too
                self._inflight = None
                self._fail_step(SchedulerOutput(prev[0].scheduled + sched.scheduled), e)
            updates = self.scheduler.update_from_output(prev[0], result)
        if forwarded is not None:
            self._sample(sched, forwarded, prev)
        elif prepared is not None and not ahead:
            self._launch(sched, prepared, prev, ahead=False)
        outs = self._process(prev[0], updates, result, final_only) if prev is not None and result is not None else []
        if not self.groups and self._inflight is not None:
            outs += self._step_overlapped(final_only)   # only discarded work is left: collect it
        return outs

    def _launch(self, sched: SchedulerOutput, prepared: Prepared,
                prev: Optional[tuple[SchedulerOutput, InFlight]], ahead: bool) -> None:
        """Launch step `sched` (async scheduling) after `prev`; `ahead`: before `prev`'s tokens are collected."""
        begin = self._gpu_mark()
        try:
            self._inflight = (sched, self.runner.launch(sched, async_copy=True, prepared=prepared,
                                                        ahead_of=prev[1] if ahead and prev is not None else None))
        except Exception as e:   # N's updates are lost with the raise: its requests end too
            self._fail_step(SchedulerOutput(sched.scheduled + (prev[0].scheduled if prev else [])), e)
        self._events_inflight = self._gpu_step_events(begin)

    def _forward(self, sched: SchedulerOutput, prepared: Prepared,
                 prev: tuple[SchedulerOutput, InFlight]) -> Forwarded:
        """Queue step `sched`'s forward behind `prev` before `prev`'s tokens are collected."""
        self._forward_begin = self._gpu_mark()
        try:
            return self.runner.forward_step(sched, prepared)
        except Exception as e:   # N's updates are lost with the raise: its requests end too
            self._fail_step(SchedulerOutput(sched.scheduled + prev[0].scheduled), e)

    def _sample(self, sched: SchedulerOutput, forwarded: Forwarded,
                prev: Optional[tuple[SchedulerOutput, InFlight]]) -> None:
        """Sample step `sched`, forwarded by `_forward`, once `prev`'s tokens are taken (exact counts and masks)."""
        try:
            self._inflight = (sched, self.runner.sample_step(forwarded, async_copy=True))
        except Exception as e:   # N's updates are taken; N's outputs go with the raise: its requests end too
            self._fail_step(SchedulerOutput(sched.scheduled + (prev[0].scheduled if prev else [])), e)
        self._events_inflight, self._forward_begin = self._gpu_step_events(self._forward_begin), None

    def _gpu_mark(self) -> Optional[torch.cuda.Event]:
        """A timed event on the device's stream, only while the timeline records a GPU's steps (not in warm-up)."""
        return self._gpu_clock.mark() if self._gpu_clock is not None and self.timeline is not None else None

    def _gpu_step_events(self, begin: Optional[torch.cuda.Event]) -> Optional[StepEvents]:
        """A launched step's events: `begin` and one after everything the launch queued."""
        if begin is None or self._gpu_clock is None:
            return None
        return StepEvents(begin, self._gpu_clock.mark())

    def _mark_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        if self.timeline is not None:
            self._launched_shape = shape_of(sched)
        for s in sched.scheduled:
            if s.start != s.request.num_cached_tokens:
                continue   # not its first chunk (a first one starts after its prefix-cache hit)
            g = self.groups.get(s.request.group_id)
            if g is not None and g.metrics.first_scheduled_time is None:
                g.metrics.first_scheduled_time = now
                g.num_cached_tokens = max(0, s.request.num_cached_tokens)

    def _fail_step(self, sched: SchedulerOutput, e: Exception) -> NoReturn:
        # The step's requests are in an unknown state: end them; the others go on.
        failed = sorted({s.request.group_id for s in sched.scheduled})
        self.abort_request(failed)
        raise StepError(failed, e) from e

    def _process(self, sched: SchedulerOutput, updates: list[RequestUpdate], result: ModelRunnerOutput,
                 final_only: bool) -> list[RequestOutput]:
        """The engine's side of step `sched` after the scheduler's update: tokens into their groups
        (detokenization, stop strings, beam picks, forks) and the `RequestOutput`s."""
        touched: dict[str, RequestGroup] = {}
        groups = self.groups
        if result.prompt_logprobs:
            for s in sched.scheduled:
                entries = result.prompt_logprobs.get(s.request_id)
                g = groups.get(s.request.group_id) if entries is not None else None
                if g is not None and entries is not None:
                    g.add_prompt_logprobs(entries)
        now = time.monotonic()
        for upd in updates:
            req = upd.request
            g = groups.get(req.group_id)
            if g is None:
                continue
            self._apply(g, upd, result, now)
            touched[g.request_id] = g
        outs = []
        for g in touched.values():
            done = g.finished
            if done:
                groups.pop(g.request_id, None)
            elif final_only:
                continue
            out = g.make_output(done)
            if out.outputs or done:
                outs.append(out)
        return outs

    def _apply(self, g: RequestGroup, upd: RequestUpdate, result: ModelRunnerOutput, now: float) -> None:
        req = upd.request
        if upd.new_token_id is None:
            if req.external_tokens:
                lp = result.logprobs[req.request_id]
                g.beam_pending[req.request_id] = list(zip(lp.top_ids, lp.top_logprobs, strict=True))
                self._maybe_beam_step(g)
            elif req.compute_limit is not None:
                self._fork_samples(g, req)
            return
        self.generation_tokens += 1
        st = g.seqs[req.index]
        stop = g.record_token(st, upd.new_token_id, result.logprobs.get(req.request_id) if result.logprobs else None,
                              now)
        if stop is not None and not req.is_finished:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            req.stop_reason = stop
        if req.is_finished:
            st.finish_reason = req.status.finish_reason
            st.stop_reason = public_stop_reason(req.stop_reason, g.params, self.eos_token_ids)
            self.runner.release([req.request_id])

    def _fork_samples(self, g: RequestGroup, parent: Request) -> None:
        parent.compute_limit = None
        for i in range(1, g.params.num_samples):
            child = self.scheduler.fork(parent, f"{g.request_id}#{i}", i)
            child.compute_limit = None
            if g.params.seed is not None:
                child.seed = g.params.seed + i
            g.add_seq(child)

    def _maybe_beam_step(self, g: RequestGroup) -> None:
        assert g.beam is not None
        if any(b.key not in g.beam_pending for b in g.beam_live):
            return
        step = g.beam.step(g.beam_live, g.beam_pending)
        if g.metrics.first_token_time is None:
            g.metrics.first_token_time = time.monotonic()
        g.beam_pending.clear()
        seqs = {st.seq.request_id: st.seq for st in g.seqs.values()}
        if step.done:
            self.scheduler.finish_requests(list(seqs), RequestStatus.FINISHED_STOPPED)
            self.runner.release(list(seqs))
            best = g.beam.best(g.params.n, g.beam_live)
            g.beam_result = [self._beam_output(g, g.beam.eos_token_ids, i, h) for i, h in enumerate(best)]
            return
        used: set[str] = set()
        plan: list[tuple[Request, int, Beam]] = []
        old = {b.key: b for b in g.beam_live}
        for nxt in step.next_beams:
            parent_key, tok = nxt.parent_key, nxt.token
            parent = seqs[parent_key]
            if parent_key in used:
                g.fork_counter += 1
                seq = self.scheduler.fork(parent, f"{g.request_id}#b{g.fork_counter}", g.fork_counter)
            else:
                used.add(parent_key)
                seq = parent
            plan.append((seq, tok, Beam(seq.request_id, old[parent_key].tokens + [tok], nxt.score)))
        dropped = [k for k in seqs if k not in used]
        self.scheduler.finish_requests(dropped, RequestStatus.FINISHED_STOPPED)
        self.runner.release(dropped)
        g.seqs = {}
        for seq, tok, _ in plan:
            self.scheduler.append_token(seq, tok)
            g.add_seq(seq)
        g.beam_live = [b for _, _, b in plan]

    def _beam_output(self, g: RequestGroup, eos_token_ids: Collection[int], index: int,
                     hyp: Hypothesis) -> CompletionOutput:
        text = self.tokenizer.decode(hyp.tokens, skip_special_tokens=g.params.skip_special_tokens) \
            if self.tokenizer is not None else ""
        reason = "stop" if hyp.tokens and hyp.tokens[-1] in eos_token_ids else "length"
        return CompletionOutput(index=index, text=text, token_ids=list(hyp.tokens),
                                cumulative_logprob=hyp.cum_logprob, finish_reason=reason)

    def shutdown(self) -> None:
        """Abort what is left and stop the model's helpers (tensor-parallel workers)."""
        self.abort_request(list(self.groups))
        self.runner.shutdown()
        if self.timeline is not None:
            self.timeline.close()

    # --- stats ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = self.scheduler.stats()
        out["prompt_tokens"] = self.prompt_tokens
        out["generation_tokens"] = self.generation_tokens
        return out
