"""Continuous batching with a token budget (vLLM v1 style, no prefill/decode phases).

Each step: running sequences that decode get their one token first, then running
sequences still in prefill get chunks, then waiting requests (by priority, then
arrival) are admitted, all within `max_num_batched_tokens` and `max_num_seqs`.
A request is computed until its computed count catches up with its tokens; a
chunked prefill falls out of that. When blocks run out, the running sequence with
the lowest priority / latest arrival is preempted: its blocks are freed and it is
recomputed later (prefix caching usually makes that cheap). Nothing is lost.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request, RequestStatus
from kvfleet.engine.core.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int                 # tokens computed before this step (= position of the first new token)
    num_new_tokens: int
    block_ids: list[int]       # its block table (the live list: read it during this step)
    needs_sample: bool         # this step computes its last token: sample the next one
    # block_ids[:new_blocks_from] are as in its last scheduled step (0: treat all as new)
    new_blocks_from: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start:self.start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    copy_pairs: list[tuple[int, int]] = field(default_factory=list)   # CoW (src, dst), before the forward
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    request: Request
    new_token_id: Optional[int]
    finished: bool


def may_continue(req: Request, max_model_len: int) -> bool:
    """Async scheduling: may the sequence go on after the token just planned (not yet known)?
    No for beam search (the engine picks its tokens), a parent about to fork, and a sequence whose
    length limit (max_tokens, max_model_len) that token surely reaches; only stop ids can't be known."""
    if req.external_tokens or req.compute_limit is not None:
        return False
    ahead = req.num_placeholders + 1
    return len(req.output_token_ids) + ahead < req.max_tokens and req.num_tokens + ahead < max_model_len


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[Request] = []     # sorted by Request.sort_key()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Async scheduling: a sampled token still in flight counts as a placeholder, so the next
        # step can be planned before its id is known (kvfleet.engine.async_step).
        self.async_placeholders = False

    # --- queue management ----------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        # O(log n) key computations (not a key per waiting request per insert).
        self.waiting.insert(bisect.bisect(self.waiting, req.sort_key(), key=Request.sort_key), req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string): their blocks are freed at once."""
        assert status.is_finished
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def fork(self, parent: Request, child_id: str, index: int) -> Request:
        """A new sequence copying `parent`'s tokens. A running parent shares its blocks
        (copy-on-write later); a preempted one's child waits and recomputes."""
        assert not parent.is_finished and child_id not in self.requests
        child = parent.fork(child_id, index)
        self.requests[child_id] = child
        if parent.status == RequestStatus.RUNNING:
            self.kv.fork(parent, child)
            self.running.insert(self.running.index(parent) + 1, child)
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self._enqueue(child)
        return child

    # --- scheduling ----------------------------------------------------------------
    def _pick_victim(self) -> Request:
        return max(self.running, key=lambda r: r.sort_key())

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)
        logger.debug("preempted %s (%d tokens)", req.request_id, req.num_tokens)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        # Decodes first, then running prefills (chunks of long prompts); a stable partition.
        running = self.running
        order = [r for r in running if r.num_computed_tokens >= len(r.prompt_token_ids)]
        if len(order) < len(running):
            order += [r for r in running if r.num_computed_tokens < len(r.prompt_token_ids)]
        RUNNING = RequestStatus.RUNNING
        for req in order:
            if budget <= 0:
                break
            if req.status is not RUNNING:
                continue  # preempted earlier in this pass
            n = min(req.num_tokens_to_compute, budget)
            if n <= 0:
                continue
            if not self.enable_chunked_prefill and n < req.num_tokens_to_compute:
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self._pick_victim()
                self._preempt(victim)
                preempted.append(victim.request_id)
                budget += scheduled.pop(victim.request_id, 0)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = n
                budget -= n

        # Admit waiting requests only when nothing had to be preempted this step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            want = req.compute_target - req.num_computed_tokens - num_hit
            if want <= 0 and hits:
                # Everything up to a fork point is cached: compute its last block again so the
                # step has work for this sequence (and its last token's K/V is its own).
                hits, num_hit = hits[:-1], num_hit - self.kv.block_size
                want += self.kv.block_size
            n = min(want, budget)
            if not self.enable_chunked_prefill and n < want:
                break
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.pop(0)
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens += num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = n
            budget -= n

        out = SchedulerOutput(copy_pairs=self.kv.take_copies(), preempted_req_ids=preempted)
        tables, bs, add, changed = self.kv.block_tables, self.kv.block_size, out.scheduled.append, self.kv.take_changed
        for req in self.running:
            count = scheduled.get(req.request_id)
            if count is None:
                continue
            start = req.num_computed_tokens
            done = start + count
            req.num_computed_tokens = done
            table = tables[req.request_id]
            assert len(table) * bs >= done
            needs_sample = done == req.num_tokens + req.num_placeholders
            add(ScheduledRequest(req, start, count, table, needs_sample, changed(req)))
            if needs_sample and self.async_placeholders and may_continue(req, self.max_model_len):
                req.num_placeholders += 1
        assert out.num_batched_tokens <= self.max_num_batched_tokens
        return out

    # --- results -------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Append sampled tokens, apply token-based stops, free finished sequences."""
        updates: list[RequestUpdate] = []
        RUNNING = RequestStatus.RUNNING
        cache_full_blocks = self.kv.cache_full_blocks
        sampled = result.sampled_token_ids
        num_finished = 0
        for s in sched.scheduled:
            req = s.request
            if req.status is not RUNNING:
                # Aborted or preempted since. A sequence preempted while its token was in flight
                # (async scheduling) keeps that token: it was sampled from its full context.
                if not (s.needs_sample and req.status is RequestStatus.PREEMPTED and not req.external_tokens):
                    continue
            cache_full_blocks(req)
            if not s.needs_sample:
                if req.compute_limit is not None and req.num_tokens_to_compute == 0:
                    updates.append(RequestUpdate(req, None, False))   # ready to fork
                continue
            if req.external_tokens:
                updates.append(RequestUpdate(req, None, False))       # the engine picks (beam search)
                continue
            tok = sampled[req.request_id]
            if req.num_placeholders:
                req.num_placeholders -= 1
            req.append_output_token(tok)
            self._check_stop(req, tok)
            if req.grammar is not None and not req.is_finished:
                self._advance_grammar(req, tok)
            finished = req.is_finished
            if finished:
                if req.status is not RUNNING and req in self.waiting:   # (see preempted above)
                    self.waiting.remove(req)
                self._free(req)
                num_finished += 1
            updates.append(RequestUpdate(req, tok, finished))
        if num_finished:
            # One pass instead of a list.remove per finished request (many finish in one step).
            self.running[:] = [r for r in self.running if r.status is RUNNING]
        return updates

    def _check_stop(self, req: Request, tok: int) -> None:
        # Only ever moves a request to a finished state.
        num_out = len(req.output_token_ids)
        if tok in req.stop_token_ids and num_out >= req.min_tokens:
            # The token that stopped it, EOS included: the engine, which knows the EOS ids and
            # ignore_eos, reports None for EOS to users as vLLM does (llm_engine.public_stop_reason).
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        elif num_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH

    @staticmethod
    def _advance_grammar(req: Request, tok: int) -> None:
        """Structured outputs: the constraint takes the token; the sequence stops once its output is complete
        (EOS under `ignore_eos`, which the stop ids do not hold). A token the constraint refuses (every token was
        masked, e.g. min_tokens banning the EOS it alone allows) ends the sequence too, rather than run on
        unconstrained."""
        assert req.grammar is not None
        if not req.grammar.accept(tok):
            logger.warning("structured outputs: sampled token refused by the constraint; sequence stopped",
                           extra={"request_id": req.request_id, "token_id": tok})
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif req.grammar.is_terminated():
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None

    def append_token(self, req: Request, tok: int) -> bool:
        """For engine-picked tokens (beam search); True if the sequence finished."""
        req.append_output_token(tok)
        self._check_stop(req, tok)
        if req.is_finished:
            (self.running if req in self.running else self.waiting).remove(req)
            self._free(req)
        return req.is_finished

    def check_invariants(self) -> None:
        running, waiting = set(map(id, self.running)), set(map(id, self.waiting))
        assert not running & waiting, "a request both running and waiting"
        assert len(running) == len(self.running) and len(waiting) == len(self.waiting)
        for r in self.running:
            assert r.status == RequestStatus.RUNNING and self.requests.get(r.request_id) is r
            assert len(self.kv.get_block_ids(r)) * self.kv.block_size >= r.num_computed_tokens
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv.get_block_ids(r), "a waiting request holds blocks"
        keys = [r.sort_key() for r in self.waiting]
        assert keys == sorted(keys), "waiting queue out of order"
        assert set(self.kv.block_tables) <= {r.request_id for r in self.running}, "blocks held by no running request"
        self.kv.check_invariants()

    # --- stats ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        pool = self.kv.pool
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_blocks_cached": pool.num_cached_free_blocks,
            "kv_cache_usage": pool.num_used_blocks / pool.num_blocks,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
        }
