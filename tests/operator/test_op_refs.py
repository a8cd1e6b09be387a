"""References from the watches' memory; misses and negative answers read through to the apiserver."""
from __future__ import annotations

from typing import Any, Mapping

from kvfleet.operator.refs import WatchedRefs


class CountingApi:
    """An ApiRefs stand-in: answers from a dict of what 'the apiserver' holds, counting reads."""

    def __init__(self, flavors: dict[str, Any], tenants: dict[str, str], queues: set[str]) -> None:
        self.flavors, self.tenants, self.queues = flavors, tenants, queues
        self.reads = 0

    def flavor(self, name: str) -> Mapping[str, Any] | None:
        self.reads += 1
        return self.flavors.get(name)

    def namespace_tenant(self, namespace: str) -> str | None:
        self.reads += 1
        return self.tenants.get(namespace)

    def local_queue_exists(self, namespace: str, name: str) -> bool:
        self.reads += 1
        return f"{namespace}/{name}" in self.queues

    def priority_value(self, name: str) -> int | None:
        self.reads += 1
        return None


def test_known_references_need_no_read() -> None:
    api = CountingApi({"h200": {"nodeLabels": {"a": "b"}}}, {"team": "acme"}, {"team/acme"})
    refs = WatchedRefs(api)  # type: ignore[arg-type]
    refs.seen(WatchedRefs.FLAVOR, "h200", {"nodeLabels": {"a": "b"}})
    refs.seen(WatchedRefs.NAMESPACE, "team", "acme")
    refs.seen(WatchedRefs.QUEUE, "team/acme", True)
    assert refs.flavor("h200") == {"nodeLabels": {"a": "b"}}
    assert refs.namespace_tenant("team") == "acme"
    assert refs.local_queue_exists("team", "acme")
    assert api.reads == 0


def test_a_miss_or_a_negative_answer_is_read_through() -> None:
    api = CountingApi({"l40s": {}}, {"fresh": "acme"}, {"fresh/acme"})
    refs = WatchedRefs(api)  # type: ignore[arg-type]
    refs.seen(WatchedRefs.NAMESPACE, "fresh", None)  # the watch has not seen the tenant's label yet
    assert refs.flavor("l40s") == {} and refs.flavor("nope") is None
    assert refs.namespace_tenant("fresh") == "acme"
    assert refs.local_queue_exists("fresh", "acme") and not refs.local_queue_exists("fresh", "other")
    assert api.reads == 5
    refs.flavor("l40s")
    assert api.reads == 6  # read-through answers are not remembered: only the watch writes the memory


def test_gone_forgets() -> None:
    api = CountingApi({}, {}, set())
    refs = WatchedRefs(api)  # type: ignore[arg-type]
    refs.seen(WatchedRefs.FLAVOR, "h200", {})
    refs.gone(WatchedRefs.FLAVOR, "h200")
    assert refs.flavor("h200") is None and api.reads == 1
