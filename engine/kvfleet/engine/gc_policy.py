"""The engine process's cyclic garbage collector: what it scans, and how often.

Once per process, after the first engine is built (`apply_once`):

- **freeze**: collect, then move every object alive now (the modules and classes of torch/transformers,
  the model, the tokenizer: ~200k objects) out of the cyclic GC's reach (`gc.freeze`, as vLLM's engine
  core does). Otherwise every full collection re-scans them: ~100 ms pauses between steps, measured on
  CPU (bench/NOTES.md). Frozen objects are still freed by reference counting; only cycles among them are
  not. `KVFLEET_GC_FREEZE=0` turns it off.
- **thresholds** (`KVFLEET_GC_THRESHOLDS=g0,g1,g2`, default 20000,20,100; `default` for Python's
  700,10,10): each step makes and drops thousands of container objects (outputs, token lists), so at
  Python's gen-0 threshold of 700 allocations the collector runs many times a step at batch 1,024, and
  the older generations it promotes into (every running request's objects) are rescanned in pauses of
  tens of milliseconds. Measured on CPU (`bench/host_overhead.py`, interleaved): host time of a streaming
  step at batch 1,024 -15 %, a mixed step -21 %, the longest step 43 -> 22 ms; batch 256 and final-only
  steps level.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping

from kvfleet.engine.env_settings import EnvSettingError

logger = logging.getLogger(__name__)

PYTHON_THRESHOLDS = (700, 10, 10)
DEFAULT_THRESHOLDS = (20000, 20, 100)   # measured: bench/NOTES.md "The cyclic GC's thresholds"

_applied = False


def gc_thresholds(env: Mapping[str, str]) -> tuple[int, int, int]:
    """KVFLEET_GC_THRESHOLDS as `gc.set_threshold`'s three numbers; EnvSettingError naming the variable."""
    raw = env.get("KVFLEET_GC_THRESHOLDS", "").strip().lower()
    if not raw:
        return DEFAULT_THRESHOLDS
    if raw == "default":
        return PYTHON_THRESHOLDS
    parts = raw.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise EnvSettingError(f"KVFLEET_GC_THRESHOLDS must be three non-negative integers g0,g1,g2 or 'default', "
                              f"got {raw!r}")
    g0, g1, g2 = (int(p) for p in parts)
    if g0 == 0:
        raise EnvSettingError("KVFLEET_GC_THRESHOLDS: g0 = 0 turns the cyclic GC off; use a large value instead")
    return g0, g1, g2


def apply_once(env: Mapping[str, str] | None = None) -> bool:
    """Freeze the startup heap and set the thresholds, the first time it is called in this process.
    True if it acted now."""
    global _applied
    if _applied:
        return False
    env = os.environ if env is None else env
    thresholds = gc_thresholds(env)
    _applied = True
    if env.get("KVFLEET_GC_FREEZE", "1") != "0":
        gc.collect()
        gc.freeze()
        logger.debug("froze %d startup objects out of the cyclic GC", gc.get_freeze_count())
    gc.set_threshold(*thresholds)
    return True
