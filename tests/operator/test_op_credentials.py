"""Credentials for the API server without a Kubernetes client library (kvfleet.operator.credentials): kubeconfig
contexts (token, token file, client certificate, CA data or file, insecure), exec plugins run for real, the pod's
service account, and what is refused with a clear error. e2e/test_operator_credentials.py uses them against a real
API server."""
from __future__ import annotations

import base64
import json
import os
import ssl
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.operator import credentials
from kvfleet.operator.credentials import (
    EXEC_DEFAULT_TTL_S,
    EXEC_REFRESH_MARGIN_S,
    CredentialsError,
    ExecToken,
    TokenFile,
    exec_credential_token,
    from_kubeconfig,
    load,
)


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files of a throwaway self-signed P-256 certificate (openssl, as the local cluster's)."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-subj", "/CN=kvfleet-test", "-days", "1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def kubeconfig(tmp: Path, cluster: dict[str, Any], user: dict[str, Any]) -> str:
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}},
                                             {"name": "other", "context": {"cluster": "x", "user": "y"}}],
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}]}))
    return str(path)


def test_token_and_ca_data(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    ca = base64.b64encode(cert.read_bytes()).decode()
    cluster = {"server": "https://127.0.0.1:6443/", "certificate-authority-data": ca}
    creds = from_kubeconfig(kubeconfig(tmp_path, cluster, {"token": "tok"}))
    assert (creds.server, creds.token(), creds.insecure) == ("https://127.0.0.1:6443", "tok", False)
    assert creds.ca_pem == cert.read_text()
    ctx = creds.ssl_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "kvfleet-test"),),)]


