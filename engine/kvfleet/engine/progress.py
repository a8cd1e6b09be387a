"""A progress bar for long loads: on stderr, only when stderr is a terminal (unless told)."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int, desc: str, quiet: bool | None = None) -> Any:
    """A tqdm bar of `total` tensors; `quiet` True/False forces it off/on."""
    from tqdm.auto import tqdm

    disable = quiet if quiet is not None else not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=disable, leave=False)
