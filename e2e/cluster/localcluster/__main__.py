"""Command line: `python -m localcluster up|down|status` (run from e2e/cluster, or through ../cluster.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import components, control, manifests
from .layout import Layout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the cluster, or keep a healthy one (idempotent)")
    up.add_argument(
        "--nodes",
        default=os.environ.get("KVFLEET_CLUSTER_NODES", manifests.DEFAULT_NODES),
        help=f"fake GPU nodes as FLAVOR=COUNT,... (flavors: {', '.join(manifests.FLAVORS)}; "
        f"default {manifests.DEFAULT_NODES}, or $KVFLEET_CLUSTER_NODES)",
    )
    up.add_argument(
        "--engine-model",
        default=os.environ.get(components.ENGINE_MODEL_ENV, components.DEFAULT_ENGINE_MODEL),
        help="local model of the kvfleet engine pods that choose none: embedded (SmolLM2-135M), tiny, "
        f"tiny-<arch> or an absolute path (default {components.DEFAULT_ENGINE_MODEL}, "
        f"or ${components.ENGINE_MODEL_ENV})",
    )
    up.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for each component")
    sub.add_parser("down", help="stop the cluster and remove its state (safe to run twice)")
    sub.add_parser("status", help="say what runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[cluster] %(message)s")
    layout = Layout.for_checkout()
    try:
        if args.command == "up":
            started = control.up(layout, args.nodes, args.timeout, args.engine_model)
            layout = Layout.for_checkout()  # up may have moved to a free block of ports
            print(control.describe(layout))
            print(("cluster started. " if started else "cluster already running. ") + "To use it:")
            print(control.usage(layout))
        elif args.command == "down":
            stopped = control.down(layout)
            print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        else:
            print(control.describe(layout))
            return 0 if control.is_up(layout) else 3
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError) as err:
        print(f"cluster {args.command} failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
