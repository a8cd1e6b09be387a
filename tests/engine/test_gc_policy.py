"""The cyclic GC settings of an engine process (KVFLEET_GC_THRESHOLDS, KVFLEET_GC_FREEZE)."""

from __future__ import annotations

import gc

import pytest

from kvfleet.engine import gc_policy


def test_thresholds_from_the_environment() -> None:
    assert gc_policy.gc_thresholds({}) == gc_policy.DEFAULT_THRESHOLDS
    assert gc_policy.gc_thresholds({"KVFLEET_GC_THRESHOLDS": "default"}) == (700, 10, 10)
    assert gc_policy.gc_thresholds({"KVFLEET_GC_THRESHOLDS": " 20000, 20,100 "}) == (20000, 20, 100)
    for bad in ("20000", "1,2,x", "-1,2,3", "0,10,10"):
        with pytest.raises(ValueError, match="KVFLEET_GC_THRESHOLDS"):
            gc_policy.gc_thresholds({"KVFLEET_GC_THRESHOLDS": bad})


def test_applied_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    before = gc.get_threshold()
    monkeypatch.setattr(gc_policy, "_applied", False)
    try:
        assert gc_policy.apply_once({"KVFLEET_GC_THRESHOLDS": "5000,15,25", "KVFLEET_GC_FREEZE": "0"})
        assert gc.get_threshold() == (5000, 15, 25)
        assert not gc_policy.apply_once({"KVFLEET_GC_THRESHOLDS": "700,10,10"})   # the first call's settings stay
        assert gc.get_threshold() == (5000, 15, 25)
    finally:
        gc.set_threshold(*before)
