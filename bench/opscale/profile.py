"""Sampling the operator with py-spy (a separate process: no change to the operator), and the top functions."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def start(pid: int, out: Path, rate: int = 67) -> subprocess.Popen[bytes]:
    """`py-spy record` of `pid` in collapsed-stack form (`--format raw`), all threads, without pausing it."""
    exe = py_spy()
    if exe is None:
        raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
    argv = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--output", str(out),
            "--threads", "--nonblocking"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # noqa: S603


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _frame(text: str) -> str:
    """`func (path/to/module.py:123)` -> `func (module.py)`: one entry per function, not per line."""
    name, _, where = text.partition(" (")
    file = where.rsplit(":", 1)[0].rstrip(")")
    return f"{name} ({'/'.join(file.split('/')[-2:])})"


def top_functions(raw: str, n: int = 40) -> dict[str, Any]:
    """Self and inclusive sample counts per function from py-spy's collapsed stacks ("a;b;c 17" lines)."""
    self_counts: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";") if not f.startswith("thread (") and f.strip()]
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for f in set(frames):
            incl[f] += count

    def rows(c: Counter[str]) -> list[dict[str, Any]]:
        return [{"function": f, "samples": k, "share": round(k / total, 3)} for f, k in c.most_common(n)]

    return {"samples": total, "self": rows(self_counts), "inclusive": rows(incl)}
