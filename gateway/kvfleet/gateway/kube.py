"""A small async door to the API server (I/O): credentials, and list + watch of one resource.

Credentials: in a pod, the service account (its token re-read as the kubelet rotates it); else a
kubeconfig's current context (server, CA, client certificate or token; exec plugins are not supported).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping

import aiohttp
import yaml

log = logging.getLogger("kvfleet.gateway.kube")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


@dataclass(frozen=True)
class KubeAuth:
    server: str
    ssl: ssl.SSLContext
    token: Callable[[], str | None]


class _TokenFile:
    """A token file read again at most once a minute (bound service account tokens rotate)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._value: str | None = None
        self._read_at = 0.0

    def __call__(self) -> str | None:
        now = time.monotonic()
        if self._value is None or now - self._read_at > 60:
            self._value = self.path.read_text().strip()
            self._read_at = now
        return self._value


def in_cluster_auth() -> KubeAuth | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port or not (SA_DIR / "token").exists():
        return None
    ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
    host = f"[{host}]" if ":" in host else host
    return KubeAuth(f"https://{host}:{port}", ctx, _TokenFile(SA_DIR / "token"))


def _data_or_file(entry: Mapping[str, Any], name: str, base: Path) -> bytes | None:
    if entry.get(f"{name}-data"):
        return base64.b64decode(entry[f"{name}-data"])
    if entry.get(name):
        return (base / str(entry[name])).read_bytes()
    return None


def kubeconfig_auth(path: str) -> KubeAuth:
    base = Path(path).resolve().parent
    config = yaml.safe_load(Path(path).read_text()) or {}
    contexts = {c["name"]: c.get("context") or {} for c in config.get("contexts") or ()}
    context = contexts.get(config.get("current-context", ""))
    if context is None:
        raise ValueError(f"{path}: no current-context")
    cluster = {c["name"]: c.get("cluster") or {} for c in config.get("clusters") or ()}.get(context.get("cluster"))
    user = {u["name"]: u.get("user") or {} for u in config.get("users") or ()}.get(context.get("user"), {})
    if not cluster or not cluster.get("server"):
        raise ValueError(f"{path}: the current context names no cluster with a server")
    if user.get("exec") or user.get("auth-provider"):
        raise ValueError(f"{path}: exec and auth-provider credentials are not supported by the gateway")
    ctx = ssl.create_default_context()
    ca = _data_or_file(cluster, "certificate-authority", base)
    if ca:
        ctx.load_verify_locations(cadata=ca.decode())
    if cluster.get("insecure-skip-tls-verify"):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    cert, key = _data_or_file(user, "client-certificate", base), _data_or_file(user, "client-key", base)
    if cert and key:
        with tempfile.TemporaryDirectory() as tmp:  # ssl loads a chain from files only
            cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert_path.write_bytes(cert)
            key_path.touch(mode=0o600)
            key_path.write_bytes(key)
            ctx.load_cert_chain(str(cert_path), str(key_path))
    token: Callable[[], str | None] = lambda: None  # noqa: E731
    if user.get("token"):
        value = str(user["token"])
        token = lambda: value  # noqa: E731
    elif user.get("tokenFile"):
        token = _TokenFile(base / str(user["tokenFile"]))
    return KubeAuth(str(cluster["server"]).rstrip("/"), ctx, token)


def load_auth(kubeconfig: str | None) -> KubeAuth:
    """In-cluster service account first, else `kubeconfig` or $KUBECONFIG."""
    auth = in_cluster_auth() if not kubeconfig else None
    if auth is not None:
        return auth
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if not path:
        raise ValueError("not in a pod and no kubeconfig: pass --kubeconfig or set KUBECONFIG")
    return kubeconfig_auth(path)


class KubeClient:
    def __init__(self, auth: KubeAuth) -> None:
        self.auth = auth
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        token = self.auth.token()
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.auth.ssl), trust_env=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def list(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        async with self.session().get(self.auth.server + path, params=dict(params), headers=self._headers(),
                                      timeout=aiohttp.ClientTimeout(total=60)) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, (await resp.text())[:300])
            return await resp.json()

    async def get(self, path: str) -> dict[str, Any]:
        """One object; KubeError carries the status (403: RBAC, 404: none)."""
        async with self.session().get(self.auth.server + path, headers=self._headers(),
                                      timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, (await resp.text())[:300])
            return await resp.json()

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        headers = {**self._headers(), "Content-Type": "application/merge-patch+json"}
        async with self.session().patch(self.auth.server + path, json=dict(body), headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, (await resp.text())[:300])
            return await resp.json()

    async def watch(self, path: str, params: Mapping[str, str], resource_version: str,
                    timeout_s: int = 300) -> AsyncIterator[dict[str, Any]]:
        """Events from `resource_version` until the server ends the watch; raises Gone on 410."""
        query = {**params, "watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(timeout_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s + 30)
        async with self.session().get(self.auth.server + path, params=query, headers=self._headers(),
                                      timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status >= 400:
                raise KubeError(resp.status, (await resp.text())[:300])
            pending = b""
            async for data in resp.content.iter_any():  # lines may be longer than aiohttp's line limit
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        if status.get("code") == 410:
                            raise Gone()
                        raise KubeError(int(status.get("code") or 500), str(status.get("message", "")))
                    yield event


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name')}"


def slim(obj: dict[str, Any]) -> dict[str, Any]:
    """What the gateway keeps of an object: no managedFields or annotations (a `kubectl apply`'d Secret
    carries its data again in the last-applied annotation)."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in ("managedFields", "annotations")}
    return {**obj, "metadata": meta}


class Informer:
    """Keeps `items` equal to the API server's objects at `path`: list, then watch from its version;
    a watch that ends resumes from the last version seen, a 410 lists again, errors back off."""

    def __init__(self, client: KubeClient, path: str, on_change: Callable[[], None],
                 params: Mapping[str, str] | None = None) -> None:
        self.client = client
        self.path = path
        self.params = dict(params or {})
        self.on_change = on_change
        self.items: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()

    async def run(self) -> None:
        backoff = 0.5
        while True:
            try:
                listed = await self.client.list(self.path, self.params)
                self.items = {_key(o): slim(o) for o in listed.get("items") or ()}
                version = str((listed.get("metadata") or {}).get("resourceVersion", ""))
                self.synced.set()
                self.on_change()
                backoff = 0.5
                while True:
                    async for event in self.client.watch(self.path, self.params, version):
                        obj = event.get("object") or {}
                        version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                        if event.get("type") == "DELETED":
                            self.items.pop(_key(obj), None)
                        elif event.get("type") in ("ADDED", "MODIFIED"):
                            self.items[_key(obj)] = slim(obj)
                        else:
                            continue  # BOOKMARK: only the version moves
                        self.on_change()
            except Gone:
                log.info("watch expired; listing again", extra={"path": self.path})
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, KubeError, ValueError) as exc:
                log.warning("list/watch failed; retrying", extra={"path": self.path, "error": str(exc)[:200],
                                                                  "retry_s": backoff})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
