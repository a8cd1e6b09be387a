"""Which source a benchmark measured, for its result JSON.

`KVFLEET_COMMIT` wins when set: a copy of the tree sent to another machine (the GPU calls) may carry a `.git` whose
HEAD is not the commit of the files that travelled, so the caller names the commit there.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def git_describe(repo: Path = REPO) -> dict[str, Any]:
    """{"commit", "branch", "dirty"} of the checkout the benchmark runs from."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False).stdout.strip()

    named = os.environ.get("KVFLEET_COMMIT", "").strip()
    return {"commit": named or git("rev-parse", "--short", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
