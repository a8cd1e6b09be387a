"""kopf peering priority: distinct per instance (kopf pauses every peer of equal priority), stable per identity."""
from __future__ import annotations

import pytest

from kvfleet.operator.main import peering_priority


def test_priority_is_stable_per_identity_and_distinct_across_identities() -> None:
    a, b = peering_priority({"POD_ID": "kvfleet-operator-7d9f-abcde"}), peering_priority({"POD_ID": "kvfleet-x-1"})
    assert a == peering_priority({"POD_ID": "kvfleet-operator-7d9f-abcde"})  # a restarted container keeps it
    assert a != b and a > 0 and b > 0  # above kopf's default 0 of a peer started without us
    pods = {peering_priority({"POD_ID": f"kvfleet-operator-5f6b8-{i:05d}"}) for i in range(500)}
    assert len(pods) == 500


def test_explicit_priority_and_its_error() -> None:
    assert peering_priority({"KVFLEET_PEERING_PRIORITY": "42", "POD_ID": "p"}) == 42
    with pytest.raises(ValueError, match="KVFLEET_PEERING_PRIORITY"):
        peering_priority({"KVFLEET_PEERING_PRIORITY": "high"})
