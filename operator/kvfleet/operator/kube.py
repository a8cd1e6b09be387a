"""The operator's only door to the apiserver: a small synchronous client (httpx) for any
resource by apiVersion/plural, with server-side apply under one field manager."""
from __future__ import annotations

import json
import logging
import ssl
from typing import Any, Mapping

import httpx

from .constants import FIELD_MANAGER
from .credentials import TokenSource
from .credentials import load as load_credentials
from .metrics import API_REQUESTS

log = logging.getLogger("kvfleet.operator.kube")

# Plurals of the kinds the operator writes (the REST path needs them).
PLURALS = {
    "Namespace": "namespaces", "Service": "services", "Event": "events", "Pod": "pods",
    "Deployment": "deployments", "NetworkPolicy": "networkpolicies", "PodDisruptionBudget": "poddisruptionbudgets",
    "Role": "roles", "RoleBinding": "rolebindings",
    "Workload": "workloads", "ClusterQueue": "clusterqueues", "LocalQueue": "localqueues",
    "ResourceFlavor": "resourceflavors", "WorkloadPriorityClass": "workloadpriorityclasses",
    "ModelDeployment": "modeldeployments", "Tenant": "tenants", "ClusterKopfPeering": "clusterkopfpeerings",
    "SubjectAccessReview": "subjectaccessreviews",
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def resource_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
                  subresource: str | None = None) -> str:
    """`/api/v1/namespaces/ns/pods/x` or `/apis/group/version/...`."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


def request_kind(method: str, path: str) -> tuple[str, str]:
    """(verb, resource) of a REST call as the apiserver counts them: ("list", "workloads"),
    ("patch", "modeldeployments/status"), ("get", "namespaces")."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    rest = parts[2:] if parts[0] == "api" else parts[3:]  # after /api/v1 or /apis/group/version
    if len(rest) > 2 and rest[0] == "namespaces":
        rest = rest[2:]  # a namespaced resource: /namespaces/<ns>/<plural>/...
    resource = f"{rest[0]}/{rest[2]}" if len(rest) >= 3 else (rest[0] if rest else "")
    if method == "GET":
        return ("get" if len(rest) >= 2 else "list"), resource
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
    return verbs.get(method, method.lower()), resource


def object_path(obj: Mapping[str, Any], subresource: str | None = None) -> str:
    meta = obj["metadata"]
    return resource_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"), meta["name"],
                         subresource)


class Kube:
    """Synchronous and thread-safe enough for kopf's executor (httpx.Client is)."""

    def __init__(self, host: str, verify: ssl.SSLContext | bool, token_fn: TokenSource | None = None,
                 timeout: float = 30.0) -> None:
        self._token_fn = token_fn
        self._http = httpx.Client(base_url=host, verify=verify, timeout=timeout)

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | None = None) -> "Kube":
        """`kubeconfig` if given, else the pod's service account, else $KUBECONFIG (`credentials.load`)."""
        creds = load_credentials(kubeconfig)
        return cls(creds.server, creds.ssl_context(), creds.token)

    def _request(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                 body: Any = None, content_type: str = "application/json") -> dict[str, Any] | None:
        content = None if body is None else json.dumps(body)
        resp = self._send(method, path, params, content, content_type)
        if resp.status_code == 401 and self._token_fn is not None and self._token_fn.forget():
            # A token the server refused (revoked, or rotated early): read or run for a new one, once.
            resp = self._send(method, path, params, content, content_type)
        if resp.status_code == 404 and method in ("GET", "DELETE"):
            return None
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            raise KubeError(resp.status_code, message)
        return resp.json() if resp.content else {}

    def _send(self, method: str, path: str, params: Mapping[str, Any] | None, content: str | None,
              content_type: str) -> httpx.Response:
        headers = {"Accept": "application/json"}
        token = self._token_fn() if self._token_fn else None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content is not None:
            headers["Content-Type"] = content_type
        verb, resource = request_kind(method, path)
        try:
            resp = self._http.request(method, path, params=params, content=content, headers=headers)
        except httpx.TransportError:
            API_REQUESTS.labels(verb, resource, "error").inc()
            raise
        API_REQUESTS.labels(verb, resource, str(resp.status_code)).inc()
        return resp

    def get(self, api_version: str, plural: str, name: str, namespace: str | None = None) -> dict | None:
        return self._request("GET", resource_path(api_version, plural, namespace, name))

    def list(self, api_version: str, plural: str, namespace: str | None = None,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        out = self._request("GET", resource_path(api_version, plural, namespace), params=params) or {}
        return list(out.get("items") or [])

    def apply(self, obj: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """Server-side apply as `kvfleet-operator`, forcing conflicts: the operator owns these fields."""
        out = self._request("PATCH", object_path(obj, subresource),
                            params={"fieldManager": FIELD_MANAGER, "force": "true"},
                            body=obj, content_type="application/apply-patch+yaml")
        return out or {}

    def merge_patch(self, obj_ref: Mapping[str, Any], patch: Mapping[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        out = self._request("PATCH", object_path(obj_ref, subresource), params={"fieldManager": FIELD_MANAGER},
                            body=patch, content_type="application/merge-patch+json")
        return out or {}

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"))
        return self._request("POST", path, params={"fieldManager": FIELD_MANAGER}, body=obj) or {}

    def delete(self, api_version: str, plural: str, name: str, namespace: str | None = None,
               propagation: str = "Background") -> bool:
        """Delete; False if it was already gone."""
        out = self._request("DELETE", resource_path(api_version, plural, namespace, name),
                            body={"kind": "DeleteOptions", "apiVersion": "v1",
                                  "propagationPolicy": propagation})
        return out is not None

    def close(self) -> None:
        self._http.close()
