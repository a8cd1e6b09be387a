"""Hypothesis strategies for Tenant and ModelDeployment bodies: valid ones, and near-valid ones (a wrong type, a
number out of range, a bad name, a missing field, the edges of the CEL rules) that the apiserver must refuse with
a field error, or the operator must turn into a Condition with a reason.

`Refs` says what exists in the cluster (a flavor, a tenant namespace and its queue), so that references hit both
existing and missing objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

API = "serving.kvfleet.dev/v1alpha1"


@dataclass(frozen=True)
class Refs:
    flavor: str  # an existing ResourceFlavor
    tenant_namespace: str  # a namespace of a live Tenant (its LocalQueue exists)
    queue: str  # that tenant's LocalQueue
    plain_namespace: str  # a namespace that belongs to no Tenant
    namespace_pool: tuple[str, ...]  # namespaces generated Tenants may claim (made and deleted by the test)
    reserved_namespace: str  # the operator's own (KVFLEET_SYSTEM_NAMESPACES)


def _opt(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A value or the key left out (None is dropped by `_drop_none`)."""
    return st.one_of(st.none(), strategy)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _fixed(d: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(d).map(_drop_none)


dns_label = st.from_regex(r"\A[a-z]([-a-z0-9]{0,20}[a-z0-9])?\Z")
near_names = st.sampled_from([
    "1starts-with-digit", "Upper", "under_score", "dot.ted", "-dash", "dash-", "m" * 64, "a" * 63, "x",
    "has space", "ünïcode",
])
# Text the apiserver stores as is, including what shells, YAML and flags mind.
free_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
wrong_type = st.sampled_from([True, [], {}, 1.5, "1", -1])
quantities = st.sampled_from(["1", "2", "500m", "0.5", "1.5", "0", "0m", "-1", "1e3", "abc", "1Ki", "8Gi", "1.5Gi",
                              "0.0001", "999999999999", "", " 2", "2 ", "1Gi ", "16Ei"])
int_or_wrong = st.one_of(st.integers(-3, 10), st.integers(-(2**63), 2**63 - 1), wrong_type)


def model_sources(refs: Refs) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from([
            "org/model", "HuggingFaceTB/SmolLM2-135M-Instruct", "model", "pvc://models/llama/8b", "pvc://models",
            "file:///var/cache/kvfleet/m", "file:///var/cache/kvfleet", "file:///var/cache/kvfleet/../../etc",
            "file:///etc/passwd", "file://relative", "pvc://Bad_Claim/x", "s3://bucket/m", "org/has space",
            "a/b/c", "", "/abs", "org/", "http://x/y",
        ]),
        st.from_regex(r"\A[A-Za-z0-9][-A-Za-z0-9_.]{0,10}/[-A-Za-z0-9_.]{1,10}\Z"),
        wrong_type,
    )


def engines() -> st.SearchStrategy[Any]:
    env_items = st.one_of(
        _fixed({"name": st.one_of(dns_label.map(str.upper), st.just(""), free_text), "value": _opt(free_text)}),
        st.just({"name": "FROM_FIELD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        st.just({"name": "BAD_REF", "valueFrom": "not-an-object"}),
        st.just({"value": "no name"}),
    )
    return st.one_of(st.none(), wrong_type, _fixed({
        "kind": _opt(st.one_of(st.sampled_from(["kvfleet", "vllm", "tgi", "KVFLEET", ""]), wrong_type)),
        "image": _opt(st.one_of(st.sampled_from(["img:1", "registry.local/kvfleet:0.1", " spaced ", ""]),
                                free_text)),
        "tensorParallelSize": _opt(st.one_of(st.integers(-1, 10), wrong_type)),
        "maxModelLen": _opt(int_or_wrong),
        "gpuMemoryUtilization": _opt(st.one_of(
            st.floats(-0.5, 1.5, allow_nan=False), st.sampled_from([0, 1, 0.0, 1.0, 1e-9, 1.0000001]),
            st.sampled_from(["0.9", True]))),
        "maxNumSeqs": _opt(int_or_wrong),
        "extraArgs": _opt(st.one_of(
            st.lists(st.one_of(free_text, st.sampled_from(["--enforce-eager", "--port", "--port=9000", "-tp",
                                                           "--max-num-seqs=8", "--portal"])), max_size=3),
            st.just("--flag"), st.just([1, 2]))),
        "env": _opt(st.one_of(st.lists(env_items, max_size=3), st.just({"A": "b"}))),
    }))


def resources(refs: Refs) -> st.SearchStrategy[Any]:
    quantity = st.one_of(quantities, st.integers(-2, 64), st.sampled_from([0.5, True, None]))
    return st.one_of(st.none(), wrong_type, _fixed({
        "gpuFlavor": _opt(st.one_of(st.just(refs.flavor), st.just("missing-flavor"), near_names, wrong_type)),
        "cpu": _opt(quantity),
        "memory": _opt(quantity),
        "shmSize": _opt(quantity),
    }))


def autoscalings() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), wrong_type, _fixed({
        "enabled": _opt(st.one_of(st.booleans(), st.just("yes"))),
        "minReplicas": _opt(st.one_of(st.integers(-1, 4), wrong_type)),
        "maxReplicas": _opt(st.one_of(st.integers(-1, 4), wrong_type)),
        "targetQueueDepth": _opt(st.one_of(st.integers(-1, 64), wrong_type)),
        "scaleDownDelaySeconds": _opt(st.one_of(st.integers(-1, 600), wrong_type)),
    }))


