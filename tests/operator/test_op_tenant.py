"""Tenant builders (ClusterQueue, LocalQueue, NetworkPolicy, RBAC) and usage status."""
from __future__ import annotations

from kvfleet.operator.builders import (
    build_cluster_queue,
    build_local_queue,
    build_namespace,
    build_network_policy,
    build_rbac,
)
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.constants import LABEL_FLAVOR, LABEL_TENANT
from kvfleet.operator.spec import parse_tenant
from kvfleet.operator.tenant_status import compute_tenant_status, gpu_usage, namespace_conflicts, usage_refresh

from op_factories import make_workload

TENANT = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "Tenant",
          "metadata": {"name": "team-a", "uid": "t-uid", "generation": 2}}
SPEC = parse_tenant({"namespaces": ["team-a", "team-a-dev"], "group": "team-a-devs", "cohort": "gpus",
                     "fairSharingWeight": "2",
                     "quotas": [{"flavor": "h200", "nominal": 4, "borrowingLimit": 2, "lendingLimit": 1},
                                {"flavor": "l40s", "nominal": 2}]})


def test_cluster_queue() -> None:
    cq = build_cluster_queue(TENANT, SPEC)
    assert cq["apiVersion"] == "kueue.x-k8s.io/v1beta2" and cq["metadata"]["name"] == "team-a"
    spec = cq["spec"]
    assert spec["cohortName"] == "gpus" and spec["fairSharing"] == {"weight": "2"}
    assert spec["namespaceSelector"] == {"matchLabels": {LABEL_TENANT: "team-a"}}
    (group,) = spec["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu"]
    h200 = next(f for f in group["flavors"] if f["name"] == "h200")
    gpu = next(r for r in h200["resources"] if r["name"] == "nvidia.com/gpu")
    assert gpu == {"name": "nvidia.com/gpu", "nominalQuota": 4, "borrowingLimit": 2, "lendingLimit": 1}
    # Kueue's rule: every flavor lists every covered resource, in order.
    for f in group["flavors"]:
        assert [r["name"] for r in f["resources"]] == group["coveredResources"]
    assert cq["metadata"]["ownerReferences"][0]["uid"] == "t-uid"


def test_no_cohort_means_no_cohort_name() -> None:
    spec = parse_tenant({"namespaces": ["x"], "quotas": [{"flavor": "h200", "nominal": 1}]})
    assert "cohortName" not in build_cluster_queue(TENANT, spec)["spec"]


