"""A small async door to the API server (I/O): credentials, and list + watch of one resource.

Credentials: `kvfleet.operator.credentials` (in a pod, the service account, its token re-read as the kubelet rotates
it; else a kubeconfig's current context), as the operator's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable, Mapping

import aiohttp

from kvfleet.operator.credentials import Credentials

log = logging.getLogger("kvfleet.gateway.kube")


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class KubeClient:
    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        token = self.creds.token()
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    async def _error(self, resp: aiohttp.ClientResponse) -> KubeError:
        if resp.status == 401:
            # A refused token (revoked, or rotated early): the caller's retry reads or runs for a new one.
            self.creds.token.forget()
        return KubeError(resp.status, (await resp.text())[:300])

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.creds.ssl_context())   # built once, with the session
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def list(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        async with self.session().get(self.creds.server + path, params=dict(params), headers=self._headers(),
                                      timeout=aiohttp.ClientTimeout(total=60)) as resp:
            if resp.status >= 400:
                raise await self._error(resp)
            return await resp.json()

    async def get(self, path: str) -> dict[str, Any]:
        """One object; KubeError carries the status (403: RBAC, 404: none)."""
        async with self.session().get(self.creds.server + path, headers=self._headers(),
                                      timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status >= 400:
                raise await self._error(resp)
            return await resp.json()

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        headers = {**self._headers(), "Content-Type": "application/merge-patch+json"}
        async with self.session().patch(self.creds.server + path, json=dict(body), headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status >= 400:
                raise await self._error(resp)
            return await resp.json()

    async def watch(self, path: str, params: Mapping[str, str], resource_version: str,
                    timeout_s: int = 300) -> AsyncIterator[dict[str, Any]]:
        """Events from `resource_version` until the server ends the watch; raises Gone on 410."""
        query = {**params, "watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(timeout_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s + 30)
        async with self.session().get(self.creds.server + path, params=query, headers=self._headers(),
                                      timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status >= 400:
                raise await self._error(resp)
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
