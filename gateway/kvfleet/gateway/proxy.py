"""Forwarding one request to a replica, and its answer back (I/O).

- Nothing goes to the client before the replica's first body byte, so a replica that fails before it
  (refused connection, died, 5xx, 503 while draining) is retried once on another; a draining one gets no
  new requests, one that does not answer is skipped for a few seconds.
- A stream passes through event by event as it arrives (`sse.StreamTap`; a Responses API stream's typed events
  through `sse.ResponsesTap`), never buffered whole.
- The client leaving cancels the handler: the upstream connection is closed, so the engine aborts the
  request and frees its KV blocks.
- A replica dying mid-stream ends the client's stream with an error event and `[DONE]` (a Responses stream: its
  `error` event, numbered after the last one, and no `[DONE]`, which that API does not have), not a hang; a
  replica silent for `read_timeout` counts as dead.
- The client's API key never goes upstream; an engine that wants its own key (`spec.apiKeySecretRef`) gets it
  (`engine_key_store`), the next one of the Secret if it refuses one. The answer says which replica served it
  (`X-Kvfleet-Replica`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
from aiohttp import web

from kvfleet.engine.server.error_shapes import error_body
from kvfleet.gateway.catalog import ModelRef
from kvfleet.gateway.dispatch import Dispatcher, Lease, NoReplica, Refused, RouteRequest
from kvfleet.gateway.engine_key_store import EngineKeyStore
from kvfleet.gateway.engine_keys import EngineKeyRef, EngineKeys
from kvfleet.gateway.load import LoadBoard
from kvfleet.gateway.metrics import GatewayMetrics, ModelSeries
from kvfleet.gateway.requests import ClientRequest
from kvfleet.gateway.snapshot import Snapshot
from kvfleet.gateway.sse import ResponsesTap, StreamTap, Tap, Usage, read_usage

log = logging.getLogger("kvfleet.gateway")

RETRY_STATUSES = (500, 502, 503, 504)
KEY_REFUSED = "upstream_key_refused"  # an engine's 401/403 to the key sent (or to none): try the next key
AUTH_CODES = (KEY_REFUSED, "upstream_auth_required", "upstream_auth_unavailable")
MAX_KEY_TRIES = 3  # keys tried on one replica for one request: old and new during a rotation, and one more
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
PASS_HEADERS = ("Content-Type", "Retry-After", "X-Request-Id")
REPLICA_HEADER = "X-Kvfleet-Replica"  # which replica answered (`namespace/pod`): the tenant's own pod, for debugging


@dataclass(frozen=True)
class ProxyConfig:
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # the longest a replica may stay silent (a non-streamed answer is one silence)
    retries: int = 1


def json_error(status: int, message: str, code: str, param: str | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    body = json.dumps(error_body(status, message, param, code), ensure_ascii=True, separators=(",", ":"))
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


@dataclass(frozen=True)
class _Failed:
    """A replica's failure before the first byte: what to answer if no retry succeeds."""

    status: int
    message: str
    code: str
    body: bytes | None = None
    headers: dict[str, str] | None = None


def _keys_refused(ref: EngineKeyRef) -> _Failed:
    return _Failed(502, f"This model's engines refused the gateway's keys ({ref.where}).", "upstream_auth_required")


def _no_key(keys: EngineKeys) -> _Failed:
    return _Failed(502, f"The gateway has no key for this model's engines: {keys.problem}.",
                   "upstream_auth_unavailable")


