"""Before the cluster's state is in (here: an API server that does not answer), the gateway is alive but not
ready, and answers 503 rather than refusing valid keys it has not read yet."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import cast

import httpx
import yaml

from kvfleet.gateway.discovery import KubeSource
from kvfleet.gateway.kube import KubeClient
from kvfleet.gateway.snapshot import Snapshot
from kvfleet.gateway.testing import GatewayProcess, free_port, wait_until


def test_not_ready_until_the_cluster_state_is_listed(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": f"https://127.0.0.1:{free_port()}",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    gw = GatewayProcess(tmp_path / "gw.log", kubeconfig=str(kubeconfig)).start(wait=False)
    url = gw.url

    def alive() -> bool:
        try:
            return httpx.get(url + "/livez", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until("the gateway alive", alive, timeout=30)
        assert httpx.get(url + "/readyz").json()["error"]["code"] == "loading"
        resp = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer some-key-0123456789"})
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "2"
        wait_until("each list retried with back-off", lambda: gw.log_path.read_text().count("list/watch failed") >= 8,
                   timeout=30)
    finally:
        gw.stop()


def test_ready_only_once_a_snapshot_of_every_stream_is_in_place() -> None:
    """Every stream listed is not enough: until the rebuild after the last list the snapshot is the empty one, and
    a valid key got 401 (`make demo`: a request 50 ms after /readyz said ready). Ready means the built snapshot."""
    key = "team-a-key-0123456789"
    tenant = {"metadata": {"name": "team-a"}, "status": {"namespaces": ["team-a"]},
              "spec": {"namespaces": ["team-a"], "quotas": [{"flavor": "h200", "nominal": 1}],
                       "gateway": {"apiKeySecrets": [{"name": "a-keys"}]}}}
    secret = {"metadata": {"namespace": "kvfleet-system", "name": "a-keys"},
              "data": {"k": base64.b64encode(key.encode()).decode()}}

    async def scenario() -> None:
        published: list[Snapshot] = []
        src = KubeSource(cast(KubeClient, None), "kvfleet-system", published.append, debounce_s=0.01)
        rebuild = asyncio.create_task(src._rebuild_loop())
        try:
            src.tenants.items, src.secrets.items = {"team-a": tenant}, {"kvfleet-system/a-keys": secret}
            for informer in (src.tenants, src.mdeps, src.pods):
                informer.synced.set()
                informer.on_change()
            await asyncio.sleep(0.1)   # a rebuild pass with the Secrets not listed yet builds nothing
            assert not src.synced and not published
            src.secrets.synced.set()   # every stream listed; the snapshot is still the empty one
            assert not src.synced and src.snapshot.keys.tenant_for(key) is None
            src.secrets.on_change()
            for _ in range(500):
                if src.synced:
                    break
                await asyncio.sleep(0.01)
            assert src.synced and src.snapshot.keys.tenant_for(key) == "team-a" and published == [src.snapshot]
        finally:
            rebuild.cancel()

    asyncio.run(scenario())
