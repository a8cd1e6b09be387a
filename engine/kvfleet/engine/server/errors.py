"""OpenAI-style errors: every failure answers `{"error": {"message", "type", "param", "code"}}`.

What a client sent is never a 500: validation errors become 400 naming the field; the
catch-all handler exists only for our own bugs (and logs them).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfleet.engine.server.error_shapes import APIError, describe_validation_errors, error_body, value_error_param

# the shapes live in error_shapes (no FastAPI, shared with the gateway); importers of this module keep their names
__all__ = ["APIError", "ErrorJSONResponse", "describe_validation_errors", "error_body", "error_response",
           "install_error_handlers", "value_error_param"]

logger = logging.getLogger("kvfleet.server")


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped JSON: an error that quotes what the client sent (a model name, a field) renders
    even when that text is not valid Unicode (a lone surrogate), instead of failing into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: APIError) -> JSONResponse:
    return ErrorJSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                             headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = describe_validation_errors(exc.errors())
        return ErrorJSONResponse(error_body(400, message, param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "HTTP error"
        code = None
        if exc.status_code == 404:
            message, code = "Not found: no such route", "not_found"
        elif exc.status_code == 413:
            code = "request_too_large"
        elif exc.status_code == 400:  # FastAPI could not decode the body (not UTF-8, bad encoding)
            message, code = f"Malformed request body ({message}): send UTF-8 JSON", "invalid_json"
        return ErrorJSONResponse(error_body(exc.status_code, message, code=code), status_code=exc.status_code,
                                 headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, "Internal server error", code="internal_error"), status_code=500)
