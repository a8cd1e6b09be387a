"""Control-plane faults: while a ModelDeployment scales (3 -> 6 -> 2 replicas) and while its tenant's quota
changes, kube-apiserver, etcd and Kueue are restarted in turn (the local cluster's processes, same flags and data).
After each restart everything converges: one workload per replica, no orphaned pods or Deployments, the status
right. A sampler reads what is admitted and what runs every 0.2 s throughout, through the restarts (a read that
fails while a component is down is a gap, not a pass), and no sample shows more GPUs admitted or held by pods
than the tenant's quota allowed at that moment. The figures are printed and written to
.cluster/logs/operator-faults.json.

Quota changes are made when they fit what is in use: Kueue does not evict admitted workloads when a quota
shrinks below its usage (kubernetes-sigs/kueue#5176), so only there "admitted <= quota" is Kueue's rule to keep,
not ours.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from fault_sampler import Expect, QuotaTimeline, Sampler, convergence_problems, outage_seconds, violations

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess

from operator_fixtures import API, KUEUE, model_deployment

sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))
from localcluster import control  # noqa: E402

CONVERGE_BOUND_S = 120
LABEL = "serving.kvfleet.dev/modeldeployment=svc"


def tenant_problems(tenant: dict[str, Any] | None) -> list[str]:
    """Whether the operator has applied the Tenant's spec (its quota into the ClusterQueue): status.observedGeneration
    is the generation (a usage refresh never advances it)."""
    if tenant is None:
        return ["the Tenant is gone"]
    seen, gen = (tenant.get("status") or {}).get("observedGeneration"), tenant["metadata"].get("generation")
    return [] if seen == gen else [f"Tenant status of generation {seen}, spec at {gen}"]


def converge(kube: Kube, ns: str, tenant: str, expect: Expect, timeout: float = CONVERGE_BOUND_S) -> float:
    """Seconds until the ModelDeployment `svc` is converged to `expect` and the Tenant's spec is applied (the next
    step may count on a quota cut only then: Kueue does not take back what it admitted under the old quota); fails
    with what still differs."""
    started = time.monotonic()
    problems: list[str] = ["never read"]
    while time.monotonic() - started < timeout:
        try:
            problems = convergence_problems(
                expect, kube.get(API, "modeldeployments", "svc", ns), kube.list(KUEUE, "workloads", ns, LABEL),
                kube.list("apps/v1", "deployments", ns, LABEL), kube.list("apps/v1", "replicasets", ns),
                kube.list("v1", "pods", ns)) + tenant_problems(kube.get(API, "tenants", tenant))
        except Exception as exc:  # the control plane is still coming back
            problems = [f"read failed: {exc!r}"]
        if not problems:
            return time.monotonic() - started
        time.sleep(0.25)
    raise AssertionError(f"not converged to {expect} in {timeout:.0f} s: {problems}")


def test_restarts_during_scaling_and_quota_changes(kube: Kube, tenants: Any, flavors: dict[str, str],
                                                   operator: OperatorProcess, cluster: Any,
                                                   kubectl: Callable[..., Any]) -> None:
    h200 = flavors["h200"]
    quota = QuotaTimeline()
    quota.set(4)
    tenant, ns = tenants.create("faults", [{"flavor": h200, "nominal": 4}])
    kube.apply(model_deployment("svc", ns, h200, replicas=3, tp=1))
    converge(kube, ns, tenant, Expect(desired=3, admitted=3))

    def scale(n: int) -> None:
        kubectl("scale", "modeldeployment/svc", f"--replicas={n}", namespace=ns)

    def set_quota(n: int) -> None:
        if n > quota.changes[-1][1]:
            quota.set(n)  # a raise may be used from the moment it is sent
        kube.apply({"apiVersion": API, "kind": "Tenant", "metadata": {"name": tenant},
                    "spec": {"namespaces": [ns], "quotas": [{"flavor": h200, "nominal": n}]}})
        if n < quota.changes[-1][1]:
            quota.set(n)  # a cut holds once sent (only ever made when what is in use fits; the step converges
            #               only once the operator applied it, see `converge`)

    # (what changes, the change, the component restarted right after it, the converged state)
    steps: list[tuple[str, Callable[[], None], str, Expect]] = [
        ("scale 3->6 (quota 4)", lambda: scale(6), "kube-apiserver", Expect(desired=6, admitted=4)),
        ("quota 4->6", lambda: set_quota(6), "etcd", Expect(desired=6, admitted=6)),
        ("scale 6->2", lambda: scale(2), "kueue", Expect(desired=2, admitted=2)),
        ("quota 6->2", lambda: set_quota(2), "kube-apiserver", Expect(desired=2, admitted=2)),
        ("scale 2->3 (quota 2)", lambda: scale(3), "etcd", Expect(desired=3, admitted=2)),
        ("quota 2->3", lambda: set_quota(3), "kueue", Expect(desired=3, admitted=3)),
    ]
    sampler = Sampler(kube, ns, quota)
    sampler.start()
    figures = []
    try:
        for what, change, component, expect in steps:
            t_change = time.monotonic()
            change()
            restarted = control.restart(cluster, component)
            t_healthy = time.monotonic()
            converge_s = converge(kube, ns, tenant, expect)
            # The sampler sees the control plane back: at least one sample after the restart, in the window.
            sampler.wait_sample_after(t_healthy)
            samples, gaps = sampler.between(t_change, time.monotonic())
            figures.append({
                "step": what, "restarted": component, "stop_s": restarted.stop_s, "start_s": restarted.start_s,
                "converged_s_after_healthy": round(converge_s, 1),
                "converged_s_after_change": round(time.monotonic() - t_change, 1),
                "samples": len(samples), "failed_reads": len(gaps),
                "unreadable_s": round(outage_seconds(samples, gaps), 1),
                "max_admitted_gpus": max((s.admitted_gpus for s in samples), default=None),
                "max_running_gpus": max((s.running_gpus for s in samples), default=None),
                "quota_gpus": quota.changes[-1][1],
            })
            assert samples, f"{what}: no sample succeeded"
            # Samples after the restart: the sampler saw the control plane back.
            assert any(s.t0 > t_healthy for s in samples), f"{what}: no sample after the restart"
    finally:
        sampler.stop()
        report = {"steps": figures, "samples": len(sampler.samples), "failed_reads": len(sampler.gaps),
                  "unreadable_s": round(outage_seconds(sampler.samples, sampler.gaps), 1)}
        out = Path(cluster.logs) / "operator-faults.json"
        out.write_text(json.dumps(report, indent=1) + "\n")
        summary = json.dumps(report | {"steps": len(figures)})
        print("\n" + "\n".join(json.dumps(f) for f in figures) + f"\nall: {summary}")

    assert not violations(sampler.samples, quota), violations(sampler.samples, quota)[:20]
    log = operator.log_text()
    assert "Traceback" not in log, f"the operator logged a traceback; see {operator.log_path}"
