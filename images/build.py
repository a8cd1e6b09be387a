#!/usr/bin/env python3
"""kvfleet's images: `make images` (build), `make image-test`; images/README.md explains.

    python3 images/build.py build [control-plane] [engine]   # build what is not cached (OCI archives)
    python3 images/build.py archive engine                   # path of the engine's archive (for skopeo copy)
    python3 images/build.py reference engine                 # ghcr.io/kvfleet/kvfleet-engine:<version>
    python3 images/build.py clean                            # remove every image, layer and archive
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from imagekit.builder import build, plan  # noqa: E402
from imagekit.specs import IMAGES  # noqa: E402
from imagekit.tools import Store, missing_tools  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="images/build.py", description="Build kvfleet's container images.")
    parser.add_argument("command", choices=("build", "archive", "reference", "clean"))
    parser.add_argument("names", nargs="*", metavar="IMAGE", help=f"{', '.join(IMAGES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in IMAGES]
    if unknown:
        parser.error(f"unknown image {', '.join(unknown)} (known: {', '.join(IMAGES)})")
    names = args.names or list(IMAGES)
    store = Store.default()
    if args.command == "build":
        missing = missing_tools()
        if missing:
            print(f"missing: {', '.join(missing)}: run `make image-deps`", file=sys.stderr)
            return 1
        for name in names:
            build(IMAGES[name], store)
    elif args.command == "archive":
        for name in names:
            print(plan(IMAGES[name], store).path)
    elif args.command == "reference":
        for name in names:
            print(plan(IMAGES[name], store).reference)
    elif args.command == "clean":
        with store.lock():
            if store.graph.exists():
                store.run(store.podman("system", "reset", "--force"), check=False)
            for sub in ("storage", "run", "archives", "tmp", "logs"):
                shutil.rmtree(store.root / sub, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
