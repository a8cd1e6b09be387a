"""Credentials for the API server (I/O at the edges): a pod's service account, else a kubeconfig's current context.

The operator and the gateway both read them here, so the control-plane image needs no Kubernetes client library
(its generated models were about a third of the image). Covered: in-cluster (the token file re-read as the kubelet
rotates it), and from a kubeconfig: server, CA (file or data) or insecure-skip-tls-verify, client certificate and
key (file or data), a token or token file, and exec plugins (client.authentication.k8s.io ExecCredential: EKS's,
GKE's and kubelogin's, a token cached until it expires). The legacy `auth-provider` entries are refused by name.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import yaml

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_S = 60.0          # bound service account tokens rotate; re-read the file at most this often
EXEC_REFRESH_MARGIN_S = 60.0   # run an exec plugin again this long before its token expires
EXEC_DEFAULT_TTL_S = 600.0     # a plugin's token without an expiry: run it again after this long
EXEC_TIMEOUT_S = 60.0



class TokenSource(Protocol):
    """The bearer token now (None: none); `forget` after the server refused it (401), so the next call reads the
    file or runs the plugin again instead of sending the refused token until it would have expired. `forget`
    says whether the next call may give another token (a kubeconfig's literal one never does: not worth a retry)."""

    def __call__(self) -> str | None: ...

    def forget(self) -> bool: ...


class StaticToken:
    """A kubeconfig's literal token, or none (client certificates only)."""

    def __init__(self, value: str | None) -> None:
        self.value = value

    def __call__(self) -> str | None:
        return self.value

    def forget(self) -> bool:
        """Nothing to read again: the kubeconfig's token is what it is."""
        return False


class CredentialsError(ValueError):
    """No usable credentials, or a kubeconfig this module cannot use: says which and why."""


@dataclass(frozen=True)
class Credentials:
    server: str                    # https://host:port, no trailing slash
    ca_pem: str | None             # the cluster's CA bundle (PEM); None: the system's CAs
    insecure: bool                 # insecure-skip-tls-verify
    client_cert_pem: bytes | None
    client_key_pem: bytes | None
    token: TokenSource             # the bearer token now (None: none)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cadata=self.ca_pem) if self.ca_pem else ssl.create_default_context()
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.client_cert_pem and self.client_key_pem:
            with tempfile.TemporaryDirectory() as tmp:   # ssl loads a certificate chain from files only
                cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
                cert.write_bytes(self.client_cert_pem)
                key.touch(mode=0o600)
                key.write_bytes(self.client_key_pem)
                ctx.load_cert_chain(str(cert), str(key))
        return ctx


class TokenFile:
    """A token file, read again at most every TOKEN_REREAD_S."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._value: str | None = None
        self._read_at = 0.0

    def __call__(self) -> str | None:
        now = self._clock()
        if self._value is None or now - self._read_at > TOKEN_REREAD_S:
            self._value = self.path.read_text().strip()
            self._read_at = now
        return self._value

    def forget(self) -> bool:
        self._value = None
        return True


class ExecToken:
    """A kubeconfig's exec plugin: run it for an ExecCredential, keep its token until shortly before it expires."""

    def __init__(self, spec: Mapping[str, Any], base: Path, clock: Callable[[], float] = time.time) -> None:
        command = str(spec.get("command") or "")
        if not command:
            raise CredentialsError("exec: no command")
        if os.sep in command and not os.path.isabs(command):
            command = str(base / command)   # relative to the kubeconfig, as kubectl resolves it
        self.argv = [command, *(str(a) for a in spec.get("args") or ())]
        self.env = {str(e["name"]): str(e["value"]) for e in spec.get("env") or ()}
        self.api_version = str(spec.get("apiVersion") or "client.authentication.k8s.io/v1")
        self.hint = str(spec.get("installHint") or "")
        self._clock = clock
        self._token: str | None = None
        self._valid_until = 0.0

    def __call__(self) -> str | None:
        if self._token is None or self._clock() >= self._valid_until:
            self._token, self._valid_until = self._run()
        return self._token

    def forget(self) -> bool:
        self._token = None
        return True

    def _run(self) -> tuple[str, float]:
        if shutil.which(self.argv[0]) is None:
            raise CredentialsError(f"exec: {self.argv[0]!r} not found" + (f" ({self.hint})" if self.hint else ""))
        info = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(info)}
        proc = subprocess.run(self.argv, env=env, capture_output=True, text=True, timeout=EXEC_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
        if proc.returncode != 0:
            raise CredentialsError(f"exec: {self.argv[0]} exited {proc.returncode}: {proc.stderr.strip()[:300]}")
        return exec_credential_token(proc.stdout, self._clock())


def exec_credential_token(stdout: str, now: float) -> tuple[str, float]:
    """(token, valid until) from an exec plugin's ExecCredential; pure."""
    try:
        status = (json.loads(stdout) or {}).get("status") or {}
    except (json.JSONDecodeError, AttributeError) as exc:
        raise CredentialsError(f"exec: the plugin's output is no ExecCredential: {exc}") from None
    token = status.get("token")
    if not token:
        raise CredentialsError("exec: the ExecCredential has no token (client certificates from exec plugins are "
                               "not supported)")
    expiry = status.get("expirationTimestamp")
    if not expiry:
        return str(token), now + EXEC_DEFAULT_TTL_S
    expires = datetime.fromisoformat(str(expiry).replace("Z", "+00:00")).timestamp()
    return str(token), max(now, expires - EXEC_REFRESH_MARGIN_S)


def in_cluster() -> Credentials | None:
    """The pod's service account, or None outside a pod."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port or not (SA_DIR / "token").exists():
        return None
    host = f"[{host}]" if ":" in host else host
    return Credentials(f"https://{host}:{port}", (SA_DIR / "ca.crt").read_text(), False, None, None,
                       TokenFile(SA_DIR / "token"))


def _data_or_file(entry: Mapping[str, Any], name: str, base: Path) -> bytes | None:
    if entry.get(f"{name}-data"):
        return base64.b64decode(entry[f"{name}-data"])
    if entry.get(name):
        return (base / str(entry[name])).read_bytes()
    return None


def from_kubeconfig(path: str) -> Credentials:
    """The current context of the kubeconfig at `path`."""
    base = Path(path).resolve().parent
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CredentialsError(f"{path}: {exc}") from None
    contexts = {c["name"]: c.get("context") or {} for c in config.get("contexts") or ()}
    context = contexts.get(config.get("current-context", ""))
    if context is None:
        raise CredentialsError(f"{path}: no current-context")
    cluster = {c["name"]: c.get("cluster") or {} for c in config.get("clusters") or ()}.get(context.get("cluster"))
    user = {u["name"]: u.get("user") or {} for u in config.get("users") or ()}.get(context.get("user"), {})
    if not cluster or not cluster.get("server"):
        raise CredentialsError(f"{path}: the current context names no cluster with a server")
    if user.get("auth-provider"):
        raise CredentialsError(f"{path}: auth-provider credentials are not supported (use an exec plugin)")
    ca = _data_or_file(cluster, "certificate-authority", base)
    token: TokenSource
    if user.get("tokenFile") and not user.get("token"):
        token = TokenFile(base / str(user["tokenFile"]))
    elif user.get("exec") and not user.get("token"):
        token = ExecToken(user["exec"], base)
    else:
        token = StaticToken(str(user["token"]) if user.get("token") else None)
    return Credentials(str(cluster["server"]).rstrip("/"), ca.decode() if ca else None,
                       bool(cluster.get("insecure-skip-tls-verify")),
                       _data_or_file(user, "client-certificate", base), _data_or_file(user, "client-key", base),
                       token)


# `kvfleet operator --kubeconfig F` hands F to the handlers kopf calls (login, the operator's own client) here.
EXPLICIT_KUBECONFIG_ENV = "KVFLEET_KUBECONFIG"


def load(kubeconfig: str | None = None) -> Credentials:
    """`kubeconfig` if given (else $KVFLEET_KUBECONFIG); else the pod's service account; else $KUBECONFIG."""
    kubeconfig = kubeconfig or os.environ.get(EXPLICIT_KUBECONFIG_ENV) or None
    if not kubeconfig:
        found = in_cluster()
        if found is not None:
            return found
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if not path:
        raise CredentialsError("not in a pod and no kubeconfig: pass --kubeconfig or set KUBECONFIG")
    return from_kubeconfig(path.split(os.pathsep)[0])
