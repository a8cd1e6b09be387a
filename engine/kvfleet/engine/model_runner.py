"""The only part of the engine that touches the device.

From a `SchedulerOutput` it builds the flat step tensors (token ids, positions, slot
mapping, block tables, query_start_loc, seq_lens), does the copy-on-write block
copies, runs the model, and samples every sequence that finished its tokens in one
batched pass. It also sizes the KV cache (GPU: from `gpu_memory_utilization` after
profiling a forward at the full token budget; CPU: `num_kv_blocks` or a byte budget).

The model itself is behind one seam, `self.executor` (`kvfleet.engine.model_executor.ModelExecutor`:
forward, logits, block copies, decode CUDA graphs, shutdown, KV heads per rank), the same calls
whether the model runs in this process or tensor parallel over several.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from kvfleet.engine.async_step import InFlight, copy_to_host_async
from kvfleet.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from kvfleet.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from kvfleet.engine.core.grammar import TokenGrammar
from kvfleet.engine.core.request import Request
from kvfleet.engine.core.runner_output import ModelRunnerOutput, PromptLogprob, SampleLogprobs
from kvfleet.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from kvfleet.engine.cuda_graphs import mixed_graph_limit
from kvfleet.engine.kv_cache import allocate_kv_cache
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.model_executor import ModelExecutor, build_executor
from kvfleet.engine.penalty_tokens import TokenHistory, padded_rows
from kvfleet.engine.sampler import (
    AllowedTokens,
    LogitBias,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    gather_logprobs,
)
from kvfleet.engine.step_inputs import BlockTableRows, StepInputs, build_step_inputs

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A step's inputs on the device, built before it is launched."""

    inputs: StepInputs
    md: AttentionMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor


