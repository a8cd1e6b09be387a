"""Flags and environment, the static source, kubeconfig credentials: errors name what is wrong."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfleet.gateway.config import build_parser, config_from_args, parse_config
from kvfleet.gateway.static import StaticConfigError, static_snapshot
from kvfleet.operator.credentials import load as load_credentials

KEY = "team-a-key-0123456789"


def test_flags_env_and_defaults() -> None:
    cfg = parse_config(["--routing", "round-robin"], env={"KVFLEET_GATEWAY_PORT": "9000", "POD_NAMESPACE": "kv",
                                                          "KVFLEET_LOOPBACK_ONLY": "1"})
    assert (cfg.port, cfg.routing.policy, cfg.keys_namespace, cfg.loopback_only) == (9000, "round-robin", "kv", True)
    cfg = parse_config([], env={})
    assert (cfg.port, cfg.metrics_host, cfg.keys_namespace, cfg.routing.load_factor) == (8080, "127.0.0.1",
                                                                                          "kvfleet-system", 1.25)


@pytest.mark.parametrize("argv, message", [
    (["--load-factor", "0.5"], "--load-factor"), (["--kv-high", "1.5"], "--kv-high"), (["--port", "0"], "--port"),
    (["--read-timeout", "0"], "--read-timeout"), (["--prefix-block-chars", "0"], "--prefix-block-chars")])
def test_bad_flags_name_the_flag(argv: list[str], message: str) -> None:
    args = build_parser({}).parse_args(argv)
    with pytest.raises(ValueError, match=message):
        config_from_args(args, {})


def test_a_bad_environment_value_names_the_variable() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvfleet.gateway.main", "--help"], capture_output=True, text=True,
                          env={"KVFLEET_GATEWAY_PORT": "eighty", "PATH": ""}, check=False)
    assert proc.returncode != 0 and "KVFLEET_GATEWAY_PORT='eighty' is invalid" in proc.stderr


def test_static_config_and_its_errors() -> None:
    snap = static_snapshot({"tenants": {"t": {"keys": [KEY], "models": {"m": {"replicas": ["http://127.0.0.1:1"]}}}}})
    assert snap.keys.tenant_for(KEY) == "t" and snap.ready_replicas("t/m")[0].host == "127.0.0.1"
    for bad, message in (({"tenants": []}, "tenants: expected a mapping"),
                         ({"tenants": {"t": {"keys": "k"}}}, "keys: expected a list"),
                         ({"tenants": {"t": {"keys": ["short"]}}}, "shorter than 16"),
                         ({"tenants": {"t": {"models": {"m": {"replicas": ["ftp://x"]}}}}}, "expected http://")):
        with pytest.raises(StaticConfigError, match=message):
            static_snapshot(bad)


def test_no_credentials_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="pass --kubeconfig or set KUBECONFIG"):
        load_credentials(None)
