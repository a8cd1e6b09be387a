"""The engine kubelet's door to the apiserver (httpx, its own client certificate): pods listed and watched,
pod status patched, pods deleted, Secrets, namespaces and nodes read."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

WATCH_TIMEOUT_S = 300  # the apiserver ends a watch after this; we then watch again from the last version


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Gone(ApiError):
    """The resource version to watch from is too old (HTTP 410): list again."""


class ApiServer:
    def __init__(self, url: str, ca: Path, cert: Path, key: Path) -> None:
        context = ssl.create_default_context(cafile=str(ca))
        context.load_cert_chain(str(cert), str(key))
        self._http = httpx.Client(base_url=url, verify=context, timeout=httpx.Timeout(15.0), trust_env=False)

    def close(self) -> None:
        self._http.close()

    def _json(self, response: httpx.Response, missing_ok: bool = False) -> dict[str, Any] | None:
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise (Gone if response.status_code == 410 else ApiError)(response.status_code, message)
        return response.json() if response.content else {}

    def list_pods(self, selector: str) -> tuple[list[dict[str, Any]], str]:
        """Every pod matching the label selector, and the list's resource version (to watch from)."""
        out = self._json(self._http.get("/api/v1/pods", params={"labelSelector": selector})) or {}
        return list(out.get("items") or []), str((out.get("metadata") or {}).get("resourceVersion", ""))

    def watch_pods(self, selector: str, resource_version: str) -> Iterator[dict[str, Any]]:
        """Watch events ({type, object}) from `resource_version` until the apiserver ends the watch."""
        params = {"labelSelector": selector, "watch": "1", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_TIMEOUT_S)}  # fmt: skip
        timeout = httpx.Timeout(15.0, read=WATCH_TIMEOUT_S + 30)
        with self._http.stream("GET", "/api/v1/pods", params=params, timeout=timeout) as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            for line in response.iter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    code = int(status.get("code") or 500)
                    raise (Gone if code == 410 else ApiError)(code, status.get("message", "watch error"))
                yield event

    def patch_pod_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        """Strategic-merge patch of the status subresource (conditions merge by type); None if the pod is gone."""
        response = self._http.patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", content=json.dumps(patch),
                                     headers={"Content-Type": "application/strategic-merge-patch+json"})  # fmt: skip
        return self._json(response, missing_ok=True)

    def delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Removes a pod whose containers have stopped (grace 0, that pod only); False if already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        response = self._http.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                                      content=json.dumps(body), headers={"Content-Type": "application/json"})
        if response.status_code == 409:  # another pod of that name now: ours is gone
            return False
        return self._json(response, missing_ok=True) is not None

    def get(self, path: str) -> dict[str, Any] | None:
        return self._json(self._http.get(path), missing_ok=True)

    def namespace(self, name: str) -> dict[str, Any] | None:
        return self.get(f"/api/v1/namespaces/{name}")

    def secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")

    def node(self, name: str) -> dict[str, Any] | None:
        return self.get(f"/api/v1/nodes/{name}")

    def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        self._json(self._http.post(f"/api/v1/namespaces/{namespace}/events", content=json.dumps(event),
                                   headers={"Content-Type": "application/json"}))  # fmt: skip
