"""The engines' load, read from their /metrics every `interval` seconds (parse is pure; the loop is I/O).

Read: waiting and running requests and KV-cache use, named like vLLM's with the engine kind's prefix
(`kvfleet:` or `vllm:`; vLLM before v0.8 called the KV gauge `gpu_cache_usage_perc`). A replica that
cannot be read keeps no stale numbers: only the gateway's own in-flight count is left for it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

import aiohttp

from kvfleet.gateway.load import EngineLoad, LoadBoard
from kvfleet.gateway.replicas import Replica
from kvfleet.gateway.snapshot import Snapshot

log = logging.getLogger("kvfleet.gateway.scrape")


def parse_engine_load(text: str, engine_kind: str = "kvfleet") -> EngineLoad | None:
    """Waiting, running and KV use from Prometheus text, summed over label sets; None if the queue is missing."""
    prefix = "vllm:" if engine_kind == "vllm" else "kvfleet:"
    names = {prefix + "num_requests_waiting": "waiting", prefix + "num_requests_running": "running",
             prefix + "kv_cache_usage_perc": "kv", prefix + "gpu_cache_usage_perc": "kv"}
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = names.get(name)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        found[key] = (max if key == "kv" else sum)((found.get(key, 0.0), value))
    if "waiting" not in found or "running" not in found:
        return None
    return EngineLoad(found["waiting"], found["running"], found.get("kv"))


class Scraper:
    def __init__(self, board: LoadBoard, snapshot: Callable[[], Snapshot], allow_host: Callable[[str], bool],
                 interval: float = 1.0, timeout: float = 1.0, on_round: Callable[[], None] = lambda: None) -> None:
        self.board = board
        self.on_round = on_round  # after each round: engines may have room again for requests waiting
        self.snapshot = snapshot
        self.allow_host = allow_host
        self.interval = interval
        self.timeout = timeout

    def targets(self) -> Iterable[tuple[Replica, str]]:
        snap = self.snapshot()
        kinds = {m.key: m.engine_kind for models in snap.catalog.tenants.values() for _, m in models.listed}
        for key, replicas in snap.replicas.items():
            for replica in replicas:
                if self.allow_host(replica.host):
                    yield replica, kinds.get(key, "kvfleet")

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
            while True:
                await asyncio.gather(*(self._one(session, r, kind) for r, kind in self.targets()))
                self.on_round()
                await asyncio.sleep(self.interval)

    async def _one(self, session: aiohttp.ClientSession, replica: Replica, kind: str) -> None:
        ours = self.board.inflight(replica.name)
        try:
            async with session.get(replica.url + "/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            text = ""
        load = parse_engine_load(text, kind) if text else None
        if load is None:
            self.board.scrape_failed(replica.name)
        else:
            self.board.scraped(replica.name, load, ours)
