"""Helpers to run the gateway for tests, the e2e and benchmarks: nothing here stands in for the gateway.

- `GatewayProcess`: `kvfleet gateway` as a subprocess on loopback ports (static config or a kubeconfig),
  with `KVFLEET_LOOPBACK_ONLY=1`, its log in a file, and its /metrics read back.
- `start_engines`: real `kvfleet serve` processes (CPU) on loopback ports, returned once healthy.
- `fast_upstream`: `python -m kvfleet.gateway.testing upstream --port N`, a minimal OpenAI-shaped server
  that answers at once (a canned completion, or a stream of `--tokens` events; on `/v1/responses` a canned
  response, or its typed events ending in `response.completed` with the usage): the "fast upstream" the
  gateway's own overhead is measured against. It is a benchmark fixture, not an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import httpx

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, fn: Any, timeout: float = 60.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric_sum(text: str, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in metric_samples(text).items()
               if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """SIGTERM (the process drains), SIGKILL past `timeout`; -> its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


class GatewayProcess:
    def __init__(self, log_path: Path, *, config: Path | None = None, kubeconfig: str | None = None,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 python: Sequence[str] | None = None) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        source = ["--config", str(config)] if config else ["--kubeconfig", str(kubeconfig)]
        cmd = list(python or [sys.executable, "-m", "kvfleet.gateway.main"])
        self.argv = [*cmd, *source, "--host", "127.0.0.1", "--port", str(self.port), "--metrics-host",
                     "127.0.0.1", "--metrics-port", str(self.metrics_port), "--shutdown-grace-period", "2", *args]
        self.env = {**os.environ, "KVFLEET_LOOPBACK_ONLY": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0, wait: bool = True) -> "GatewayProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,  # noqa: S603
                                         cwd=str(REPO), start_new_session=True)
        if wait:
            wait_until("gateway ready", self.ready, timeout)
        return self

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvfleet gateway exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(self.url + "/readyz", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5, trust_env=False).text

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.metrics(), name, **labels)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 20) -> int:
        if self.proc is None:
            return 0
        return stop_process(self.proc, timeout)

    def __enter__(self) -> "GatewayProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- real engines -----------------------------------------------------------------------------------------------

@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvfleet serve exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text, name, **labels)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc, 30)


def start_engines(model: Path, logs: Path, n: int, *extra: str, served: str = "tiny",
                  timeout: float = 180.0) -> list[Engine]:
    """`n` engines started at once, returned when all are healthy."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    engines = []
    for _ in range(n):
        port = free_port()
        log = logs / f"engine-{port}.log"
        with log.open("wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "kvfleet.engine.cli", "serve", str(model),  # noqa: S603
                                     "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                                     "--served-model-name", served, "--log-level", "warning",
                                     "--disable-log-requests", *extra], stdout=fh, stderr=subprocess.STDOUT, env=env)
        engines.append(Engine(proc, f"http://127.0.0.1:{port}", log))
    try:
        for engine in engines:
            wait_until(f"engine {engine.url} healthy", engine.healthy, timeout=timeout, interval=0.3)
    except BaseException:
        for engine in engines:
            engine.kill()
        raise
    return engines


# -- the fast upstream ------------------------------------------------------------------------------------------

def _completion(model: str, text: str) -> dict[str, Any]:
    return {"id": "cmpl-fast", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


RESPONSE_INPUT_TOKENS = 7  # a canned response's usage: these input tokens, and one output token per text event


def _response(body: dict[str, Any], status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None) -> dict[str, Any]:
    """A Responses API response object, as our engine writes one (fixed id and time: answers compare equal)."""
    return {"id": "resp_fast", "object": "response", "created_at": 0, "status": status, "background": False,
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": {}, "model": str(body.get("model", "m")),
            "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": None,
            "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "top_logprobs": None,
            "top_p": None, "truncation": "disabled", "usage": usage, "user": None}


def _response_usage(output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": RESPONSE_INPUT_TOKENS, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": RESPONSE_INPUT_TOKENS + output_tokens}


def _message(text: str, status: str) -> dict[str, Any]:
    done = status != "in_progress"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": "msg_fast", "status": status, "role": "assistant", "content": content}


def response_events(body: dict[str, Any], tokens: int) -> list[dict[str, Any]]:
    """A canned Responses stream: `tokens` text deltas, then `response.completed` with the usage."""
    text = "x" * tokens
    start = _response(body, "in_progress", [], None)
    where = {"item_id": "msg_fast", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": start}, {"type": "response.in_progress", "response": start},
        {"type": "response.output_item.added", "output_index": 0, "item": _message("", "in_progress")},
        {"type": "response.content_part.added", "part": {**part, "text": ""}, **where},
        *({"type": "response.output_text.delta", "delta": "x", "logprobs": [], **where} for _ in range(tokens)),
        {"type": "response.output_text.done", "text": text, "logprobs": [], **where},
        {"type": "response.content_part.done", "part": part, **where},
        {"type": "response.output_item.done", "output_index": 0, "item": _message(text, "completed")},
        {"type": "response.completed",
         "response": _response(body, "completed", [_message(text, "completed")], _response_usage(tokens))},
    ]
    return [{"type": e["type"], "sequence_number": i, **e} for i, e in enumerate(events)]


def fast_upstream_app(tokens: int = 1, api_key: str | None = None) -> Any:
    from aiohttp import web

    def refused(request: web.Request) -> web.Response | None:
        if api_key is not None and request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": {"message": "Missing or invalid API key", "type": "authentication_error",
                                                "param": None, "code": "invalid_api_key"}}, status=401)
        return None

    async def responses(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "stream_options" in body:   # as our engine: the Responses API has no such field
            return web.json_response({"error": {"message": "Unknown field 'stream_options'", "param": "stream_options",
                                                "type": "invalid_request_error", "code": "unknown_field"}}, status=400)
        if not body.get("stream"):
            return web.json_response(_response(body, "completed", [_message("x", "completed")], _response_usage(1)))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for event in response_events(body, tokens):
            await out.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        await out.write_eof()
        return out

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model = str(body.get("model", "m"))
        if not body.get("stream"):
            return web.json_response(_completion(model, "x"))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(tokens):
            chunk = {"id": "cmpl-fast", "object": "text_completion", "created": 0, "model": model,
                     "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]}
            await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-fast", "object": "text_completion", "created": 0, "model": model, "choices": [],
                     "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}}
            await out.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="kvfleet:num_requests_waiting 0\nkvfleet:num_requests_running 0\n")

    def keyed(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
              ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def run(request: web.Request) -> web.StreamResponse:
            return refused(request) or await handler(request)

        return run

    app = web.Application()
    app.router.add_post("/v1/completions", keyed(completions))
    app.router.add_post("/v1/chat/completions", keyed(completions))
    app.router.add_post("/v1/responses", keyed(responses))
    app.router.add_get("/metrics", metrics)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet.gateway.testing")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upstream", help="a fast OpenAI-shaped upstream (benchmark fixture)")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--tokens", type=int, default=1, help="events per streamed answer")
    up.add_argument("--api-key", help="answer 401 to requests without this key (as an engine with its own key)")
    args = parser.parse_args(argv)
    from aiohttp import web

    web.run_app(fast_upstream_app(args.tokens, args.api_key), host="127.0.0.1", port=args.port, print=None,
                access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