def model_deployment_specs(refs: Refs) -> st.SearchStrategy[Any]:
    model = st.one_of(
        _fixed({"source": model_sources(refs), "servedName": _opt(st.one_of(free_text, st.just("x" * 257)))}),
        st.just({}), wrong_type)
    return st.one_of(
        _fixed({
            "model": model,
            "engine": engines(),
            "resources": resources(refs),
            "replicas": _opt(st.one_of(st.integers(-2, 3), wrong_type)),
            "autoscaling": autoscalings(),
            "queueName": _opt(st.one_of(st.just(refs.queue), st.just("no-such-queue"), near_names, wrong_type)),
            "priorityClassName": _opt(st.one_of(st.just("no-such-priority"), near_names)),
            "apiKeySecretRef": _opt(st.one_of(_fixed({"name": _opt(st.sampled_from(["keys", ""])),
                                                      "key": _opt(st.sampled_from(["api-key", ""]))}), wrong_type)),
        }),
        st.just(None), wrong_type)


def valid_model_deployment_specs(refs: Refs) -> st.SearchStrategy[dict[str, Any]]:
    """Specs the schema accepts (references may still miss: a flavor, a queue, a priority class)."""
    return _fixed({
        "model": _fixed({"source": st.sampled_from(["org/model", "pvc://models/llama/8b", "file:///var/cache/m"]),
                         "servedName": _opt(dns_label)}),
        "engine": _opt(_fixed({"kind": _opt(st.sampled_from(["kvfleet", "vllm"])),
                               "tensorParallelSize": _opt(st.sampled_from([1, 2])),
                               "maxModelLen": _opt(st.integers(16, 4096))})),
        "resources": _fixed({"gpuFlavor": st.sampled_from([refs.flavor, refs.flavor, "missing-flavor"])}),
        "replicas": _opt(st.integers(0, 3)),
        "autoscaling": _opt(_fixed({"enabled": st.booleans(), "minReplicas": _opt(st.integers(0, 1)),
                                    "maxReplicas": _opt(st.integers(1, 3))})),
        "queueName": _opt(st.sampled_from([refs.queue, "no-such-queue"])),
        "priorityClassName": _opt(st.just("no-such-priority")),
    })


