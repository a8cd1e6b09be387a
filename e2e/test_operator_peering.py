"""Scenario: two operator replicas on one kopf peering (as the chart's `operator.replicas: 2` runs them): exactly
one is active and reconciles, the other waits; when the active one dies, the other takes over."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from kvfleet.operator.kube import Kube
from kvfleet.operator.main import peering_priority
from kvfleet.operator.testing import OperatorProcess, wait_for

from operator_fixtures import API, KUEUE

RESUMED = "Resuming operations"  # kopf starts a peered operator paused; it logs this when it becomes active
CONFLICT = "Possibly conflicting operators"  # what kopf says before pausing every peer of equal priority


def test_one_active_replica_and_failover(crds: None, kube: Kube, kubeconfig: str, cluster: Any) -> None:
    sfx = uuid.uuid4().hex[:5]
    peering, tenant = f"kvfleet-peers-{sfx}", f"peers-{sfx}"
    kube.apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}})
    ops = {who: OperatorProcess(kubeconfig, Path(cluster.logs) / f"operator-peering-{who}.log", peering=peering,
                                identity=f"kvfleet-operator-{who}-{sfx}") for who in ("a", "b")}
    # The higher priority wins (distinct per identity: kopf pauses *all* peers of equal priority).
    prio = {who: peering_priority({"POD_ID": f"kvfleet-operator-{who}-{sfx}"}) for who in ops}
    active, standby = sorted(ops, key=lambda who: prio[who], reverse=True)
    try:
        # The higher one first: a lower one started first would be active (and log so) until the higher appears.
        ops[active].start()
        wait_for("the higher-priority replica is active", lambda: RESUMED in ops[active].log_text(), timeout=60)
        ops[standby].start()
        kube.apply({"apiVersion": API, "kind": "Tenant", "metadata": {"name": tenant},
                    "spec": {"namespaces": [tenant], "quotas": [{"flavor": f"h200-{sfx}", "nominal": 1}]}})
        wait_for("the active replica reconciles", lambda: kube.get(KUEUE, "localqueues", tenant, tenant), timeout=60)
        logs = {who: op.log_text() for who, op in ops.items()}
        assert RESUMED not in logs[standby], logs[standby][-2000:]
        assert CONFLICT not in logs[active] + logs[standby]

        # The active one dies without a goodbye: the standby resumes once its peering entry expires.
        ops[active].kill()
        wait_for("the standby resumes", lambda: RESUMED in ops[standby].log_text(), timeout=60)
        kube.delete(KUEUE, "localqueues", tenant, tenant)
        wait_for("the standby reconciles", lambda: (q := kube.get(KUEUE, "localqueues", tenant, tenant))
                 and not q["metadata"].get("deletionTimestamp"), timeout=60)
    finally:
        for op in ops.values():
            op.stop()
        kube.delete(API, "tenants", tenant)
        kube.delete("v1", "namespaces", tenant)
        kube.delete("kopf.dev/v1", "clusterkopfpeerings", peering)
