"""Engines with their own key: the candidates a Secret gives, their order, the store's reads, where refs come from."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from kvfleet.gateway.cluster_view import build_snapshot
from kvfleet.gateway.engine_key_store import EngineKeyStore
from kvfleet.gateway.engine_keys import EngineKeyRef, EngineKeys, engine_keys, key_order
from kvfleet.gateway.static import StaticConfigError, static_engine_keys, static_snapshot

OLD, NEW = "engine-key-old-0123456789", "engine-key-new-0123456789"
REF = EngineKeyRef("team-a", "chat-keys", "keys.yaml")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_a_kvfleet_keys_file_gives_every_key_in_its_order() -> None:
    assert engine_keys(REF, {"keys.yaml": b64(f"{OLD}: gateway\n{NEW}: gateway\n")}) == EngineKeys((OLD, NEW))
    assert engine_keys(REF, {"keys.yaml": b64(f'{{"{NEW}": "t"}}')}) == EngineKeys((NEW,))


def test_a_vllm_entry_is_the_key_itself() -> None:
    ref = EngineKeyRef("team-a", "chat-keys", "api-key", "vllm")
    assert engine_keys(ref, {"api-key": b64(f"{OLD}\n")}) == EngineKeys((OLD,))
    assert "empty" in engine_keys(ref, {"api-key": b64("  \n")}).problem


@pytest.mark.parametrize("data, says", [
    (None, "has no such entry"),
    ({"other": b64("x: y")}, "has no such entry"),
    ({"keys.yaml": "%%%"}, "not base64"),
    ({"keys.yaml": b64(f"- {OLD}\n")}, "expected a non-empty mapping"),
    ({"keys.yaml": b64(f"{OLD}: ''\n")}, "entry 1: the tenant name"),
])
def test_what_is_wrong_with_a_secret_is_said_without_the_key(data: Any, says: str) -> None:
    got = engine_keys(REF, data)
    assert got.keys == () and says in got.problem and "team-a/chat-keys" in got.problem
    assert OLD not in got.problem


def test_the_key_that_worked_goes_first_and_tried_keys_not_again() -> None:
    assert key_order((OLD, NEW), None) == (OLD, NEW)
    assert key_order((OLD, NEW), NEW) == (NEW, OLD)
    assert key_order((OLD, NEW), NEW, (NEW, OLD)) == (NEW, OLD)
    assert key_order((OLD, NEW), NEW, (), {NEW}) == (OLD,)
    assert key_order((OLD,), None, (), {OLD}) == ()
    # a key rotated out of the Secret that engines still take (vLLM reads its key at start) goes on working,
    # where it worked first, elsewhere after the Secret's
    assert key_order((NEW,), OLD) == (OLD, NEW) and key_order((NEW,), OLD, (), {OLD}) == (NEW,)
    assert key_order((NEW,), None, (OLD,)) == (NEW, OLD)


class Reads:
    """A Secret whose content the test sets, counting the store's reads; a clock the test moves."""

    def __init__(self, keys: EngineKeys) -> None:
        self.value, self.count, self.now = keys, 0, 0.0

    async def read(self, ref: EngineKeyRef) -> EngineKeys:
        self.count += 1
        return self.value


def test_the_store_keeps_a_read_and_reads_again_after_a_refusal_or_its_ttl() -> None:
    reads = Reads(EngineKeys((OLD,)))
    store = EngineKeyStore(reads.read, ttl_s=30, retry_s=5, min_interval_s=1, clock=lambda: reads.now)

    async def run() -> None:
        assert (await store.keys(REF)).keys == (OLD,) and reads.count == 1
        reads.now = 10
        await store.keys(REF)
        assert reads.count == 1  # within the ttl
        reads.value = EngineKeys((OLD, NEW))  # rotated: the new key added
        store.refused(REF, "pod-1", OLD)  # the read was 10 s old: the next request reads again
        keys = await store.keys(REF)
        assert reads.count == 2 and store.order(REF, keys, "pod-1", frozenset({OLD})) == (NEW,)
        store.worked(REF, "pod-1", NEW)
        assert store.order(REF, keys, "pod-1") == (NEW, OLD) and store.order(REF, keys, "pod-2") == (OLD, NEW)
        store.refused(REF, "pod-1", NEW)  # a refusal right after a read: not read again within min_interval_s
        assert store.order(REF, await store.keys(REF), "pod-1") == (OLD, NEW) and reads.count == 2
        reads.now = 11.5
        await store.keys(REF)
        assert reads.count == 3
        reads.now = 50
        await store.keys(REF)
        assert reads.count == 4  # the ttl ran out

    asyncio.run(run())


