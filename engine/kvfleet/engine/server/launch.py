"""`kvfleet serve`: build the state and app, run uvicorn, drain on SIGTERM.

SIGTERM (what Kubernetes sends) starts a drain: /health and new requests answer 503,
running requests may finish for `--shutdown-grace-period` seconds, then uvicorn shuts
down (cancelling what is left, which aborts it in the engine) and the process exits 0.
A second signal stops at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from kvfleet.engine.server.app import build_app
from kvfleet.engine.server.args import engine_kwargs
from kvfleet.engine.server.auth import KeyFileError, load_keys
from kvfleet.engine.server.logging_setup import setup_logging
from kvfleet.engine.server.state import ServerState

logger = logging.getLogger("kvfleet.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.deadline: float | None = None

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
            if self.state.admission.inflight == 0 or time.monotonic() >= self.deadline:
                logger.info("drain finished", extra={"inflight": self.state.admission.inflight})
                return True
        return False


def default_model() -> str:
    from kvfleet.engine.tokenizer import find_default_model

    return str(find_default_model())


def run_server(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        model = args.model or default_model()
        keys = load_keys(args.api_key, args.api_keys_file)
        template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    except (KeyFileError, OSError) as exc:
        print(f"kvfleet serve: error: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or (args.model if args.model else Path(model).stem.split(".")[0])
    state = ServerState(model_name=name, model_path=model, keys=keys, max_queue_len=args.max_queue_len,
                        chat_template=template, log_requests=not args.disable_log_requests,
                        block_size=args.block_size, max_request_bytes=args.max_request_bytes)
    kwargs = engine_kwargs(args)

    def load_engine() -> Any:
        from kvfleet.engine.async_llm import AsyncLLM

        return AsyncLLM(model, **kwargs)

    app = build_app(state, load_engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=1, lifespan="on")
    server = DrainingServer(config, state, args.shutdown_grace_period)
    logger.info("serving", extra={"model": model, "served_model_name": name, "host": args.host, "port": args.port,
                                  "auth": "on" if keys else "off", "tenants": len(set(keys.values())) if keys else 0})
    server.run()
    if state.load_error:
        print(f"kvfleet serve: error: model load failed: {state.load_error}", file=sys.stderr)
        return 1
    return 0
