"""Whether the gateway may read a ModelDeployment's engine key Secret (pure; the SubjectAccessReview that asks
the API server is the reconcile's I/O).

A model whose engines want their own key (`spec.apiKeySecretRef`) is reachable through the gateway only once its
namespace grants the gateway's ServiceAccount `get` on that Secret (docs/gateway.md): the gateway's own RBAC reads
Secrets of its key namespace only. The operator asks the API server, as that ServiceAccount, and reports the answer
as the `GatewayKeyAccess` condition, with the two commands that grant it when it is missing, so the model's owner
reads it in `kubectl describe` before a client meets the gateway's 502.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

CONDITION = "GatewayKeyAccess"
GRANT_NAME = "kvfleet-gateway-engine-key"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class GatewayIdentity:
    """The gateway's ServiceAccount, `namespace/name` (the chart sets it when the gateway is enabled)."""

    namespace: str
    name: str

    @classmethod
    def parse(cls, text: str) -> "GatewayIdentity":
        namespace, _, name = text.strip().partition("/")
        if not _NAME.match(namespace) or not _NAME.match(name):
            raise ValueError(f"KVFLEET_GATEWAY_SERVICE_ACCOUNT must be namespace/name, got {text!r}")
        return cls(namespace, name)

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"

    @property
    def groups(self) -> list[str]:
        """What the API server gives every token of the ServiceAccount: a grant to one of them counts too."""
        return ["system:serviceaccounts", f"system:serviceaccounts:{self.namespace}", "system:authenticated"]


@dataclass(frozen=True)
class KeyAccess:
    """The condition's content: `status` True (granted), False (not), None (the check itself failed)."""

    status: bool | None
    reason: str
    message: str


def access_review(gateway: GatewayIdentity, namespace: str, secret: str) -> dict[str, Any]:
    """May the gateway `get` the Secret `secret` of `namespace`? (A SubjectAccessReview to create.)"""
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "metadata": {},
            "spec": {"user": gateway.user, "groups": gateway.groups,
                     "resourceAttributes": {"namespace": namespace, "verb": "get", "resource": "secrets",
                                            "name": secret}}}


def grant_commands(gateway: GatewayIdentity, namespace: str, secret: str) -> str:
    return (f"kubectl -n {namespace} create role {GRANT_NAME} --verb=get --resource=secrets "
            f"--resource-name={secret}; kubectl -n {namespace} create rolebinding {GRANT_NAME} "
            f"--role={GRANT_NAME} --serviceaccount={gateway.namespace}:{gateway.name}")


def key_access(review: Mapping[str, Any], gateway: GatewayIdentity, namespace: str, secret: str) -> KeyAccess:
    """The condition from the review the API server answered."""
    status = review.get("status") or {}
    who = f"the gateway ({gateway.namespace}/{gateway.name})"
    if status.get("allowed") is True:
        return KeyAccess(True, "KeyGranted", f"{who} may read Secret {secret}, the engines' key")
    return KeyAccess(False, "KeyNotGranted", f"{who} may not read Secret {secret}, the engines' key, so requests "
                     f"through it are refused (502 upstream_auth_unavailable); grant it: "
                     f"{grant_commands(gateway, namespace, secret)}")


def access_check_failed(secret: str, error: str) -> KeyAccess:
    return KeyAccess(None, "AccessCheckFailed", f"could not ask the API server whether the gateway may read Secret "
                     f"{secret}: {error}")
