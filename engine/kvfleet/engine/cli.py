"""`kvfleet` command line: `serve`, `bench serve|throughput`, `operator`, `gateway`.

Everything heavy (torch, FastAPI, kopf) is imported only once a subcommand runs, so
`kvfleet --help` answers at once. `bench throughput`, `operator` and `gateway` belong to other
parts of the project; their arguments are handed over untouched.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from types import ModuleType
from typing import Callable, Sequence

from kvfleet.engine.env_settings import EnvSettingError

_PASSTHROUGH = {
    ("operator",): ("kvfleet.operator", "main"),
    ("gateway",): ("kvfleet.gateway.main", "main"),
    ("bench", "throughput"): ("kvfleet.engine.bench.throughput", "main"),
}


def _import(module_name: str) -> ModuleType:
    """Import one of our modules. Their import-time code reads only KVFLEET_* settings (the kernels' among them,
    which may import nothing of the engine's), so a ValueError there is a bad setting, named in its message."""
    try:
        return importlib.import_module(module_name)
    except ValueError as exc:
        raise EnvSettingError(str(exc)) from None


def _resolve_main(module_name: str, attr: str) -> Callable[[list[str]], object]:
    """Find `module.main`; if `main` is itself a submodule, take its `main` function."""
    target = getattr(_import(module_name), attr, None)
    if target is None or not callable(target):
        target = _import(f"{module_name}.{attr}").main
    return target


def build_parser() -> argparse.ArgumentParser:
    from kvfleet.engine.server.args import add_serve_args

    parser = argparse.ArgumentParser(prog="kvfleet", description="kvfleet: LLM serving engine and operator.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           description="Serve a model over an OpenAI-compatible HTTP API (flags like `vllm serve`; "
                                       "each flag also reads KVFLEET_<FLAG>).")
    add_serve_args(serve)
    bench = sub.add_parser("bench", help="benchmarks: `serve` (online, over HTTP) or `throughput` (offline)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_serve = bench_sub.add_parser("serve", help="load a running server and report TTFT/ITL/latency",
                                       description="Send a workload to a running OpenAI-compatible server with "
                                                   "streaming and report throughput and latency percentiles.")
    from kvfleet.engine.bench.serve import add_cli_args

    add_cli_args(bench_serve)
    bench_sub.add_parser("throughput", help="offline throughput of the engine (arguments: see its --help)",
                         add_help=False)
    sub.add_parser("operator", help="run the Kubernetes operator (arguments: see its --help)", add_help=False)
    sub.add_parser("gateway", help="run the tenant-aware OpenAI-compatible gateway (arguments: see its --help)",
                   add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except EnvSettingError as exc:   # read at import or start: one line, not a traceback
        print(f"kvfleet: error: {exc}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    for prefix, (module_name, attr) in _PASSTHROUGH.items():
        if tuple(argv[: len(prefix)]) == prefix:
            result = _resolve_main(module_name, attr)(argv[len(prefix):])
            return result if isinstance(result, int) else 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        if importlib.util.find_spec("torch") is None:  # e.g. the control-plane image: kvfleet[operator,gateway]
            parser.error("serve needs the engine's dependencies (torch), which this installation lacks: "
                         "pip install 'kvfleet[engine]', or run the kvfleet-engine image")
        from kvfleet.engine.server.args import check_serve_args

        try:
            check_serve_args(args)
        except ValueError as exc:
            parser.error(str(exc))
        code = _import("kvfleet.engine.server.launch").run_server(args)
        # The engine and the server are shut down by now; interpreter finalization of the torch
        # runtime would add ~5 s to every pod termination (measured), so leave at once.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if args.command == "bench" and args.bench_command == "serve":
        from kvfleet.engine.bench.serve import main as bench_serve_main

        return bench_serve_main(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
