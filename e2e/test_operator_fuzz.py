"""Fuzzing the CRDs: generated Tenant and ModelDeployment bodies (hypothesis, e2e/crd_strategies.py) are sent to
the real apiserver. Each one is either refused with a 422 whose causes name a field, or accepted and then
reconciled by the operator to Conditions that each carry a reason (within a bound). At the end the operator's log
holds no traceback: no generated spec made it fail.

Deterministic (`derandomize`, no example database) and bounded: a fixed number of examples per kind.
"""
from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from crd_strategies import Refs, model_deployments, tenants
from hypothesis import HealthCheck, given, settings

from kvfleet.operator.constants import GROUP, VERSION
from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, wait_for

from operator_fixtures import API, SYSTEM_NAMESPACE

RECONCILE_BOUND_S = 45
UNCHECKED_NOTE = "some validation rules were not checked because the object was invalid"
FUZZ = settings(max_examples=100, derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@dataclass(frozen=True)
class Answer:
    code: int
    status: dict[str, Any]  # the apiserver's Status object on a refusal


def send(custom: Any, body: dict[str, Any]) -> Answer:
    """Create the body as it is; the apiserver's answer (201, or its Status with the causes)."""
    from kubernetes.client.exceptions import ApiException

    ns = body["metadata"].get("namespace")
    plural = "modeldeployments" if body["kind"] == "ModelDeployment" else "tenants"
    try:
        if ns:
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, plural, body)
        else:
            custom.create_cluster_custom_object(GROUP, VERSION, plural, body)
    except ApiException as exc:
        try:
            status = json.loads(exc.body or "{}")
        except ValueError:
            status = {"message": exc.body}
        return Answer(exc.status, status)
    return Answer(201, {})


def check_refused(answer: Answer, body: dict[str, Any]) -> str:
    """A 422 whose causes each name a field; returns the first field's top key (for the tally)."""
    assert answer.code == 422, f"{answer.code} {answer.status} for {body}"
    causes = (answer.status.get("details") or {}).get("causes") or ()
    # The apiserver's own note beside the errors (CEL rules skipped on an object already invalid) names no field.
    fields = [c.get("field", "").lstrip(".") for c in causes if UNCHECKED_NOTE not in c.get("message", "")]
    named = [f for f in fields if f.startswith(("spec", "metadata"))]
    # An int-or-string's anyOf adds a cause without a field whose message names it ('"spec.x" must validate...').
    unnamed = [c for c in causes if not c.get("field", "").lstrip(".").startswith(("spec", "metadata"))
               and UNCHECKED_NOTE not in c.get("message", "") and '"spec.' not in c.get("message", "")]
    assert named and not unnamed, f"a refusal must name the field: {answer.status} for {body}"
    return ".".join(named[0].split("[")[0].split(".")[:2])