def test_replicas_that_take_different_keys_each_get_theirs() -> None:
    """After a rotation a vLLM pod started before it takes the old key only, one started after the new only."""
    reads = Reads(EngineKeys((OLD,)))
    store = EngineKeyStore(reads.read, clock=lambda: reads.now)

    async def run() -> None:
        store.worked(REF, "old-pod", OLD)
        reads.now, reads.value = 100, EngineKeys((NEW,))  # the Secret rotated; the old key is gone from it
        keys = await store.keys(REF)
        assert store.order(REF, keys, "old-pod") == (OLD, NEW)
        assert store.order(REF, keys, "new-pod") == (NEW, OLD)  # the Secret's first, then what works elsewhere
        store.worked(REF, "new-pod", NEW)
        assert store.order(REF, keys, "old-pod")[0] == OLD and store.order(REF, keys, "new-pod")[0] == NEW
        store.refused(REF, "old-pod", OLD)  # that pod restarted under the same name with the new key
        assert store.order(REF, keys, "old-pod") == (NEW,)
        assert store.has_candidates(REF, EngineKeys(problem="gone"))  # a key that works needs no read

    asyncio.run(run())


def test_a_failed_read_is_tried_again_sooner_and_concurrent_requests_read_once() -> None:
    reads = Reads(EngineKeys(problem="Secret team-a/chat-keys: no such Secret"))
    store = EngineKeyStore(reads.read, ttl_s=30, retry_s=5, clock=lambda: reads.now)

    async def run() -> None:
        got = await asyncio.gather(*(store.keys(REF) for _ in range(8)))
        assert reads.count == 1 and all(g.problem for g in got)
        reads.now, reads.value = 6, EngineKeys((NEW,))
        assert (await store.keys(REF)).keys == (NEW,) and reads.count == 2

    asyncio.run(run())


def test_a_failed_read_after_a_good_one_keeps_the_keys_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    reads = Reads(EngineKeys((OLD,)))
    store = EngineKeyStore(reads.read, ttl_s=30, retry_s=5, clock=lambda: reads.now)

    async def run() -> None:
        await store.keys(REF)
        reads.now, reads.value = 31, EngineKeys(problem="Secret team-a/chat-keys: the API server answered 500")
        assert (await store.keys(REF)).keys == (OLD,) and reads.count == 2
        reads.now = 37
        assert (await store.keys(REF)).keys == (OLD,) and reads.count == 3  # read again after retry_s
        reads.now, reads.value = 43, EngineKeys((NEW,))
        assert (await store.keys(REF)).keys == (NEW,)

    with caplog.at_level("INFO", logger="kvfleet.gateway.engine_keys"):
        asyncio.run(run())
    assert [r.getMessage() for r in caplog.records] == ["engine key unavailable", "engine key available again"]
    assert OLD not in caplog.text and NEW not in caplog.text


def test_a_model_deployments_api_key_secret_ref_reaches_its_model_ref() -> None:
    tenant = {"metadata": {"name": "team-a"}, "spec": {"namespaces": ["team-a"]}, "status": {"namespaces": ["team-a"]}}

    def mdep(name: str, kind: str, ref: dict[str, str] | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"model": {"source": "org/m", "servedName": name}, "engine": {"kind": kind}}
        if ref is not None:
            spec["apiKeySecretRef"] = ref
        return {"metadata": {"namespace": "team-a", "name": name}, "spec": spec}

    snap = build_snapshot([tenant], [mdep("a", "kvfleet", {"name": "a-keys", "key": "keys.yaml"}),
                                     mdep("b", "vllm", {"name": "b-key"}), mdep("c", "kvfleet", None)], [], [], "keys")
    refs = {m.deployment: m.engine_key for _, m in snap.catalog.models("team-a")}
    assert refs == {"a": EngineKeyRef("team-a", "a-keys", "keys.yaml", "kvfleet"),
                    "b": EngineKeyRef("team-a", "b-key", "api-key", "vllm"), "c": None}


def test_a_static_config_gives_a_models_engine_key() -> None:
    config = {"tenants": {"team-a": {"keys": ["team-a-key-0123456789"], "models": {
        "locked": {"replicas": ["http://127.0.0.1:9"], "apiKey": OLD}, "open": {"replicas": []}}}}}
    snap = static_snapshot(config)
    (ref,) = [m.engine_key for _, m in snap.catalog.models("team-a") if m.engine_key]
    assert static_engine_keys(config) == {ref: OLD}
    config["tenants"]["team-a"]["models"]["locked"]["apiKey"] = 7
    with pytest.raises(StaticConfigError, match="locked.apiKey: expected a non-empty string"):
        static_snapshot(config)
