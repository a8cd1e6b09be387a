#!/usr/bin/env python3
"""Entry point for `make cluster-up|cluster-down|cluster-status`: python e2e/cluster/cluster.py up|down|status."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from localcluster.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
