"""The gateway's HTTP API (aiohttp): OpenAI's routes, each request checked in the engine's order.

1. `Authorization: Bearer KEY` -> tenant, else 401 (before anything else is read);
2. the body: over `max_request_bytes` 413, unparsable or invalid 400 naming the field (the engine's shapes);
3. `model` within the tenant, else 404 (`model_not_found`);
4. the tenant's limits (429), then dispatch: a replica now, or a wait in the model's queue (scaling from
   zero, or every replica saturated), and proxy.
Unknown routes are 404 and known routes with another method 405, in OpenAI's error shape too.
`/v1/responses` (OpenAI's Responses API) takes the chat's path: the same checks, limits, fair charge, prefix
routing, waking and retries; its stream's typed events pass through whole, the usage in its last one.
`/tokenize` and `/detokenize` (vLLM's) take the same path with the model's replicas' tokenizer: they count as
requests against the tenant's limits and cost no tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from aiohttp import web

from kvfleet.engine.server.auth import bearer_token
from kvfleet.engine.server.error_shapes import APIError
from kvfleet.gateway.catalog import ModelRef
from kvfleet.gateway.engine_key_store import EngineKeyStore
from kvfleet.gateway.fairness import token_cost
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.prefix import PrefixConfig, request_hashes
from kvfleet.gateway.proxy import Proxy, json_error
from kvfleet.gateway.requests import (
    ROUTES,
    check_request,
    parse_body,
    requested_model,
    token_estimate,
    upstream_body,
)
from kvfleet.gateway.snapshot import Snapshot

log = logging.getLogger("kvfleet.gateway")

KNOWN = {"/v1/models": "GET", **{path: "POST" for path in ROUTES}}
MISSING_KEY = "Missing or invalid API key (send `Authorization: Bearer <key>`)."


class Source(Protocol):
    """Where the snapshot comes from (the cluster's watches, or a static file)."""

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def synced(self) -> bool: ...

    @property
    def engine_keys(self) -> EngineKeyStore: ...

    async def run(self) -> None: ...

    async def close(self) -> None: ...


@dataclass
class GatewayState:
    source: Source
    proxy: Proxy
    metrics: GatewayMetrics
    prefix: PrefixConfig
    max_request_bytes: int
    use_prefix: bool = True
    draining: bool = field(default=False)


def _api_error(err: APIError) -> web.Response:
    return json_error(err.status, err.message, err.code or "", err.param, err.headers or None)


class GatewayApp:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def build(self) -> web.Application:
        app = web.Application(client_max_size=self.state.max_request_bytes)
        app.router.add_get("/livez", self.livez)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/health", self.readyz)
        app.router.add_get("/v1/models", self.guarded(self.list_models))
        app.router.add_get("/v1/models/{model:.+}", self.guarded(self.get_model))
        for path in ROUTES:
            app.router.add_post(path, self.guarded(self.generate))
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        return app

    # -- health ---------------------------------------------------------------------------------------------
    async def livez(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.Request) -> web.Response:
        if self.state.draining:
            return json_error(503, "not ready: draining", "draining")
        if not self.state.source.synced:
            return json_error(503, "not ready: the cluster's state is still loading", "loading")
        return web.json_response({"status": "ok"})

    # -- the gate -------------------------------------------------------------------------------------------
    def guarded(self, handler: Callable[[web.Request, Snapshot, str], Awaitable[web.StreamResponse]]
                ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def gate(request: web.Request) -> web.StreamResponse:
            if not self.state.source.synced:
                return json_error(503, "The gateway is starting; retry shortly.", "loading",
                                  headers={"Retry-After": "2"})
            snapshot = self.state.source.snapshot
            raw = request.headers.get("Authorization")
            token = bearer_token(raw)
            tenant = snapshot.keys.tenant_for(token)
            if tenant is None:
                self.state.metrics.unauthenticated.labels("missing" if token is None else "invalid").inc()
                return json_error(401, MISSING_KEY, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            try:
                return await handler(request, snapshot, tenant)
            except APIError as err:
                return _api_error(err)
            except Exception:  # our bug: never a traceback to the client (a cancelled handler is no Exception)
                log.exception("internal error", extra={"path": request.path})
                return json_error(500, "Internal server error", "internal_error")

        return gate

    async def not_found(self, request: web.Request) -> web.Response:
        allowed = KNOWN.get(request.path)
        if allowed is not None or request.path.startswith("/v1/models/"):
            return json_error(405, f"Method {request.method} not allowed on {request.path}", "method_not_allowed",
                              headers={"Allow": allowed or "GET"})
        return json_error(404, "Not found: no such route", "not_found")

    # -- routes ---------------------------------------------------------------------------------------------
    async def list_models(self, _: web.Request, snapshot: Snapshot, tenant: str) -> web.Response:
        data = [_card(model_id, m) for model_id, m in snapshot.catalog.models(tenant)]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request, snapshot: Snapshot, tenant: str) -> web.Response:
        model_id = request.match_info["model"]
        found = snapshot.catalog.resolve(tenant, model_id)
        if found.model is None:
            raise APIError(404, found.message, "model", "model_not_found")
        return web.json_response(_card(model_id, found.model))

    async def generate(self, request: web.Request, snapshot: Snapshot, tenant: str) -> web.StreamResponse:
        series = self.state.metrics.series(tenant)
        limit = self.state.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            series.failed("request_too_large")
            series.answered(413)
            raise APIError(413, f"Request body of {request.content_length} bytes is over the gateway's limit of "
                                f"{limit} bytes.", code="request_too_large", headers={"Connection": "close"})
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            series.failed("request_too_large")
            series.answered(413)
            raise APIError(413, f"Request body is over the gateway's limit of {limit} bytes.",
                           code="request_too_large", headers={"Connection": "close"}) from None
        try:
            body = parse_body(raw)
            name = requested_model(body)   # the model decides how much of the body is checked here
            found = snapshot.catalog.resolve(tenant, name) if name is not None else None
            vllm = found is not None and found.model is not None and found.model.engine_kind == "vllm"
            req = check_request(request.path, body, vllm=vllm)
        except APIError:
            series.failed("invalid_request")
            series.answered(400)
            raise
        if found is None:   # (a checked body always names its model: resolved above)
            found = snapshot.catalog.resolve(tenant, req.model)
        if found.model is None:
            series.failed("model_not_found")
            series.answered(404)
            raise APIError(404, found.message, "model", "model_not_found")
        model = found.model
        gen = req.generation
        hashes = request_hashes(gen, self.state.prefix) if self.state.use_prefix and gen is not None else ()
        body = upstream_body(req, model.served_name, raw)
        cost = token_cost(*token_estimate(req))
        return await self.state.proxy.forward(request, snapshot, tenant, model, req, body, hashes, cost)


def _card(model_id: str, m: ModelRef) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": m.created, "owned_by": m.tenant}
