"""Running engine requests for HTTP handlers: admission bookkeeping, metrics, aborts.

A request whose consumer goes away (client disconnect, cancelled task) is aborted in
the engine at once, so its KV blocks are freed; the abort runs shielded because the
cancellation that triggered it would otherwise cancel the abort too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncGenerator, AsyncIterator, Sequence, TypeVar

import anyio
from starlette.requests import Request

from kvfleet.engine.llm_engine import EngineInputs
from kvfleet.engine.server.errors import APIError, value_error_param
from kvfleet.engine.server.limits import Ticket
from kvfleet.engine.server.state import ServerState, logger

T = TypeVar("T")

REQUEST_FIELDS = ("prompt", "prompt_token_ids", "messages", "n", "temperature", "top_p", "top_k", "min_p",
                  "max_tokens", "max_completion_tokens", "stop", "stop_token_ids", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "min_tokens",
                  "prompt_logprobs", "best_of")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def shutdown_error() -> APIError:
    return APIError(503, "The server shut down before this request finished (its --shutdown-grace-period ran "
                         "out); retry on another replica.", code="server_shutdown",
                    headers={"Retry-After": "1", "Connection": "close"})


def cut_short(out: Any) -> bool:
    """Did this output end (or go on) for another reason than the model finishing every choice?"""
    return not out.finished or any(o.finish_reason in (None, "abort") for o in out.outputs)


async def cut_off_requests(state: ServerState) -> int:
    """The grace period is over: end every running engine request now. Each one's next output (the
    abort's, for one still waiting) makes its handler answer 503 instead of a result."""
    state.cut_off = True
    ids = list(state.live_requests)
    engine = state.loaded_engine()
    results = await asyncio.gather(*(engine.abort(rid) for rid in ids), return_exceptions=True)
    for rid, result in zip(ids, results, strict=True):
        if isinstance(result, BaseException):
            logger.error("abort at the cut-off failed", extra={"request_id": rid, "error": repr(result)})
    return len(ids)


def finish_reason_of(out: Any) -> str:
    reasons = [o.finish_reason for o in out.outputs if o.finish_reason]
    return reasons[0] if reasons else "abort"


async def stream_request(state: ServerState, ticket: Ticket, inputs: EngineInputs, request_id: str,
                         tenant: str) -> AsyncGenerator[Any, None]:
    """`engine.generate` with bookkeeping: queue count until the first output, ITL, finish metrics."""
    engine = state.loaded_engine()
    # With tenant keys, each tenant's prompts hash into its own prefix-cache space: no tenant can
    # reuse (or time) another's cached blocks.
    salt = tenant if state.keys is not None else None
    finished, rejected = False, False
    last: Any = None
    prev_tokens, last_time = 0, None
    if state.cut_off:
        ticket.release()
        raise shutdown_error()
    state.live_requests.add(request_id)
    try:
        try:
            async for out in engine.generate(inputs, None, request_id, cache_salt=salt):
                if state.cut_off and cut_short(out):
                    raise shutdown_error()
                now = time.monotonic()
                ticket.started()
                tokens = max((len(o.token_ids) for o in out.outputs), default=0)
                if tokens > prev_tokens:
                    if last_time is not None:
                        state.metrics.observe_itl(now - last_time, tokens - prev_tokens)
                    prev_tokens, last_time = tokens, now
                last = out
                finished = bool(out.finished)
                yield out
        except ValueError as exc:
            if last is not None:
                raise
            rejected = True
            message = str(exc)
            param = value_error_param(message, REQUEST_FIELDS)
            raise APIError(400, message, "prompt" if param == "prompt_token_ids" else param, "invalid_value") from None
    finally:
        state.live_requests.discard(request_id)
        ticket.release()
        if not rejected:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await engine.abort(request_id)
            reason = finish_reason_of(last) if finished and last is not None else "abort"
            state.metrics.observe_finished(tenant, reason, last.metrics if last is not None else None)
            if state.log_requests:
                logger.info("request finished", extra={"request_id": request_id, "tenant": tenant,
                                                       "finish_reason": reason, "output_tokens": prev_tokens})


async def merge_streams(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as items arrive, tagged with the stream's index."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # closing it aborts the engine request now
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:  # their own finally blocks abort the engine requests
            task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def last_outputs(streams: Sequence[AsyncGenerator[Any, None]], request: Request) -> list[Any]:
    """The final output of each stream; raises ClientGone (after aborting) if the client leaves."""

    async def consume() -> list[Any]:
        finals: list[Any] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
        return finals

    work = asyncio.create_task(consume())
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work, return_exceptions=True)
        watcher.cancel()
    if work in done:
        return work.result()
    raise ClientGone()
