"""`kvfleet serve`: build the state and app, run uvicorn, drain on SIGTERM.

SIGTERM (what Kubernetes sends) starts a drain: /health and new requests answer 503,
running requests may finish for `--shutdown-grace-period` seconds. Then those still running
are aborted in the engine and answered properly (a 503, or an error event and `[DONE]` in a
stream), uvicorn shuts down and the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Mapping

import uvicorn

from kvfleet.engine.env_settings import EnvSettingError
from kvfleet.engine.server.app import build_app
from kvfleet.engine.server.args import engine_kwargs
from kvfleet.engine.server.auth import KeyFileError, load_keys
from kvfleet.engine.server.connections import ConnectionLimits, bounded_protocol
from kvfleet.engine.server.generation import cut_off_requests
from kvfleet.engine.server.logging_setup import setup_logging
from kvfleet.engine.server.state import ServerState

logger = logging.getLogger("kvfleet.server")


# After the grace period, running requests are ended (503, or an error event and [DONE] in a stream);
# this long at most is given to their answers before uvicorn closes what is left.
CUT_OFF_WAIT_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.deadline: float | None = None
        self.cut_off_at: float | None = None
        self._cut_off: asyncio.Task[int] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            # Not recorded as a captured signal: uvicorn would re-raise it at exit (status 143, not 0).
            self.state.draining = True
            self.deadline = time.monotonic() + self.grace_s
            logger.info("SIGTERM: draining", extra={"inflight": self.state.admission.inflight,
                                                     "grace_s": self.grace_s})
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.state.load_error:
            return True
        if self.state.draining and self.deadline is not None:
            inflight = self.state.admission.inflight
            if inflight == 0:
                logger.info("drain finished", extra={"inflight": 0})
                return True
            now = time.monotonic()
            if self.cut_off_at is None and now >= self.deadline:
                logger.info("shutdown grace period over: ending the requests still running",
                            extra={"inflight": inflight, "grace_s": self.grace_s})
                self.cut_off_at = now
                self._cut_off = asyncio.create_task(cut_off_requests(self.state))
            elif self.cut_off_at is not None and now >= self.cut_off_at + CUT_OFF_WAIT_S:
                logger.warning("requests still running after the cut-off; closing their connections",
                               extra={"inflight": inflight})
                return True
        return False


FILES_BESIDES_CONNECTIONS = 1024   # weights, tokenizer, the engine's pipes and threads, logs


def raise_open_files_limit(wanted: int) -> None:
    """Raise the soft limit of open files toward `wanted` (as vLLM does): the connection cap should be
    what refuses connections, not a failing accept()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        logger.warning("open files limit below what --max-connections needs", extra={"hard_limit": hard,
                                                                                      "wanted": wanted})


# The engine's step loop is a Python thread beside the event loop that serves HTTP. CPython hands the GIL to a
# waiting thread only every `sys.getswitchinterval()` (5 ms by default): each time the event loop wakes for a
# request's bytes or a token to send while the step loop runs Python, it can wait that long.
DEFAULT_GIL_SWITCH_INTERVAL_MS = 5.0


def gil_switch_interval_s(env: Mapping[str, str]) -> float:
    """The interpreter's thread switch interval for the server, from `KVFLEET_GIL_SWITCH_INTERVAL_MS`."""
    raw = env.get("KVFLEET_GIL_SWITCH_INTERVAL_MS", "")
    if not raw:
        return DEFAULT_GIL_SWITCH_INTERVAL_MS / 1e3
    try:
        ms = float(raw)
    except ValueError:
        raise EnvSettingError(f"KVFLEET_GIL_SWITCH_INTERVAL_MS: {raw!r} is not a number of milliseconds") from None
    if not (0.01 <= ms <= 100):
        raise EnvSettingError(f"KVFLEET_GIL_SWITCH_INTERVAL_MS: {raw} must be within 0.01..100 ms")
    return ms / 1e3


def default_model() -> str:
    from kvfleet.engine.tokenizer import find_default_model

    return str(find_default_model())


def run_server(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        sys.setswitchinterval(gil_switch_interval_s(os.environ))
        model = args.model or default_model()
        keys = load_keys(args.api_key, args.api_keys_file)
        template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    except (KeyFileError, OSError, ValueError) as exc:
        print(f"kvfleet serve: error: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or (args.model if args.model else Path(model).stem.split(".")[0])
    state = ServerState(model_name=name, model_path=model, keys=keys, max_queue_len=args.max_queue_len,
                        chat_template=template, log_requests=not args.disable_log_requests,
                        block_size=args.block_size, max_request_bytes=args.max_request_bytes,
                        metrics_port=args.metrics_port,
                        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                        reasoning_parser=args.reasoning_parser)
    kwargs = engine_kwargs(args)

    def load_engine() -> Any:
        from kvfleet.engine.async_llm import AsyncLLM

        return AsyncLLM(model, **kwargs)

    app = build_app(state, load_engine)
    limits = ConnectionLimits(keep_alive_s=args.timeout_keep_alive, headers_s=args.timeout_request_headers,
                              body_s=args.timeout_request_body, max_connections=args.max_connections)
    raise_open_files_limit(args.max_connections + FILES_BESIDES_CONNECTIONS)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=1, lifespan="on", http=bounded_protocol(limits), ws="none")
    server = DrainingServer(config, state, args.shutdown_grace_period)
    logger.info("serving", extra={"model": model, "served_model_name": name, "host": args.host, "port": args.port,
                                  "auth": "on" if keys else "off",
                                  "tenants": len(set(keys.keys.values())) if keys else 0})
    if args.metrics_port is None:
        server.run()
    else:   # one server, two listening sockets; the app tells them apart by the local port
        metrics = uvicorn.Config(app, host=args.host, port=args.metrics_port, log_level=args.log_level)
        server.run(sockets=[config.bind_socket(), metrics.bind_socket()])
    if state.load_error:
        print(f"kvfleet serve: error: model load failed: {state.load_error}", file=sys.stderr)
        return 1
    return 0