def conditions_with_reasons(obj: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The conditions once the operator has reconciled this generation (each with a reason), else None."""
    status = (obj or {}).get("status") or {}
    conds = status.get("conditions") or []
    if not conds or status.get("observedGeneration") != (obj or {}).get("metadata", {}).get("generation"):
        return None
    return conds


def reconciled(kube: Kube, api_path: tuple[str, str, str | None], body: dict[str, Any]) -> list[dict[str, Any]]:
    plural, name, namespace = api_path
    try:
        conds = wait_for(f"{plural} {name} reconciled", lambda: conditions_with_reasons(
            kube.get(API, plural, name, namespace)), timeout=RECONCILE_BOUND_S, interval=0.2)
    except TimeoutError as exc:
        raise AssertionError(f"not reconciled to a Condition in {RECONCILE_BOUND_S} s: {body}: "
                             f"{kube.get(API, plural, name, namespace)}") from exc
    for c in conds:
        assert c.get("reason") and c["reason"][0].isupper() and c.get("type"), f"condition without a reason: {c}"
    return conds


def delete_and_wait(kube: Kube, plural: str, name: str, namespace: str | None) -> None:
    kube.delete(API, plural, name, namespace)
    wait_for(f"{plural} {name} gone", lambda: kube.get(API, plural, name, namespace) is None, timeout=60,
             interval=0.2)


@pytest.fixture(scope="module")
def refs(kube: Kube, crds: None, operator: OperatorProcess) -> Iterator[Refs]:
    """A flavor, a live tenant with its namespace and queue, a plain namespace, a pool of namespaces."""
    tag = f"fz{int(time.time()) % 100000}"
    flavor = f"h200-{tag}"
    kube.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor},
                "spec": {"nodeLabels": {"kvfleet.dev/gpu-flavor": "h200"}}})
    owner = f"{tag}-owner"
    kube.apply({"apiVersion": API, "kind": "Tenant", "metadata": {"name": owner},
                "spec": {"namespaces": [owner], "quotas": [{"flavor": flavor, "nominal": 2}]}})
    wait_for("the owner tenant's queue", lambda: kube.get("kueue.x-k8s.io/v1beta2", "localqueues", owner, owner),
             timeout=60)
    plain = f"{tag}-plain"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": plain}})
    pool = tuple(f"{tag}-ns{i}" for i in range(3))
    yield Refs(flavor=flavor, tenant_namespace=owner, queue=owner, plain_namespace=plain, namespace_pool=pool,
               reserved_namespace=SYSTEM_NAMESPACE)
    for mdep in kube.list(API, "modeldeployments", owner) + kube.list(API, "modeldeployments", plain):
        kube.delete(API, "modeldeployments", mdep["metadata"]["name"], mdep["metadata"]["namespace"])
    kube.delete(API, "tenants", owner)
    for tn in kube.list(API, "tenants"):
        if tn["metadata"]["name"].startswith(tag):
            kube.delete(API, "tenants", tn["metadata"]["name"])
    for ns in (owner, plain, *pool):
        kube.delete("v1", "namespaces", ns)
    kube.delete("kueue.x-k8s.io/v1beta2", "resourceflavors", flavor)


@pytest.fixture(scope="module")
def custom(k8s: Any) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(k8s)


def test_generated_model_deployments_are_refused_or_reconciled(kube: Kube, custom: Any, refs: Refs,
                                                               operator: OperatorProcess) -> None:
    started = time.monotonic()
    seen: collections.Counter[str] = collections.Counter()

    @FUZZ
    @given(body=model_deployments(refs))
    def one(body: dict[str, Any]) -> None:
        answer = send(custom, body)
        if answer.code == 409:  # a name an earlier example still holds: wait it out, once
            delete_and_wait(kube, "modeldeployments", body["metadata"]["name"], body["metadata"]["namespace"])
            answer = send(custom, body)
        if answer.code != 201:
            seen[f"refused:{check_refused(answer, body)}"] += 1
            return
        name, ns = body["metadata"]["name"], body["metadata"]["namespace"]
        try:
            conds = reconciled(kube, ("modeldeployments", name, ns), body)
            admitted = next(c for c in conds if c["type"] == "Admitted")
            seen[f"reconciled:{admitted['reason']}"] += 1
        finally:
            delete_and_wait(kube, "modeldeployments", name, ns)

    one()
    print(f"\nModelDeployments: {sum(seen.values())} examples in {time.monotonic() - started:.0f} s: "
          f"{dict(sorted(seen.items()))}")
    assert any(k.startswith("refused:") for k in seen) and any(k.startswith("reconciled:") for k in seen)


def test_generated_tenants_are_refused_or_reconciled(kube: Kube, custom: Any, refs: Refs,
                                                     operator: OperatorProcess) -> None:
    started = time.monotonic()
    seen: collections.Counter[str] = collections.Counter()
    prefix = refs.tenant_namespace.split("-")[0]

    @FUZZ
    @given(body=tenants(refs, prefix))
    def one(body: dict[str, Any]) -> None:
        answer = send(custom, body)
        if answer.code == 409:
            delete_and_wait(kube, "tenants", body["metadata"]["name"], None)
            answer = send(custom, body)
        if answer.code != 201:
            seen[f"refused:{check_refused(answer, body)}"] += 1
            return
        name = body["metadata"]["name"]
        try:
            (ready,) = [c for c in reconciled(kube, ("tenants", name, None), body) if c["type"] == "Ready"]
            seen[f"reconciled:{ready['reason']}"] += 1
        finally:
            delete_and_wait(kube, "tenants", name, None)

    one()
    print(f"\nTenants: {sum(seen.values())} examples in {time.monotonic() - started:.0f} s: "
          f"{dict(sorted(seen.items()))}")
    assert any(k.startswith("refused:") for k in seen) and any(k.startswith("reconciled:") for k in seen)


def test_the_operator_logged_no_unhandled_exception(operator: OperatorProcess) -> None:
    """Runs after the two above (file order): nothing they sent made a handler fail unexpectedly."""
    text = operator.log_text()
    bad = [line for line in text.splitlines()
           if "Traceback" in line or "failed with an exception" in line or "Unhandled" in line]
    assert not bad, "\n".join(bad[:20]) + f"\n(see {operator.log_path})"
    assert operator.healthy()