class Proxy:
    def __init__(self, dispatcher: Dispatcher, board: LoadBoard, metrics: GatewayMetrics, cfg: ProxyConfig,
                 allow_host: Callable[[str], bool], engine_keys: EngineKeyStore) -> None:
        self.dispatcher = dispatcher
        self.engine_keys = engine_keys
        self.board = board
        self.metrics = metrics
        self.cfg = cfg
        self.allow_host = allow_host
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # no pool limit (the dispatch step is where admission belongs); trust_env off: never an env proxy
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout,
                                        sock_read=self.cfg.read_timeout)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",), trust_env=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def forward(self, request: web.Request, snapshot: Snapshot, tenant: str, model: ModelRef,
                      req: ClientRequest, body: bytes, hashes: tuple[int, ...], cost: float = 0.0
                      ) -> web.StreamResponse:
        series = self.metrics.series(tenant, model.namespace, model.served_name)
        try:
            admission = self.dispatcher.admit(snapshot, tenant)
        except Refused as exc:
            return self._refused_here(series, exc, "rate_limited")
        usage = _UsageBox()
        try:
            return await self._forward(request, snapshot, tenant, model, req, body, hashes, cost, series, usage)
        finally:
            admission.finish(usage.total)

    async def _forward(self, request: web.Request, snapshot: Snapshot, tenant: str, model: ModelRef,
                       req: ClientRequest, body: bytes, hashes: tuple[int, ...], cost: float, series: ModelSeries,
                       usage: "_UsageBox") -> web.StreamResponse:
        tried: set[str] = set()
        failed: _Failed | None = None
        ref = model.engine_key
        if ref is not None:  # no key at all for engines that want one: said before a replica is taken, or woken
            keys = await self.engine_keys.keys(ref)
            if not self.engine_keys.has_candidates(ref, keys):
                return self._failed_here(series, _no_key(keys))
        for attempt in range(1 + self.cfg.retries):
            try:
                lease = await self.dispatcher.acquire(snapshot, RouteRequest(tenant, model, hashes, frozenset(tried),
                                                                             cost))
            except NoReplica as exc:
                if failed is None:
                    series.failed("no_replica")
                    series.answered(503)
                    return json_error(503, str(exc), "no_replica", "model", {"Retry-After": "5"})
                break
            except Refused as exc:
                return self._refused_here(series, exc, exc.code)
            if attempt:
                series.retried(failed.code if failed else "")
            series.routed(lease.choice.rule)
            series.inflight.inc()
            usage.value = None
            try:
                outcome = await self._attempt_with_key(request, lease, req, body, series, usage, ref)
            finally:
                series.inflight.dec()
                lease.release(usage.value)
            if isinstance(outcome, _Failed) and outcome.code in AUTH_CODES:
                failed = outcome  # the model's keys, not this replica: another one would answer the same
                break
            if isinstance(outcome, _Failed):
                tried.add(lease.replica.name)
                failed = outcome
                continue
            return outcome
        assert failed is not None
        return self._failed_here(series, failed)

    async def _attempt_with_key(self, request: web.Request, lease: Lease, req: ClientRequest, body: bytes,
                                series: ModelSeries, usage: "_UsageBox",
                                ref: EngineKeyRef | None) -> web.StreamResponse | _Failed:
        """One replica, sent the model's engine key if its engines want one; on a 401 the next key (a rotated
        Secret: the engine may take the old key still, or already only the new one)."""
        if ref is None:
            return await self._attempt(request, lease, req, body, series, usage, None)
        replica = lease.replica.name
        refused: set[str] = set()
        while len(refused) < MAX_KEY_TRIES:
            keys = await self.engine_keys.keys(ref)
            order = self.engine_keys.order(ref, keys, replica, frozenset(refused))
            if not order:
                return _no_key(keys) if not refused and not keys.keys else _keys_refused(ref)
            outcome = await self._attempt(request, lease, req, body, series, usage, order[0])
            if not isinstance(outcome, _Failed):
                self.engine_keys.worked(ref, replica, order[0])
            if not isinstance(outcome, _Failed) or outcome.code != KEY_REFUSED:
                return outcome
            self.engine_keys.refused(ref, replica, order[0])
            refused.add(order[0])
            series.retried(KEY_REFUSED)
        return _keys_refused(ref)

    @staticmethod
    def _failed_here(series: ModelSeries, failed: _Failed) -> web.Response:
        series.answered(failed.status)
        if failed.code == KEY_REFUSED:  # refused without a key of ours to try: the gateway's setup, not the client
            series.failed("upstream_auth")
            return json_error(502, failed.message, "upstream_auth_required")
        if failed.code in AUTH_CODES:
            series.failed("upstream_auth")
            return json_error(failed.status, failed.message, failed.code)
        series.failed("upstream_unavailable" if failed.body is None else "upstream_error")
        if failed.body is not None:
            return web.Response(status=failed.status, body=failed.body, headers=failed.headers)
        return json_error(failed.status, failed.message, failed.code)

    @staticmethod
    def _refused_here(series: ModelSeries, exc: Refused, reason: str) -> web.Response:
        """A limit, a full queue, quota or a timeout: the gateway's own answer, with Retry-After."""
        series.failed(reason)
        series.answered(exc.status)
        return json_error(exc.status, exc.message, exc.code, None, {"Retry-After": str(max(1, exc.retry_after))})

    async def _attempt(self, request: web.Request, lease: Lease, req: ClientRequest, body: bytes,
                       series: ModelSeries, usage: "_UsageBox", key: str | None) -> web.StreamResponse | _Failed:
        replica = lease.replica
        assert self.session is not None
        if not self.allow_host(replica.host):  # the dispatcher filters these; never send one anyway
            return _Failed(502, "replica address not allowed", "upstream_unavailable")
        headers = {"Content-Type": "application/json"}
        if "X-Request-Id" in request.headers:
            headers["X-Request-Id"] = request.headers["X-Request-Id"]
        if key is not None:  # the engine's own key (spec.apiKeySecretRef), never the client's
            headers["Authorization"] = f"Bearer {key}"
        start = time.perf_counter()
        resp: aiohttp.ClientResponse | None = None
        try:
            try:  # up to the first byte: a failure here is the replica's, and may be retried elsewhere
                resp = await self.session.post(replica.url + req.path, data=body, headers=headers)
                if resp.status in RETRY_STATUSES:
                    return await self._refused(replica.name, resp)
                if resp.status in (401, 403):  # the engine wants its own key, or another one: not the client's fault
                    await resp.read()
                    return _Failed(502, f"The replica {replica.name} refused the gateway: it wants an API key, and "
                                        "none is set for its model (spec.apiKeySecretRef; apiKey in a static "
                                        "config).", KEY_REFUSED)
                streaming = req.stream and resp.status == 200
                data = await (resp.content.readany() if streaming else resp.read())
                if streaming and not data:
                    raise aiohttp.ServerDisconnectedError("closed before the first byte")
            except asyncio.CancelledError:  # the client left while the replica worked: closing aborts it there
                series.failed("client_disconnected")
                raise
            except UPSTREAM_ERRORS as exc:
                self.board.eject(replica.name)
                log.warning("replica failed before the first byte",
                            extra={"replica": replica.name, "error": exc.__class__.__name__})
                return _Failed(502, f"The replica {replica.name} did not answer ({exc.__class__.__name__}).",
                               "upstream_unavailable")
            series.first_byte.observe(time.perf_counter() - start)
            if streaming:
                out: web.StreamResponse = await self._stream(request, resp, data, req, replica.name, series, usage)
            else:
                out = self._reply(resp, data, replica.name, series, usage)
            series.upstream_latency.observe(time.perf_counter() - start)
            return out
        finally:
            if resp is not None:
                resp.close()  # a finished body leaves the connection in the pool; anything else closes it

    async def _refused(self, name: str, resp: aiohttp.ClientResponse) -> _Failed:
        data = await resp.read()
        code = ""
        try:
            code = str((json.loads(data).get("error") or {}).get("code") or "")
        except (ValueError, AttributeError):
            pass
        if resp.status == 503 and code == "draining":
            self.board.mark_draining(name)
        else:
            self.board.eject(name)
        headers = {k: resp.headers[k] for k in PASS_HEADERS if k in resp.headers}
        return _Failed(resp.status, f"replica {name} answered {resp.status}", code or "upstream_error", data, headers)

    def _reply(self, resp: aiohttp.ClientResponse, data: bytes, replica: str, series: ModelSeries,
               box: "_UsageBox") -> web.Response:
        headers = {k: resp.headers[k] for k in PASS_HEADERS if k in resp.headers}
        headers[REPLICA_HEADER] = replica
        status = resp.status
        series.answered(status)
        box.value = Usage()
        if status == 200:
            usage = body_usage(data)
            if usage is not None:
                series.usage(usage.prompt_tokens, usage.completion_tokens)
                box.value = usage
        else:
            series.failed("invalid_request" if status == 400 else "upstream_error")
        return web.Response(status=status, body=data, headers=headers)

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse, first: bytes, req: ClientRequest,
                      replica: str, series: ModelSeries, box: "_UsageBox") -> web.StreamResponse:
        tap = stream_tap(req)
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                      "X-Accel-Buffering": "no", REPLICA_HEADER: replica})
        series.answered(200)
        outcome = "client_disconnected"  # until the loop ends by itself: a client gone raises out of `write`
        try:
            await out.prepare(request)
            data = first
            while data:
                piece = tap.feed(data)
                if piece:
                    await out.write(piece)
                try:
                    data = await resp.content.readany()
                except UPSTREAM_ERRORS:
                    break
            outcome = "ok" if tap.done else "upstream_disconnected"
            if outcome != "ok":  # died, or closed before its end: say so in-band, then end the stream
                self.board.eject(replica)
                log.warning("replica failed mid-stream", extra={"replica": replica})
                rest = tap.flush()
                await out.write((rest + b"\n\n" if rest.strip() else b"") + tap.failure(
                    "The replica serving this stream failed before it ended; the answer is incomplete.",
                    "upstream_disconnected"))
            await out.write_eof()
        finally:
            if outcome == "client_disconnected" and tap.done:
                outcome = "ok"  # it left after the stream's end (clients close at once): the answer was whole
            if outcome != "ok":
                series.failed(outcome)
            elif tap.error is not None:
                series.failed("stream_error")
            usage = tap.final_usage()
            series.usage(usage.prompt_tokens, usage.completion_tokens)
            box.value = usage
        return out


class _UsageBox:
    """The usage of the attempt that answered (None until one did): for the lease, and the tenant's tokens."""

    def __init__(self) -> None:
        self.value: Usage | None = None

    @property
    def total(self) -> int:
        return self.value.prompt_tokens + self.value.completion_tokens if self.value is not None else 0


def stream_tap(req: ClientRequest) -> Tap:
    """The tap for a request's stream: a Responses stream keeps every event (its usage is part of the API)."""
    return ResponsesTap() if req.responses is not None else StreamTap(strip_usage=not req.wants_usage)


def body_usage(data: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) answer: a completion's, a chat completion's or a response's."""
    try:
        usage: Any = json.loads(data).get("usage")
    except (ValueError, AttributeError):
        return None
    return read_usage(usage)
