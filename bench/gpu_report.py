"""The report of a GPU bench script: printed lines kept for its text file, and named sections whose results (or
error) go into its JSON, one failing section leaving the others to run."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable


class GpuReport:
    def __init__(self, on_cuda: bool) -> None:
        self.on_cuda = on_cuda
        self.lines: list[str] = []
        self.sections: dict[str, Any] = {}

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def section(self, name: str) -> Callable[[Callable[[], Any]], Callable[[], None]]:
        """Decorator: run the function as section `name`, its result (or its error) recorded under that name."""
        def wrap(fn: Callable[[], Any]) -> Callable[[], None]:
            def run() -> None:
                t = time.monotonic()
                self.say(f"\n=== {name}")
                try:
                    self.sections[name] = fn()
                except Exception as e:  # noqa: BLE001 - the next section still runs
                    self.sections[name] = {"error": f"{type(e).__name__}: {e}",
                                           "traceback": traceback.format_exc()[-3000:]}
                    self.say(f"FAILED: {type(e).__name__}: {e}")
                self.say(f"({name}: {time.monotonic() - t:.1f} s)")
                if self.on_cuda:
                    import torch

                    torch.cuda.empty_cache()
            run.__name__ = fn.__name__
            return run
        return wrap

    def failed(self) -> list[str]:
        return [k for k, v in self.sections.items() if isinstance(v, dict) and "error" in v]

    def write(self, out: Path, stem: str) -> None:
        """OUT/stem.json (the sections) and OUT/stem.txt (the lines)."""
        (out / f"{stem}.json").write_text(json.dumps(self.sections, indent=1, default=str) + "\n")
        (out / f"{stem}.txt").write_text("\n".join(self.lines) + "\n")
