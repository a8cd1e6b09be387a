"""GatewayKeyAccess: whether the gateway may read a model's engine key, asked as its ServiceAccount, and the
condition (with the grant to run) that says so."""
from __future__ import annotations

import pytest

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.gateway_access import (
    GatewayIdentity,
    access_check_failed,
    access_review,
    key_access,
)
from kvfleet.operator.plan import WorkloadPlan
from kvfleet.operator.status import Observation, compute_status, status_event

GW = GatewayIdentity("kvfleet-system", "kvfleet-gateway")
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def test_the_gateway_identity_comes_from_the_environment_or_is_refused() -> None:
    assert OperatorConfig.from_env({}).gateway is None
    assert OperatorConfig.from_env({"KVFLEET_GATEWAY_SERVICE_ACCOUNT": " kvfleet-system/kvfleet-gateway"}).gateway == GW
    for bad in ("kvfleet-gateway", "a/", "/b", "A/b", "a/b/c"):
        with pytest.raises(ValueError, match="KVFLEET_GATEWAY_SERVICE_ACCOUNT must be namespace/name"):
            OperatorConfig.from_env({"KVFLEET_GATEWAY_SERVICE_ACCOUNT": bad})


def test_the_review_asks_for_get_on_the_one_secret_as_the_service_account_and_its_groups() -> None:
    review = access_review(GW, "team-a", "chat-keys")
    assert review["kind"] == "SubjectAccessReview" and review["apiVersion"] == "authorization.k8s.io/v1"
    assert review["spec"] == {
        "user": "system:serviceaccount:kvfleet-system:kvfleet-gateway",
        "groups": ["system:serviceaccounts", "system:serviceaccounts:kvfleet-system", "system:authenticated"],
        "resourceAttributes": {"namespace": "team-a", "verb": "get", "resource": "secrets", "name": "chat-keys"}}


def test_the_answer_becomes_the_condition_with_the_grant_to_run() -> None:
    granted = key_access({"status": {"allowed": True}}, GW, "team-a", "chat-keys")
    assert (granted.status, granted.reason) == (True, "KeyGranted")
    refused = key_access({"status": {"allowed": False, "reason": ""}}, GW, "team-a", "chat-keys")
    assert (refused.status, refused.reason) == (False, "KeyNotGranted")
    assert "kubectl -n team-a create role kvfleet-gateway-engine-key --verb=get --resource=secrets " \
           "--resource-name=chat-keys" in refused.message
    assert "--serviceaccount=kvfleet-system:kvfleet-gateway" in refused.message
    assert key_access({}, GW, "team-a", "chat-keys").status is False  # no answer is no grant


def observe(gateway_key=None) -> Observation:
    return Observation(generation=2, desired=0, plan=WorkloadPlan(), pod_replicas=0, ready_replicas=0,
                       endpoint="http://chat.team-a.svc.cluster.local:8000/v1", selector="a=b", gateway_key=gateway_key)


def test_the_condition_is_there_only_when_asked_and_warns_when_not_granted() -> None:
    def cond(status: dict) -> dict | None:
        return next((c for c in status["conditions"] if c["type"] == "GatewayKeyAccess"), None)

    assert cond(compute_status(observe(), {}, T0)) is None
    refused = key_access({"status": {"allowed": False}}, GW, "team-a", "chat-keys")
    before = compute_status(observe(), {}, T0)
    after = compute_status(observe(refused), before, T0)
    assert cond(after)["status"] == "False" and cond(after)["reason"] == "KeyNotGranted"
    kind, reason, message = status_event(before["conditions"], after["conditions"])
    assert (kind, reason) == ("Warning", "KeyNotGranted") and "create rolebinding" in message
    granted = compute_status(observe(key_access({"status": {"allowed": True}}, GW, "team-a", "chat-keys")),
                             after, T1)
    assert cond(granted)["status"] == "True" and cond(granted)["lastTransitionTime"] == T1
    assert status_event(after["conditions"], granted["conditions"])[:2] == ("Normal", "KeyGranted")
    failed = compute_status(observe(access_check_failed("chat-keys", "HTTP 403: forbidden")), granted, T1)
    assert cond(failed)["status"] == "Unknown" and cond(failed)["reason"] == "AccessCheckFailed"
    # the spec no longer names a key: the condition goes
    assert cond(compute_status(observe(), failed, T1)) is None
