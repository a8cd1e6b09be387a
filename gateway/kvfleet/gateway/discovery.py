"""The snapshot from the API server, kept current by watches (I/O at the edge, `cluster_view` decides).

Four list+watch streams: Tenants, ModelDeployments (all namespaces), engine Pods (all namespaces,
labelled with their ModelDeployment) and Secrets of the key namespace only; a fifth, with a peer
selector, for the other gateway replicas' pods in the gateway's own namespace (shared limits). Each
change marks the snapshot dirty; one task rebuilds it after a short pause, so a burst of pod updates is
one rebuild.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from kvfleet.gateway.cluster_view import build_snapshot, peer_urls
from kvfleet.gateway.engine_key_store import EngineKeyStore, secret_reader
from kvfleet.gateway.kube import Informer, KubeClient
from kvfleet.gateway.replicas import LABEL_MDEP
from kvfleet.gateway.snapshot import Snapshot

log = logging.getLogger("kvfleet.gateway.discovery")

API = "/apis/serving.kvfleet.dev/v1alpha1"


@dataclass(frozen=True)
class PeerWatch:
    """Where the other gateway replicas are: pods of `namespace` matching `selector`, `self_name` left out."""

    namespace: str
    selector: str
    self_name: str | None = None


class KubeSource:
    def __init__(self, client: KubeClient, keys_namespace: str, on_snapshot: Callable[[Snapshot], None],
                 debounce_s: float = 0.05, peers: PeerWatch | None = None) -> None:
        self.client = client
        self.keys_namespace = keys_namespace
        self.on_snapshot = on_snapshot
        self.debounce_s = debounce_s
        self.snapshot = Snapshot()
        self.engine_keys = EngineKeyStore(secret_reader(client))  # engines' own keys: read by name, not watched
        self._dirty = asyncio.Event()
        self._problems: tuple[str, ...] = ()
        mark = self._dirty.set
        self.tenants = Informer(client, f"{API}/tenants", mark)
        self.mdeps = Informer(client, f"{API}/modeldeployments", mark)
        self.pods = Informer(client, "/api/v1/pods", mark, {"labelSelector": LABEL_MDEP})
        self.secrets = Informer(client, f"/api/v1/namespaces/{keys_namespace}/secrets", mark)
        self.peer_watch = peers
        self.peers = Informer(client, f"/api/v1/namespaces/{peers.namespace}/pods", mark,
                              {"labelSelector": peers.selector}) if peers else None
        self._informers = (self.tenants, self.mdeps, self.pods, self.secrets) + ((self.peers,) if self.peers else ())
        self._published = False

    @property
    def synced(self) -> bool:
        """Ready to serve: a snapshot built after every stream's first list is in place. (Every stream listed is
        not enough: until the rebuild after the last list, `snapshot` is the empty one, and a valid key got 401.)"""
        return self._published

    def _listed(self) -> bool:
        return all(i.synced.is_set() for i in self._informers)

    async def run(self) -> None:
        await asyncio.gather(*(i.run() for i in self._informers), self._rebuild_loop())

    async def close(self) -> None:
        await self.client.close()

    async def _rebuild_loop(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.debounce_s)
            self._dirty.clear()
            if not self._listed():
                continue
            peers = peer_urls(self.peers.items.values(), self.peer_watch.self_name) \
                if self.peers is not None and self.peer_watch is not None else ()
            snap = build_snapshot(self.tenants.items.values(), self.mdeps.items.values(), self.pods.items.values(),
                                  self.secrets.items.values(), self.keys_namespace, peers)
            for problem in sorted(set(snap.problems) - set(self._problems)):
                log.warning("api keys: %s", problem)
            self._problems = snap.problems
            self.snapshot = snap
            self._published = True
            self.on_snapshot(snap)
