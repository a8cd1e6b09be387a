"""The gateway's demand signal: requests waiting here per ModelDeployment, written onto it for the autoscaler.

The dispatcher reports how many requests wait for each model (held while it is at zero, or queued while
every replica is saturated); this writes `gateway.kvfleet.dev/demand` = `{"waiting": N, "at": t}`
on the ModelDeployment (`kvfleet.operator.autoscaler.demand` reads it): at once when the count changes
(coalesced, at most one write per model per `min_interval`), again every `refresh` seconds while it is
above zero (the autoscaler ignores a value older than 30 s, so a gateway that dies stops waking models),
and 0 once when nothing waits any more. With several gateway replicas the last writer wins: the count is a
lower bound of the demand, and any replica's waiting request wakes a model at zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp

from kvfleet.gateway.kube import KubeClient, KubeError
from kvfleet.operator.autoscaler.demand import demand_value
from kvfleet.operator.constants import API_VERSION, GATEWAY_DEMAND_ANNOTATION, MDEP_PLURAL

log = logging.getLogger("kvfleet.gateway.demand")

REFRESH_S = 10.0


@dataclass(frozen=True)
class Written:
    waiting: int
    at: float


def due(last: Written | None, waiting: int, now: float, refresh: float = REFRESH_S) -> bool:
    """Whether the annotation must be (re)written for `waiting` requests now."""
    if last is None:
        return waiting > 0  # nothing written yet and nothing waits: leave the object alone
    if waiting != last.waiting:
        return True
    return waiting > 0 and now - last.at >= refresh


class DemandWriter:
    def __init__(self, client: KubeClient, min_interval: float = 0.5, refresh: float = REFRESH_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.min_interval = min_interval
        self.refresh = refresh
        self.clock = clock
        self._waiting: dict[tuple[str, str], int] = {}
        self._written: dict[tuple[str, str], Written] = {}
        self._wake = asyncio.Event()

    def note(self, namespace: str, deployment: str, waiting: int) -> None:
        """The dispatcher's report: `waiting` requests wait here for the ModelDeployment (cheap; no I/O)."""
        key = (namespace, deployment)
        if self._waiting.get(key) != waiting:
            self._waiting[key] = waiting
            self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.refresh / 2)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.write_due()
            await asyncio.sleep(self.min_interval)

    async def write_due(self) -> None:
        now = self.clock()
        for key, waiting in list(self._waiting.items()):
            if not due(self._written.get(key), waiting, now, self.refresh):
                if waiting == 0 and key not in self._written:
                    self._waiting.pop(key, None)
                continue
            namespace, name = key
            path = f"/apis/{API_VERSION}/namespaces/{namespace}/{MDEP_PLURAL}/{name}"
            body = {"metadata": {"annotations": {GATEWAY_DEMAND_ANNOTATION: demand_value(waiting, now)}}}
            try:
                await self.client.merge_patch(path, body)
            except (KubeError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:  # the next round retries
                log.warning("gateway demand not written", extra={"mdep": f"{namespace}/{name}", "error": str(exc)})
                continue
            log.debug("gateway demand written", extra={"mdep": f"{namespace}/{name}", "waiting": waiting})
            if waiting == 0:
                self._written.pop(key, None)
                if self._waiting.get(key) == 0:
                    self._waiting.pop(key, None)
            else:
                self._written[key] = Written(waiting, now)
