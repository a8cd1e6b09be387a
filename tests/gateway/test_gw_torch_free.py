"""The gateway imports and serves with torch (and the engine's FastAPI/uvicorn server) unimportable:
its image installs `.[operator,gateway]` only."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from kvfleet.gateway.testing import GatewayProcess

from gw_helpers import KEY_A, write_config

BLOCK = ("import sys\n"
         "class Block:\n"
         "    def find_spec(self, name, path=None, target=None):\n"
         "        if name.split('.')[0] in {'torch', 'triton', 'transformers', 'fastapi', 'uvicorn', 'starlette'}:\n"
         "            raise ImportError(f'{name} is not importable here')\n"
         "sys.meta_path.insert(0, Block())\n"
         "from kvfleet.gateway.main import main\n"
         "raise SystemExit(main())\n")


def test_gateway_serves_with_torch_unimportable(tmp_path: Path, fast_upstream: str) -> None:
    config = write_config(tmp_path / "gw.yaml", {"team-a": {"keys": [KEY_A], "models": {
        "fast": {"replicas": [fast_upstream]}}}})
    gw = GatewayProcess(tmp_path / "gw.log", config=config, python=[sys.executable, "-c", BLOCK])
    with gw:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        assert httpx.get(gw.url + "/v1/models", headers=auth).json()["data"][0]["id"] == "fast"
        assert httpx.get(gw.url + "/v1/models").status_code == 401
        bad = httpx.post(gw.url + "/v1/completions", headers=auth, json={"model": "fast", "prompt": "x", "n": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
        ok = httpx.post(gw.url + "/v1/completions", headers=auth, json={"model": "fast", "prompt": "x"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "x"
        with httpx.stream("POST", gw.url + "/v1/completions", headers=auth,
                          json={"model": "fast", "prompt": "x", "stream": True}) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data:")]
        assert len(events) == 4 and events[-1] == "data: [DONE]"  # 3 tokens; the usage chunk it added is dropped
    assert "is not importable here" not in gw.log_tail(200)


def test_an_engine_wanting_its_own_key_is_a_502_not_the_clients_401(tmp_path: Path, locked_upstream: str) -> None:
    config = write_config(tmp_path / "gw.yaml", {"team-a": {"keys": [KEY_A], "models": {
        "locked": {"replicas": [locked_upstream]}}}})
    with GatewayProcess(tmp_path / "gw.log", config=config) as gw:
        resp = httpx.post(gw.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                          json={"model": "locked", "prompt": "x"})
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_auth_required"
