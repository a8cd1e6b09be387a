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


def test_an_engine_wanting_its_own_key_gets_the_configured_one_and_never_the_clients(
        tmp_path: Path, locked_upstream: str) -> None:  # fmt: skip
    engine_key = "engine-own-key-0123456789"  # the one `locked_upstream` takes
    models = {"locked": {"replicas": [locked_upstream], "apiKey": engine_key},
              "wrong": {"replicas": [locked_upstream], "apiKey": "not-the-engines-key-0123"},
              "none": {"replicas": [locked_upstream]}}
    config = write_config(tmp_path / "gw.yaml", {"team-a": {"keys": [KEY_A], "models": models}})
    auth = {"Authorization": f"Bearer {KEY_A}"}
    with GatewayProcess(tmp_path / "gw.log", config=config) as gw:
        ok = httpx.post(gw.url + "/v1/completions", headers=auth, json={"model": "locked", "prompt": "x"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "x"
        with httpx.stream("POST", gw.url + "/v1/completions", headers=auth,
                          json={"model": "locked", "prompt": "x", "stream": True}) as resp:
            assert resp.status_code == 200 and list(resp.iter_lines())[-2] == "data: [DONE]"
        for model in ("wrong", "none"):  # the engine's 401 is the gateway's setup: a 502, never the client's 401
            resp = httpx.post(gw.url + "/v1/completions", headers=auth, json={"model": model, "prompt": "x"})
            error = resp.json()["error"]
            assert resp.status_code == 502 and error["code"] == "upstream_auth_required", resp.text
            assert KEY_A not in resp.text and engine_key not in resp.text
        assert gw.metric("kvfleet_gateway_request_errors_total", model="wrong", reason="upstream_auth") == 1
        assert gw.metric("kvfleet_gateway_requests_total", model="locked", code="200") == 2
        log = gw.log_tail(500)
    assert engine_key not in log and KEY_A not in log