def _one_field_changed(valid: st.SearchStrategy[dict[str, Any]],
                       fuzzed: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid spec with one top-level field replaced by the same field of a fuzzed spec (near-valid: most of it
    passes, so the error is about that one field)."""
    def merge(base: dict[str, Any], other: Any, pick: int) -> dict[str, Any]:
        if not isinstance(other, dict) or not other:
            return base
        key = sorted(other)[pick % len(other)]
        return {**base, key: other[key]}
    return st.builds(merge, valid, fuzzed, st.integers(0, 7))


def model_deployments(refs: Refs) -> st.SearchStrategy[dict[str, Any]]:
    """A ModelDeployment body (namespace: the tenant's or a plain one; name: valid or near-valid); its spec valid,
    valid but one field, or fuzzed throughout (about a third each)."""
    name = st.one_of(dns_label, dns_label, dns_label, near_names)
    namespace = st.sampled_from([refs.tenant_namespace, refs.tenant_namespace, refs.plain_namespace])
    valid = valid_model_deployment_specs(refs)
    spec = st.one_of(valid, _one_field_changed(valid, model_deployment_specs(refs)), model_deployment_specs(refs))
    return st.builds(lambda n, ns, spec: _drop_none({
        "apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": n, "namespace": ns}, "spec": spec}),
        name, namespace, spec)


def quotas(refs: Refs) -> st.SearchStrategy[Any]:
    quantity = st.one_of(quantities, st.integers(-2, 64))
    one = _fixed({
        "flavor": st.one_of(st.just(refs.flavor), st.just(refs.flavor), st.just("missing-flavor"), near_names,
                            wrong_type),
        "nominal": _opt(st.one_of(st.integers(-1, 16), wrong_type)),
        "borrowingLimit": _opt(st.one_of(st.integers(-1, 8), wrong_type)),
        "lendingLimit": _opt(st.one_of(st.integers(-1, 20), wrong_type)),
        "cpu": _opt(quantity),
        "memory": _opt(quantity),
    })
    return st.one_of(st.lists(one, min_size=0, max_size=3), st.just([{"flavor": refs.flavor, "nominal": 1}] * 17),
                     wrong_type)


def tenant_specs(refs: Refs) -> st.SearchStrategy[Any]:
    namespace = st.one_of(st.sampled_from(refs.namespace_pool), st.just(refs.tenant_namespace),
                          st.just(refs.reserved_namespace), st.just("kube-system"), st.just("kube-fresh"),
                          near_names)
    return st.one_of(_fixed({
        "namespaces": st.one_of(st.lists(namespace, min_size=0, max_size=3), st.just(refs.namespace_pool[0]),
                                wrong_type),
        "quotas": quotas(refs),
        "cohort": _opt(st.one_of(st.sampled_from(["fz-cohort", "a.b", "Bad_Cohort", "-x", ""]), wrong_type)),
        "fairSharingWeight": _opt(st.one_of(st.sampled_from(["1", "0", "0.5", "-1", "abc", "1e3", "", "2.50"]),
                                            st.integers(-1, 3), st.just(1.5))),
        "preemption": _opt(st.one_of(_fixed({
            "reclaimWithinCohort": _opt(st.sampled_from(["Never", "LowerPriority", "Any", "Sometimes"])),
            "withinClusterQueue": _opt(st.sampled_from(["Never", "LowerOrNewerEqualPriority", "Always"])),
        }), wrong_type)),
        "group": _opt(st.one_of(free_text, wrong_type)),
    }), st.just(None), wrong_type)


def valid_tenant_specs(refs: Refs) -> st.SearchStrategy[dict[str, Any]]:
    """Specs the schema accepts (a namespace may still be taken or reserved, a flavor missing)."""
    namespace = st.sampled_from([*refs.namespace_pool, *refs.namespace_pool, refs.tenant_namespace,
                                 refs.reserved_namespace])
    quota = _fixed({"flavor": st.sampled_from([refs.flavor, refs.flavor, "missing-flavor"]),
                    "nominal": st.integers(0, 8), "cpu": _opt(st.sampled_from(["4", "500m"]))})
    return _fixed({
        "namespaces": st.lists(namespace, min_size=1, max_size=2, unique=True),
        "quotas": st.lists(quota, min_size=1, max_size=2, unique_by=lambda q: q["flavor"]),
        "fairSharingWeight": _opt(st.sampled_from(["1", "0.5", "2"])),
        "preemption": _opt(_fixed({"withinClusterQueue": _opt(st.sampled_from(["Never", "LowerPriority"]))})),
    })


def tenants(refs: Refs, prefix: str) -> st.SearchStrategy[dict[str, Any]]:
    """A Tenant body; valid names start with `prefix` (the test's) so runs never collide; its spec valid, valid but
    one field, or fuzzed throughout (about a third each)."""
    valid_name = dns_label.map(lambda n: f"{prefix}-{n}"[:63].rstrip("-"))
    name = st.one_of(valid_name, valid_name, valid_name, near_names)
    valid = valid_tenant_specs(refs)
    spec = st.one_of(valid, _one_field_changed(valid, tenant_specs(refs)), tenant_specs(refs))
    return st.builds(lambda n, spec: _drop_none({
        "apiVersion": API, "kind": "Tenant", "metadata": {"name": n}, "spec": spec}), name, spec)