def test_client_certificate_files_relative_to_the_kubeconfig_and_insecure(tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    self_signed(tmp_path / "pki")
    creds = from_kubeconfig(kubeconfig(tmp_path, {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True},
                                       {"client-certificate": "pki/cert.pem", "client-key": "pki/key.pem"}))
    assert creds.client_cert_pem == (tmp_path / "pki/cert.pem").read_bytes() and creds.token() is None
    ctx = creds.ssl_context()   # loads the chain: a key that does not match the certificate would raise
    assert ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname


def test_token_file_is_read_again_after_a_while(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("one\n")
    now = [100.0]
    token = TokenFile(path, clock=lambda: now[0])
    assert token() == "one"
    path.write_text("two")
    assert token() == "one"   # cached
    now[0] += credentials.TOKEN_REREAD_S + 1
    assert token() == "two"
    path.write_text("three")
    token.forget()   # refused by the server: read again now
    assert token() == "three"


EXEC_PLUGIN = """#!{python}
import json, os, sys
from pathlib import Path
runs = Path(sys.argv[1])
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["kind"] == "ExecCredential" and info["spec"]["interactive"] is False, info
if os.environ.get("PLUGIN_FAIL"):
    sys.exit("denied: " + os.environ["PLUGIN_FAIL"])
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                  "status": {{"token": "exec-" + os.environ["PLUGIN_TOKEN"] + "-" + str(len(runs.read_text())),
                             "expirationTimestamp": "2099-01-01T00:00:00Z"}}}}))
"""


def write_plugin(tmp: Path) -> Path:
    (tmp / "bin").mkdir()
    plugin = tmp / "bin" / "kvfleet-test-plugin"
    plugin.write_text(EXEC_PLUGIN.format(python=sys.executable))
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    return plugin


def test_exec_plugin_runs_with_its_env_and_its_token_is_cached_until_it_expires(tmp_path: Path) -> None:
    write_plugin(tmp_path)
    runs = tmp_path / "runs"
    creds = from_kubeconfig(kubeconfig(tmp_path, {"server": "https://127.0.0.1:1"}, {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": "./bin/kvfleet-test-plugin",   # kubeconfig-relative
        "args": [str(runs)], "env": [{"name": "PLUGIN_TOKEN", "value": "abc"}]}}))
    assert creds.token() == "exec-abc-1" and creds.token() == "exec-abc-1"
    assert runs.read_text() == "x"   # ran once: its token expires in 2099
    # a fake clock past the expiry (less the margin) runs it again
    assert isinstance(creds.token, ExecToken)
    creds.token._clock = lambda: 4_070_908_800.0 - EXEC_REFRESH_MARGIN_S   # 2099-01-01 less the margin
    assert creds.token() == "exec-abc-2"
    creds.token._clock = lambda: 4_000_000_000.0   # well before the expiry: cached again
    assert creds.token() == "exec-abc-2"
    creds.token.forget()   # refused by the server before it expired: run the plugin again
    assert creds.token() == "exec-abc-3" and creds.token() == "exec-abc-3"


def test_exec_plugin_failures_are_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = write_plugin(tmp_path)
    monkeypatch.setenv("PLUGIN_FAIL", "no login")
    failing = ExecToken({"command": str(plugin), "args": [str(tmp_path / "runs")]}, tmp_path)
    with pytest.raises(CredentialsError, match="exited 1: denied: no login"):
        failing()
    missing = ExecToken({"command": "gke-gcloud-auth-plugin-absent", "installHint": "install the plugin"}, tmp_path)
    with pytest.raises(CredentialsError, match="not found \\(install the plugin\\)"):
        missing()


def test_exec_credential_parsing() -> None:
    assert exec_credential_token(json.dumps({"status": {"token": "t"}}), 10.0) == ("t", 10.0 + EXEC_DEFAULT_TTL_S)
    assert exec_credential_token(json.dumps({"status": {"token": "t", "expirationTimestamp":
                                                        "1970-01-01T00:10:00Z"}}), 0.0) == ("t", 540.0)
    with pytest.raises(CredentialsError, match="no token"):
        exec_credential_token(json.dumps({"status": {"clientCertificateData": "x"}}), 0.0)
    with pytest.raises(CredentialsError, match="no ExecCredential"):
        exec_credential_token("not json", 0.0)


def test_refused_kubeconfigs(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="auth-provider credentials are not supported"):
        from_kubeconfig(kubeconfig(tmp_path, {"server": "https://x"}, {"auth-provider": {"name": "gcp"}}))
    with pytest.raises(CredentialsError, match="names no cluster with a server"):
        from_kubeconfig(kubeconfig(tmp_path, {}, {"token": "t"}))
    (tmp_path / "empty").write_text("{}")
    with pytest.raises(CredentialsError, match="no current-context"):
        from_kubeconfig(str(tmp_path / "empty"))
    with pytest.raises(CredentialsError, match="No such file"):
        from_kubeconfig(str(tmp_path / "absent"))


def test_in_cluster_first_unless_a_kubeconfig_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, _ = self_signed(tmp_path)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token\n")
    (sa / "ca.crt").write_text(cert.read_text())
    monkeypatch.setattr(credentials, "SA_DIR", sa)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    path = kubeconfig(tmp_path, {"server": "https://127.0.0.1:6443"}, {"token": "kc"})
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([path, "/elsewhere"]))
    creds = load()
    assert (creds.server, creds.token(), creds.ca_pem) == ("https://[fd00::1]:443", "sa-token", cert.read_text())
    assert creds.ssl_context().verify_mode == ssl.CERT_REQUIRED
    assert load(path).token() == "kc"   # explicit wins
    monkeypatch.setenv(credentials.EXPLICIT_KUBECONFIG_ENV, path)   # `kvfleet operator --kubeconfig` in a pod
    assert load().token() == "kc"
    monkeypatch.delenv(credentials.EXPLICIT_KUBECONFIG_ENV)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert load().token() == "kc"       # not in a pod: $KUBECONFIG's first file
    monkeypatch.delenv("KUBECONFIG")
    with pytest.raises(CredentialsError, match="pass --kubeconfig or set KUBECONFIG"):
        load()


def test_no_kubernetes_client_library_is_needed() -> None:
    """The control-plane image does not install it: neither the operator's nor the gateway's modules import it."""
    code = ("import sys; sys.modules['kubernetes'] = None\n"
            "import kvfleet.operator.main, kvfleet.operator.kube, kvfleet.gateway.kube, kvfleet.gateway.main\n"
            "from kvfleet.operator.kube import Kube; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