def test_namespace_queue_policy_rbac() -> None:
    ns = build_namespace("team-a", "team-a-dev")
    assert ns["metadata"]["labels"][LABEL_TENANT] == "team-a" and "ownerReferences" not in ns["metadata"]
    # PodSecurity admission holds the tenant's pods to the restricted standard (warns and audits at it too).
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted" == labels["pod-security.kubernetes.io/warn"]
    assert labels["pod-security.kubernetes.io/enforce-version"] == "latest"
    assert build_namespace("team-a", "team-a-dev", "privileged")["metadata"]["labels"][
        "pod-security.kubernetes.io/enforce"] == "privileged"
    assert not any(k.startswith("pod-security.") for k in build_namespace("t", "n", "")["metadata"]["labels"])
    lq = build_local_queue(TENANT, "team-a-dev")
    assert lq["spec"] == {"clusterQueue": "team-a"} and lq["metadata"]["namespace"] == "team-a-dev"
    np = build_network_policy(TENANT, "team-a-dev")
    peers = np["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {LABEL_TENANT: "team-a"}}} in peers
    assert np["spec"]["podSelector"] == {} and np["spec"]["policyTypes"] == ["Ingress"]
    assert not any("kubernetes.io/metadata.name" in p["namespaceSelector"]["matchLabels"] for p in peers)
    # The operator's namespace is admitted by name (its autoscaler scrapes the engines' /metrics).
    peers = build_network_policy(TENANT, "team-a-dev", ("kvfleet-system", "monitoring"))["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvfleet-system"}}} in peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in peers
    assert OperatorConfig.from_env({"KVFLEET_SYSTEM_NAMESPACES": "kvfleet-system, monitoring,"}).system_namespaces \
        == ("kvfleet-system", "monitoring")
    assert OperatorConfig.from_env({}).system_namespaces == ()
    role, binding = build_rbac(TENANT, SPEC, "team-a-dev")
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "team-a-dev"
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert resources == {"modeldeployments", "modeldeployments/scale", "modeldeployments/status"}
    assert binding["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                                    "name": "team-a-devs"}]
    assert binding["roleRef"]["kind"] == "Role"


def test_no_group_no_binding() -> None:
    spec = parse_tenant({"namespaces": ["x"], "quotas": [{"flavor": "h200", "nominal": 1}]})
    assert [o["kind"] for o in build_rbac(TENANT, spec, "x")] == ["Role"]


def test_gpu_usage_per_flavor() -> None:
    pinned = make_workload(3, pending_message="wait", gpus=2)
    pinned["metadata"]["labels"][LABEL_FLAVOR] = "l40s"
    wls = [make_workload(0, admitted=True, flavor="h200", gpus=2),
           make_workload(1, admitted=True, flavor="h200", gpus=2),
           make_workload(2, pending_message="wait", gpus=4),
           pinned,
           make_workload(4, admitted=True, flavor="h200", gpus=8, terminating=True)]
    usage = {u["flavor"]: u for u in gpu_usage(wls, SPEC)}
    assert usage["h200"] == {"flavor": "h200", "nominal": 4, "inUse": 4, "pending": 0}
    assert usage["l40s"]["pending"] == 2 and usage["*"]["pending"] == 4


def test_tenant_status_ready_and_invalid() -> None:
    st = compute_tenant_status(TENANT, SPEC, None, [], "T")
    assert st["conditions"][0]["status"] == "True" and st["clusterQueue"] == "team-a"
    bad = compute_tenant_status(TENANT, None, "spec.quotas: needs at least one flavor quota", [], "T")
    assert bad["conditions"][0]["reason"] == "InvalidSpec" and "spec.quotas" in bad["conditions"][0]["message"]


def test_a_usage_refresh_does_not_vouch_for_a_spec_it_did_not_apply() -> None:
    """A status-only pass between a spec change and the full pass that applies it (failed: the apiserver was
    restarting) keeps observedGeneration and the conditions of the last full pass; only the usage moves."""
    applied = compute_tenant_status(TENANT, SPEC, None, [], "T")
    newer = {**TENANT, "metadata": {**TENANT["metadata"], "generation": 7}}
    fresh = compute_tenant_status(newer, SPEC, None, [], "T2")
    fresh["gpus"] = [{"flavor": "h200", "nominal": 4, "inUse": 2, "pending": 0}]
    refreshed = usage_refresh(applied, fresh)
    assert refreshed["observedGeneration"] == applied["observedGeneration"] != 7
    assert refreshed["conditions"] == applied["conditions"] and refreshed["gpus"] == fresh["gpus"]
    assert usage_refresh({}, fresh) == fresh   # never written by a full pass: nothing to keep


def test_namespace_of_another_live_tenant_is_not_taken() -> None:
    owners = {"team-a": None, "team-a-dev": "team-b", "old": "gone", "mine": "team-a"}
    conflicts = namespace_conflicts("team-a", owners, live_tenants={"team-b"})
    assert conflicts == {"team-a-dev": "team-b"}
    st = compute_tenant_status(TENANT, SPEC, None, [], "T", conflicts)
    ready = st["conditions"][0]
    assert ready["status"] == "False" and ready["reason"] == "NamespaceConflict"
    assert "team-a-dev (tenant team-b)" in ready["message"] and "spec.namespaces" in ready["message"]
    assert st["namespaces"] == ["team-a"]


def test_platform_namespaces_are_never_given_to_a_tenant() -> None:
    st = compute_tenant_status(TENANT, SPEC, None, [], "T", reserved=["team-a-dev"])
    ready = st["conditions"][0]
    assert ready["status"] == "False" and ready["reason"] == "ReservedNamespace"
    assert "spec.namespaces" in ready["message"] and "team-a-dev" in ready["message"]
    assert st["namespaces"] == ["team-a"]
    both = compute_tenant_status(TENANT, SPEC, None, [], "T", {"team-a": "team-b"}, reserved=["team-a-dev"])
    msg = both["conditions"][0]["message"]
    assert both["conditions"][0]["reason"] == "ReservedNamespace" and "team-a (tenant team-b)" in msg
    assert both["namespaces"] == []
