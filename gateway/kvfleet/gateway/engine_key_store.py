"""The engine keys the gateway sends, read when a request needs them (I/O at the edge; `engine_keys` decides).

In a cluster the gateway reads the one Secret a ModelDeployment's `spec.apiKeySecretRef` names, with a GET:
its RBAC lists and watches Secrets of its key namespace only, so each engine key Secret is granted to it by
name (`get` on that Secret, a Role in the model's namespace; docs/gateway.md). A read is kept `ttl_s`; a failed
one `retry_s`, keeping the keys of the last good read if there was one. An engine's 401 ends a read early, so
the next request reads the Secret again (at most once every `min_interval_s`). A problem is logged when it
starts and when it ends, never with a key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

import aiohttp

from kvfleet.gateway.engine_keys import EngineKeyRef, EngineKeys, engine_keys, key_order
from kvfleet.gateway.kube import KubeClient, KubeError

log = logging.getLogger("kvfleet.gateway.engine_keys")

Reader = Callable[[EngineKeyRef], Awaitable[EngineKeys]]
MAX_REPLICAS_KEPT = 256  # per model: which key worked where (pods come and go under new names)


@dataclass
class _Read:
    keys: EngineKeys
    read_at: float
    expires_at: float


class EngineKeyStore:
    def __init__(self, read: Reader, ttl_s: float = 30.0, retry_s: float = 5.0, min_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self.ttl_s, self.retry_s, self.min_interval_s = ttl_s, retry_s, min_interval_s
        self._clock = clock
        self._reads: dict[EngineKeyRef, _Read] = {}
        self._locks: dict[EngineKeyRef, asyncio.Lock] = {}
        self._worked: dict[EngineKeyRef, dict[str, str]] = {}  # replica -> the key that last worked there
        self._problems: dict[EngineKeyRef, str] = {}  # the last read's problem, logged once

    async def keys(self, ref: EngineKeyRef) -> EngineKeys:
        """The engine's candidate keys (or the problem), read again once the last read has expired."""
        cached = self._reads.get(ref)
        if cached is not None and self._clock() < cached.expires_at:
            return cached.keys
        async with self._locks.setdefault(ref, asyncio.Lock()):  # one read at a time per Secret
            cached = self._reads.get(ref)
            if cached is not None and self._clock() < cached.expires_at:
                return cached.keys
            read = await self._read(ref)
            now = self._clock()
            if read.problem and read.problem != self._problems.get(ref):
                log.warning("engine key unavailable", extra={"problem": read.problem})
            elif not read.problem and ref in self._problems:
                log.info("engine key available again", extra={"secret": ref.where})
            if read.problem:
                self._problems[ref] = read.problem
            else:
                self._problems.pop(ref, None)
            # The engine decides whether a key is good: a failed read (the API server away, the grant or the
            # Secret gone) keeps the last keys read, and is tried again sooner.
            keys = cached.keys if read.problem and cached is not None and cached.keys.keys else read
            self._reads[ref] = _Read(keys, now, now + (self.retry_s if read.problem else self.ttl_s))
            return keys

    def order(self, ref: EngineKeyRef, keys: EngineKeys, replica: str,
              tried: frozenset[str] = frozenset()) -> tuple[str, ...]:
        """The keys to send `replica`, untried ones: the one that worked there, the Secret's, others' that work."""
        worked = self._worked.get(ref, {})
        return key_order(keys.keys, worked.get(replica), reversed(worked.values()), tried)

    def has_candidates(self, ref: EngineKeyRef, keys: EngineKeys) -> bool:
        """Any key at all to send (the Secret's, or one that works on a replica)."""
        return bool(keys.keys or self._worked.get(ref))

    def worked(self, ref: EngineKeyRef, replica: str, key: str) -> None:
        worked = self._worked.setdefault(ref, {})
        worked.pop(replica, None)
        worked[replica] = key  # the latest last: replicas long gone fall out first
        while len(worked) > MAX_REPLICAS_KEPT:
            del worked[next(iter(worked))]

    def refused(self, ref: EngineKeyRef, replica: str, key: str) -> None:
        """`replica` answered 401 to `key`: prefer it there no longer, and read the Secret again soon."""
        worked = self._worked.get(ref, {})
        if worked.get(replica) == key:
            del worked[replica]
        cached = self._reads.get(ref)
        if cached is not None:
            cached.expires_at = min(cached.expires_at, cached.read_at + self.min_interval_s)


def secret_reader(client: KubeClient) -> Reader:
    """Reads `ref`'s Secret from the API server."""

    async def read(ref: EngineKeyRef) -> EngineKeys:
        try:
            secret = await client.get(f"/api/v1/namespaces/{ref.namespace}/secrets/{ref.name}")
        except KubeError as exc:
            if exc.status == 403:
                return EngineKeys(problem=f"{ref.where}: the gateway may not read it (forbidden); grant its "
                                          f"ServiceAccount get on that Secret (a Role in {ref.namespace} with "
                                          f"resourceNames [{ref.name}])")
            if exc.status == 404:
                return EngineKeys(problem=f"{ref.where}: no such Secret")
            return EngineKeys(problem=f"{ref.where}: the API server answered {exc.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return EngineKeys(problem=f"{ref.where}: the API server did not answer ({exc.__class__.__name__})")
        return engine_keys(ref, secret.get("data"))

    return read


def fixed_reader(keys: Mapping[EngineKeyRef, str]) -> Reader:
    """Keys given in a static config: one per model."""

    async def read(ref: EngineKeyRef) -> EngineKeys:
        key = keys.get(ref)
        return EngineKeys((key,)) if key else EngineKeys(problem=f"{ref.where}: no key configured")

    return read
