"""The other gateway replicas' usage per tenant, read from their `/usage` (what `limits` adds to our own).

Peers are the other replicas' metrics listeners: in a cluster, the Ready pods matching `--peer-selector`
in the gateway's namespace (their `metrics` port; the pod itself left out by `POD_NAME`); outside one,
`--peers URL,...`. Each is read every `interval` seconds; a report older than `stale_after` (a peer
gone or unreachable) no longer counts. With `KVFLEET_LOOPBACK_ONLY=1` only loopback peers are read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import aiohttp

from kvfleet.gateway.limits import TenantUsage

log = logging.getLogger("kvfleet.gateway.peers")


class PeerView:
    """The last report of each peer, aged to now when read (state, clock injected)."""

    def __init__(self, stale_after: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self._reports: dict[str, tuple[float, dict[str, TenantUsage]]] = {}

    def update(self, peer: str, report: dict[str, TenantUsage]) -> None:
        self._reports[peer] = (self.clock(), report)

    def keep_only(self, peers: Sequence[str]) -> None:
        for peer in [p for p in self._reports if p not in peers]:
            del self._reports[peer]

    def fresh(self) -> list[str]:
        now = self.clock()
        return sorted(p for p, (t, _) in self._reports.items() if now - t <= self.stale_after)

    def usages(self, tenant: str) -> list[TenantUsage]:
        now = self.clock()
        out = []
        for read_at, report in self._reports.values():
            usage = report.get(tenant)
            if usage is not None and now - read_at <= self.stale_after:
                out.append(usage.aged(now - read_at))
        return out


def parse_report(body: Any) -> dict[str, TenantUsage]:
    tenants = body.get("tenants") if isinstance(body, dict) else None
    if not isinstance(tenants, dict):
        raise ValueError("no `tenants` mapping")
    return {str(t): TenantUsage.from_json(u) for t, u in tenants.items() if isinstance(u, dict)}


class PeerSync:
    def __init__(self, view: PeerView, peers: Callable[[], Sequence[str]], allow_host: Callable[[str], bool],
                 interval: float = 0.5, timeout: float = 1.0) -> None:
        self.view = view
        self.peers = peers
        self.allow_host = allow_host
        self.interval = interval
        self.timeout = timeout

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
            while True:
                peers = [p for p in self.peers() if self.allow_host(urlsplit(p).hostname or "")]
                self.view.keep_only(peers)
                await asyncio.gather(*(self._one(session, p) for p in peers))
                await asyncio.sleep(self.interval)

    async def _one(self, session: aiohttp.ClientSession, peer: str) -> None:
        try:
            async with session.get(peer + "/usage") as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                self.view.update(peer, parse_report(await resp.json(content_type=None)))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.debug("peer not read", extra={"peer": peer, "error": str(exc)[:200]})
