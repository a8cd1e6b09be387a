"""Which problems the create/update handler retries (the rest wait for a spec change)."""
from __future__ import annotations

from kvfleet.operator.handlers import waiting_reason


def status(reason: str) -> dict:
    return {"conditions": [{"type": "Available", "reason": "FlavorNotFound"},
                           {"type": "Admitted", "status": "False", "reason": reason}]}


def test_missing_references_are_retried() -> None:
    for reason in ("FlavorNotFound", "QueueNotFound", "NotATenantNamespace", "PriorityClassNotFound"):
        assert waiting_reason(status(reason)) == reason


def test_other_states_are_not() -> None:
    assert waiting_reason(status("Pending")) is None  # Kueue's queue: workload events wake us
    assert waiting_reason(status("InvalidSpec")) is None  # only a spec change helps: an update event
    assert waiting_reason(None) is None and waiting_reason({}) is None