def host_tensor(values: list, dtype: type, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """`torch.tensor(values, dtype=..., device=device)` for a flat list, through numpy: 3-4x less
    host time (0.41 -> 0.11 ms for 8192 ints on CPU)."""
    return to_device(torch.from_numpy(np.fromiter(values, dtype=dtype, count=len(values))), device, non_blocking)


def to_device(t: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """A host tensor on `device`. A plain copy from pageable memory synchronizes the CUDA stream,
    i.e. waits for every kernel queued before it; with `non_blocking` (async scheduling, which
    queues step N+1's inputs while step N runs) it goes through pinned memory and does not wait."""
    if device.type == "cpu":
        return t
    if non_blocking:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class SamplingRow(NamedTuple):
    """A sequence's sampling parameters as the batch needs them (fixed for its lifetime, so built once
    per sequence). A tuple: a step's rows transpose into per-parameter columns with one zip."""

    temperature: float          # 0 = greedy (beam search: the engine picks from the logprobs)
    top_k: int                  # the vocabulary size = off
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seeded: bool                # random sampling from the sequence's own generator
    bias_ids: tuple[int, ...]   # logit_bias: its token ids, and what each adds to its logit
    bias_values: tuple[float, ...]


class _PromptRow(NamedTuple):
    """A prompt token whose logprobs are asked for: where its prediction is in the step's hidden rows."""

    request_id: str
    position: int               # of the predicted token in the prompt
    row: int                    # hidden row that predicts it
    token_id: int


@dataclass
class Forwarded:
    """A step whose forward is queued on the device and whose rows are not sampled yet (`forward_step`)."""

    reqs: list[ScheduledRequest]   # the sequences to sample, in the logits' first rows
    logits: Optional[torch.Tensor]   # [len(reqs) + len(plp_rows), vocab]; None when the step samples nothing
    plp_rows: list[_PromptRow]   # prompt tokens whose logprobs are asked for, in the rows after
    plp_k: int


def sampling_row(r: Request, vocab: int) -> SamplingRow:
    p = r.sampling_params
    temp = 0.0 if r.external_tokens else float(p.temperature)
    k = p.top_k
    bias = p.logit_bias
    return SamplingRow(temp, vocab if k in (-1, None) else min(int(k), vocab), float(p.top_p), float(p.min_p),
                       float(p.repetition_penalty), float(p.frequency_penalty), float(p.presence_penalty),
                       r.seed is not None and temp >= 1e-5,
                       tuple(bias) if bias else (), tuple(float(v) for v in bias.values()) if bias else ())


def logit_bias(rows: list[SamplingRow], biased: list[int], dev: torch.device,
               non_blocking: bool) -> Optional[LogitBias]:
    """The logit_bias entries of the batch's `biased` rows as flat tensors; None when there are none (most steps)."""
    if not biased:
        return None
    at = [i for i in biased for _ in rows[i].bias_ids]
    ids = [t for i in biased for t in rows[i].bias_ids]
    values = [v for i in biased for v in rows[i].bias_values]
    return LogitBias(host_tensor(at, np.int64, dev, non_blocking), host_tensor(ids, np.int64, dev, non_blocking),
                     host_tensor(values, np.float32, dev, non_blocking))


def allowed_tokens(constrained: list[tuple[int, TokenGrammar]], dev: torch.device,
                   non_blocking: bool) -> Optional[AllowedTokens]:
    """Structured outputs: the allowed next tokens of each constrained (row, constraint), asked of the constraint now
    (host work); None when no row is constrained (most steps)."""
    if not constrained:
        return None
    bitmask = np.full((len(constrained), max(g.bitmask_words() for _, g in constrained)), -1, dtype=np.int32)
    # One row at a time: 2-3 µs a row for a JSON schema over a 49k vocabulary; llguidance's thread pool was slower
    # up to 64 rows and 1.5x faster at 256 on two idle cores, 100x slower on busy ones (bench/structured_masks.py).
    for j, (_, grammar) in enumerate(constrained):
        grammar.fill_bitmask(bitmask, j)
    return AllowedTokens(host_tensor([row for row, _ in constrained], np.int64, dev, non_blocking),
                         to_device(torch.from_numpy(bitmask), dev, non_blocking))


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: Optional[int] = None) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    heads = num_kv_heads if num_kv_heads is not None else cfg.num_kv_heads
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 device: torch.device, max_num_batched_tokens: int) -> None:
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = device
        self.dtype = model_config.dtype
        self.block_size = engine_config.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.executor: ModelExecutor = build_executor(model_config, engine_config, device)
        self.num_kv_heads = self.executor.num_kv_heads   # this rank's
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self._generators: dict[str, torch.Generator] = {}
        self._param_rows: dict[str, SamplingRow] = {}
        self._token_histories: dict[str, TokenHistory] = {}   # penalized sequences' ids (penalty_tokens)
        # Persistent block tables, one row per sequence (rows are added as sequences appear).
        # Async scheduling on CUDA: host-to-device copies must not wait for the step in flight.
        self.non_blocking = bool(engine_config.async_scheduling) and device.type == "cuda"
        self.num_placeholder_inputs = 0   # decode inputs taken on the device (async scheduling)
        self.eager_forward = False   # run every step's forward eagerly (the warm-up's pass for the eager kernels)
        self._block_rows = BlockTableRows(math.ceil((model_config.max_model_len + 1) / self.block_size) + 1)

    # --- KV cache ------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        cfg, ec = self.model_config, self.engine_config
        per_block = kv_block_bytes(cfg, self.block_size, self.dtype, self.num_kv_heads)
        if ec.num_kv_blocks is not None:
            return int(ec.num_kv_blocks)
        if ec.kv_cache_memory_bytes is not None:
            return max(1, int(ec.kv_cache_memory_bytes) // per_block)
        # Never more than every sequence at full length needs (a tiny model on a big GPU
        # would otherwise get millions of blocks, and the block pool's lists with them).
        cap = ec.max_num_seqs * math.ceil(cfg.max_model_len / self.block_size)
        if self.device.type != "cuda":
            return max(1, min(DEFAULT_CPU_KV_CACHE_BYTES // per_block, cap))
        return min(self._profile_cuda_blocks(per_block), cap)

    def _profile_cuda_blocks(self, per_block: int) -> int:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        # A forward at the full token budget, as sequences of at most max_model_len tokens.
        tokens = self.max_num_batched_tokens
        seq_len = min(tokens, self.model_config.max_model_len)
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        nblk = sum(math.ceil(n / self.block_size) for n in lens)
        self._allocate_kv(nblk)
        tables, nxt = [], 0
        for n in lens:
            k = math.ceil(n / self.block_size)
            tables.append(list(range(nxt, nxt + k)))
            nxt += k
        md = build_attention_metadata(lens, lens, tables, self.block_size, self.device)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        last_rows = [end - 1 for end in md.query_start_loc_cpu[1:]]   # every sequence's last token
        with torch.inference_mode():
            hidden = self.executor.forward(ids, pos, self.kv_caches, md, last_rows)
            self.executor.compute_logits(hidden[md.query_start_loc[1:] - 1])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        del hidden
        self.executor.free_cache()   # tensor-parallel workers drop their profiling cache too
        torch.cuda.empty_cache()
        budget = total * self.engine_config.gpu_memory_utilization - peak - non_torch
        num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ValueError(
                f"gpu_memory_utilization: {self.engine_config.gpu_memory_utilization} leaves no memory for the KV "
                f"cache (model and activations peak at {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB)")
        logger.info("profiled forward of %d tokens: peak %.2f GiB (weights %.2f GiB)",
                    tokens, peak / 2**30, baseline / 2**30)
        return num_blocks

    def _allocate_kv(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = allocate_kv_cache(cfg.num_layers, shape, self.dtype, self.device)

    def init_kv_cache(self, num_blocks: int) -> None:
        self._allocate_kv(num_blocks)
        gib = num_blocks * kv_block_bytes(self.model_config, self.block_size, self.dtype, self.num_kv_heads) / 2**30
        concurrency = num_blocks * self.block_size / self.model_config.max_model_len
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB); max concurrency %.2fx at max_model_len=%d",
                    num_blocks, self.block_size, gib, concurrency, self.model_config.max_model_len)
        if self.device.type == "cuda" and not self.engine_config.enforce_eager:
            # decode CUDA graphs over these KV tensors (kvfleet.engine.cuda_graphs); under tensor
            # parallelism every rank captures its own
            self.executor.capture_graphs(self.kv_caches, self.engine_config.max_num_seqs,
                                         self.model_config.max_model_len, self.block_size,
                                         min(mixed_graph_limit(), self.max_num_batched_tokens))

    # --- one step ------------------------------------------------------------------
    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._param_rows.pop(rid, None)
            self._token_histories.pop(rid, None)
            self._block_rows.release(rid)

    def shutdown(self) -> None:
        self.executor.shutdown()

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step, waiting for its results (the synchronous engine)."""
        return self.collect(self.launch(sched))

    def collect(self, step: InFlight) -> ModelRunnerOutput:
        """Wait for a launched step's sampled tokens and return its output."""
        step.wait()
        if step.res is not None:
            self._collect(step.reqs, step.res, step.out)
        return step.out

    @torch.inference_mode()
    def prepare(self, sched: SchedulerOutput, prev: Optional[InFlight] = None) -> Optional[Prepared]:
        """A step's input tensors. Decodes whose token is still being sampled by the launched step
        `prev` (async scheduling) take it from `prev`'s sampled ids on the device: no host wait."""
        scheduled = sched.scheduled
        if not scheduled:
            return None
        dev, nb = self.device, self.non_blocking
        inp = build_step_inputs(scheduled, self.block_size, self._block_rows)
        qsl = inp.query_start_loc
        md = AttentionMetadata(
            slot_mapping=host_tensor(inp.slot_mapping, np.int64, dev, nb),
            query_start_loc=host_tensor(qsl, np.int32, dev, nb),
            seq_lens=host_tensor(inp.seq_lens, np.int32, dev, nb),
            block_tables=to_device(torch.from_numpy(inp.block_tables), dev, nb),
            max_query_len=inp.max_query_len, max_seq_len=max(inp.seq_lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=inp.seq_lens, block_tables_cpu=inp.block_tables)
        input_ids = host_tensor(inp.input_ids, np.int64, dev, nb)
        if inp.placeholder_at:
            if prev is None or prev.sampled_on_device is None:
                raise RuntimeError("a step has placeholder tokens but no launched step samples them")
            row_of = prev.row_of()
            at = host_tensor(inp.placeholder_at, np.int64, dev, nb)
            src = host_tensor([row_of[rid] for rid in inp.placeholder_ids], np.int64, dev, nb)
            input_ids.index_copy_(0, at, prev.sampled_on_device.index_select(0, src))
            self.num_placeholder_inputs += len(inp.placeholder_at)
        return Prepared(inp, md, input_ids, host_tensor(inp.positions, np.int64, dev, nb))

    @staticmethod
    def needs_token_values(sched: SchedulerOutput) -> bool:
        """Whether launching `sched` needs the sampled values of the step still in flight, so that it cannot
        be launched ahead of them (kvfleet.engine.async_step): a constraint whose mask follows the output
        (structured outputs, a reasoning gate, multi-token bad_words) needs the token it has not taken yet, and a
        prompt's logprobs are read back at launch (the launch would wait for the step it queued).
        allowed_token_ids and one-token bad_words mask the same tokens at every step, and penalties count the
        token in flight from the device (`_sampling_batch`): launched ahead."""
        for s in sched.scheduled:
            p = s.request.sampling_params
            if p is None:
                continue
            if p.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens - 1:
                return True
            grammar = s.request.grammar
            if s.needs_sample and grammar is not None and grammar.needs_last_token():
                return True   # (a constraint's next mask needs the token it has not taken yet)
        return False

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, async_copy: bool = False,
               prepared: Optional[Prepared] = None, ahead_of: Optional[InFlight] = None) -> InFlight:
        """Run the forward and the sampler (inputs from `prepare` unless given); with `async_copy`
        the sampled values are copied to the host without waiting (CUDA; `collect` waits). Prompt
        logprobs are collected at once. Sequences finished since `prepare` are computed (the
        forward's shapes are fixed by then) but not sampled: their work is discarded.

        `ahead_of`: the launched step whose tokens are not collected yet (launching ahead, which
        `needs_token_values` allows): each of its sequences counts one output token more than it holds
        (min_tokens), and one that its tokens will end is sampled too (the scheduler drops that token)."""
        return self.sample_step(self.forward_step(sched, prepared), async_copy, ahead_of)

    @torch.inference_mode()
    def forward_step(self, sched: SchedulerOutput, prepared: Optional[Prepared] = None) -> Forwarded:
        """The first half of `launch`: block copies, the forward and the logits of the rows to sample, queued on
        the device; `sample_step` samples them. Between the two the scheduler may take the tokens of the step
        before (async scheduling: the forward runs behind that step while its tokens are read and taken)."""
        if sched.copy_pairs:
            self.executor.copy_blocks(self.kv_caches, sched.copy_pairs)
        scheduled = sched.scheduled
        if prepared is None:
            prepared = self.prepare(sched)
        if prepared is None:
            return Forwarded([], None, [], 0)
        qsl, md = prepared.inputs.query_start_loc, prepared.md
        live = [i for i, s in enumerate(scheduled) if s.needs_sample and not s.request.is_finished]
        reqs = [scheduled[i] for i in live]
        idx = [qsl[i + 1] - 1 for i in live]
        plp_rows, plp_k = self._prompt_logprob_rows(scheduled, qsl)
        if plp_rows:
            idx += [r.row for r in plp_rows]
        hidden = self.executor.forward(prepared.input_ids, prepared.positions, self.kv_caches, md, idx,
                                       eager=self.eager_forward)
        if not idx:
            return Forwarded([], None, [], 0)
        logits = self.executor.compute_logits(hidden[host_tensor(idx, np.int64, self.device, self.non_blocking)])
        return Forwarded(reqs, logits, plp_rows, plp_k)

    @torch.inference_mode()
    def sample_step(self, fwd: Forwarded, async_copy: bool = False,
                    ahead_of: Optional[InFlight] = None) -> InFlight:
        """The second half of `launch`: sample the rows of `forward_step` (`ahead_of`, `async_copy`: as `launch`).
        A row whose sequence finished after its forward (the tokens of the step before ended it) is not sampled:
        the sequence is done, its grammar may have ended, and its token would be dropped."""
        out = ModelRunnerOutput()
        if fwd.logits is None:
            return InFlight([], None, out)
        reqs, logits = fwd.reqs, fwd.logits
        keep = [i for i, s in enumerate(reqs) if not s.request.is_finished]
        if len(keep) < len(reqs):
            rows = keep + list(range(len(reqs), logits.shape[0]))   # (prompt logprob rows after the sampled ones)
            logits = logits[host_tensor(rows, np.int64, self.device, self.non_blocking)]
            reqs = [reqs[i] for i in keep]
        step = InFlight(reqs, None, out)
        if reqs:
            batch = self._sampling_batch(reqs, logits.shape[-1], ahead_of)
            step.res = self.sampler(logits[:len(reqs)], batch)
            step.sampled_on_device = step.res.sampled
            if async_copy:
                step.res, step.event = copy_to_host_async(step.res)
        if fwd.plp_rows:
            self._collect_prompt_logprobs(fwd.plp_rows, logits[len(reqs):], fwd.plp_k, out)
        return step

    # --- sampling inputs / outputs -------------------------------------------------
    def _sampling_batch(self, reqs: list[ScheduledRequest], vocab: int,
                        ahead_of: Optional[InFlight] = None) -> SamplingBatch:
        """The batch's sampling parameters as tensors (each sequence's row is read once, then cached).
        `ahead_of`: the step whose tokens are not appended yet; each of its sequences counts one token more toward
        min_tokens, and its token joins the penalties' output ids on the device."""
        dev, nb = self.device, self.non_blocking
        cache = self._param_rows
        rows: list[SamplingRow] = []
        gens: dict[int, torch.Generator] = {}
        banned: list[tuple[int, frozenset[int]]] = []
        biased: list[int] = []   # rows with a logit_bias
        constrained: list[tuple[int, TokenGrammar]] = []   # rows with structured outputs
        pending: Optional[dict[str, int]] = None
        max_logprobs = -1
        for i, s in enumerate(reqs):
            r = s.request
            row = cache.get(r.request_id)
            if row is None:
                row = cache[r.request_id] = sampling_row(r, vocab)
            rows.append(row)
            if row.bias_ids:
                biased.append(i)
            if r.grammar is not None:
                constrained.append((i, r.grammar))
            if row.seeded and r.seed is not None:   # seeded: r.seed is set
                gen = self._generators.get(r.request_id)
                if gen is None:
                    gen = torch.Generator(device=dev).manual_seed(int(r.seed))
                    self._generators[r.request_id] = gen
                gens[i] = gen
            if r.min_tokens and r.stop_token_ids:
                if pending is None:   # built only when a sequence in the batch has min_tokens
                    pending = ahead_of.row_of() if ahead_of is not None else {}
                if len(r.output_token_ids) + (r.request_id in pending) < r.min_tokens:
                    banned.append((i, r.stop_token_ids))
            if r.num_logprobs > max_logprobs:
                max_logprobs = r.num_logprobs
        temps, top_k, top_p, min_p, rep, freq, pres, *_ = (list(c) for c in zip(*rows, strict=True))

        def opt(values: list[float], neutral: float) -> Optional[torch.Tensor]:
            if values.count(neutral) == len(values):
                return None
            return host_tensor(values, np.float32, dev, nb)

        reps, freqs, press = opt(rep, 1.0), opt(freq, 0.0), opt(pres, 0.0)
        histories: list[TokenHistory] = []
        if reps is not None or freqs is not None or press is not None:
            for s in reqs:
                history = self._token_histories.get(s.request_id)
                if history is None:
                    history = self._token_histories[s.request_id] = TokenHistory(s.request.prompt_token_ids)
                histories.append(history)

        def padded(arrays: list[np.ndarray]) -> torch.Tensor:
            return to_device(torch.from_numpy(padded_rows(arrays, vocab)), dev, nb)

        def outputs_so_far() -> torch.Tensor:
            """Each penalized sequence's output ids; launched ahead, with the token it has in flight (the step
            before's sample, still on the device) after them, where the sampler counts it as appended."""
            outs = [h.outputs(s.request.output_token_ids) for h, s in zip(histories, reqs, strict=True)]
            sampled = ahead_of.sampled_on_device if ahead_of is not None else None
            if ahead_of is None or sampled is None:
                return to_device(torch.from_numpy(padded_rows(outs, vocab)), dev, nb)
            in_flight = pending if pending is not None else ahead_of.row_of()   # (min_tokens may have it)
            flying = [i for i, s in enumerate(reqs) if s.request_id in in_flight]
            tokens = to_device(torch.from_numpy(padded_rows(outs, vocab, spare=1 if flying else 0)), dev, nb)
            if flying:
                at_rows = host_tensor(flying, np.int64, dev, nb)
                at_cols = host_tensor([len(outs[i]) for i in flying], np.int64, dev, nb)
                src = host_tensor([in_flight[reqs[i].request_id] for i in flying], np.int64, dev, nb)
                tokens[at_rows, at_cols] = sampled[src]
            return tokens
        min_mask = None
        if banned:
            min_mask = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=dev)
            for i, toks in banned:
                min_mask[i, [t for t in toks if t < vocab]] = True
        return SamplingBatch(
            temperature=host_tensor(temps, np.float32, dev, nb),
            top_k=None if top_k.count(vocab) == len(top_k) else host_tensor(top_k, np.int64, dev, nb),
            top_p=opt(top_p, 1.0),
            min_p=opt(min_p, 0.0),
            presence_penalty=press, frequency_penalty=freqs, repetition_penalty=reps,
            prompt_tokens=padded([h.prompt for h in histories]) if reps is not None else None,
            output_tokens=outputs_so_far() if histories else None,
            min_tokens_mask=min_mask, logit_bias=logit_bias(rows, biased, dev, nb),
            allowed=allowed_tokens(constrained, dev, nb), generators=gens,
            max_num_logprobs=max_logprobs,
            all_greedy=all(t < 1e-5 for t in temps),
        )

    @staticmethod
    def _collect(reqs: list[ScheduledRequest], res: SamplerOutput, out: ModelRunnerOutput) -> None:
        sampled = res.sampled.tolist()
        for row, s in enumerate(reqs):
            out.sampled_token_ids[s.request_id] = sampled[row]
        if res.logprobs is None:
            return
        lps, ranks = res.logprobs.logprob.tolist(), res.logprobs.rank.tolist()
        top_ids, top_lps = res.logprobs.top_ids.tolist(), res.logprobs.top_logprobs.tolist()
        for row, s in enumerate(reqs):
            k = s.request.num_logprobs
            if k >= 0:
                out.logprobs[s.request_id] = SampleLogprobs(lps[row], ranks[row], top_ids[row][:k], top_lps[row][:k])

    @staticmethod
    def _prompt_logprob_rows(scheduled: list[ScheduledRequest], qsl: list[int]) -> tuple[list[_PromptRow], int]:
        """Every prompt token of the step whose logprobs are asked for, and the widest top-k asked."""
        rows = []
        k = 0
        for i, s in enumerate(scheduled):
            req = s.request
            sp = req.sampling_params
            if sp is None or sp.prompt_logprobs is None:
                continue
            k = max(k, sp.prompt_logprobs)
            for p in range(s.start, min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)):
                rows.append(_PromptRow(s.request_id, p + 1, qsl[i] + (p - s.start), req.prompt_token_ids[p + 1]))
        return rows, k

    @staticmethod
    def _collect_prompt_logprobs(rows: list[_PromptRow], logits: torch.Tensor, k: int,
                                 out: ModelRunnerOutput) -> None:
        targets = torch.tensor([r.token_id for r in rows], device=logits.device)
        k = min(k, logits.shape[-1])
        lp = gather_logprobs(logits.float().log_softmax(-1), targets, k)
        chosen, rank, top_ids, top_lps = (lp.logprob.tolist(), lp.rank.tolist(), lp.top_ids.tolist(),
                                          lp.top_logprobs.tolist())
        for j, r in enumerate(rows):
            out.prompt_logprobs.setdefault(r.request_id, []).append(
                PromptLogprob(r.position, r.token_id, chosen[j], rank[j], top_ids[j], top_lps[j]))
