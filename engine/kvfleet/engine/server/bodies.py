"""Request bodies are measured before FastAPI parses them: a body nested deeper than
`MAX_JSON_DEPTH` gets a 400 naming the problem, and never reaches `json.loads` or a validator
(both recurse once per level)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine

from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from kvfleet.engine.server.errors import APIError
from kvfleet.engine.server.jsondepth import MAX_JSON_DEPTH, json_depth_exceeds

# Larger bodies are measured on a worker thread (a few ms a megabyte) so the event loop goes on.
MEASURE_INLINE_BYTES = 1 << 20


async def check_body_depth(body: bytes) -> None:
    deep = (json_depth_exceeds(body) if len(body) <= MEASURE_INLINE_BYTES
            else await asyncio.to_thread(json_depth_exceeds, body))
    if deep:
        raise APIError(400, f"The JSON body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
                            "no request needs that many.", code="json_too_deep")


class BoundedJSONRoute(APIRoute):
    """An APIRoute that reads the body and checks its nesting before FastAPI's own body parsing
    (which then reuses the body Starlette cached on the request)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def bounded(request: Request) -> Response:
            try:
                body = await request.body()
            except ClientDisconnect:  # gone (or timed out) mid-body: nobody reads an answer
                return Response(status_code=400)
            await check_body_depth(body)
            return await handler(request)

        return bounded
