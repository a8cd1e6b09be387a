"""Before the cluster's state is in (here: an API server that does not answer), the gateway is alive but not
ready, and answers 503 rather than refusing valid keys it has not read yet."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

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
