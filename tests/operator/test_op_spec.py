"""Spec parsing: defaults like the CRD's, errors naming the field."""
from __future__ import annotations

import pytest

from kvfleet.operator.errors import SpecError
from kvfleet.operator.spec import OWNED_FLAGS, owned_flag, parse_model_deployment, parse_model_source, parse_tenant


def test_defaults_match_the_crd() -> None:
    spec = parse_model_deployment({"model": {"source": "HuggingFaceTB/SmolLM2-135M-Instruct"}})
    assert spec.engine_kind == "kvfleet"
    assert spec.tensor_parallel_size == 1
    assert spec.gpu_memory_utilization == 0.9
    assert spec.replicas == 1
    assert spec.served_name == "SmolLM2-135M-Instruct"
    assert (spec.cpu, spec.memory, spec.shm_size) == ("4", "32Gi", "8Gi")
    assert spec.autoscaling.enabled is False


@pytest.mark.parametrize("uri, kind, claim, path", [
    ("org/model", "hub", None, None),
    ("pvc://models/llama/8b", "pvc", "models", "llama/8b"),
    ("pvc://models", "pvc", "models", ""),
    ("file:///var/cache/models/x", "file", None, "/var/cache/models/x"),
])
def test_model_sources(uri: str, kind: str, claim: str | None, path: str | None) -> None:
    src = parse_model_source(uri)
    assert (src.kind, src.claim, src.path) == (kind, claim, path)


@pytest.mark.parametrize("uri, field", [
    ("", "spec.model.source"), ("s3://bucket/x", "spec.model.source"),
    ("file://relative", "spec.model.source"), ("pvc://Bad_Claim/x", "spec.model.source"),
    ("has space/x", "spec.model.source"), ("org/name/extra", "spec.model.source"), ("/abs/path", "spec.model.source"),
])
def test_bad_sources_name_the_field(uri: str, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_model_source(uri)
    assert err.value.field == field


@pytest.mark.parametrize("patch, field", [
    ({"replicas": -1}, "spec.replicas"),
    ({"engine": {"kind": "tgi"}}, "spec.engine.kind"),
    ({"engine": {"gpuMemoryUtilization": 0}}, "spec.engine.gpuMemoryUtilization"),
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization"),
    ({"engine": {"tensorParallelSize": 0}}, "spec.engine.tensorParallelSize"),
    ({"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
    ({"resources": {"gpuFlavor": "H200!"}}, "spec.resources.gpuFlavor"),
    ({"resources": {"cpu": -1}}, "spec.resources.cpu"),
    ({"resources": {"memory": "0Gi"}}, "spec.resources.memory"),
    ({"resources": {"shmSize": "-1Gi"}}, "spec.resources.shmSize"),
    ({"engine": {"extraArgs": ["--enforce-eager", "--port", "9000"]}}, "spec.engine.extraArgs"),
    ({"engine": {"extraArgs": ["--tensor-parallel-size=4"]}}, "spec.engine.extraArgs"),
    ({"engine": {"extraArgs": ["-tp", "2"]}}, "spec.engine.extraArgs"),
])
def test_invalid_model_deployment(patch: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_model_deployment({"model": {"source": "a/b"}, **patch})
    assert err.value.field == field
    assert field in str(err.value)


def test_tenant_parsing_and_errors() -> None:
    t = parse_tenant({"namespaces": ["a", "b"], "cohort": "c",
                      "quotas": [{"flavor": "h200", "nominal": 4, "borrowingLimit": 2, "lendingLimit": 1}]})
    assert t.namespaces == ("a", "b") and t.quotas[0].nominal == 4 and t.quotas[0].borrowing_limit == 2
    with pytest.raises(SpecError, match=r"spec.quotas\[0\].borrowingLimit"):
        parse_tenant({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 4, "borrowingLimit": 2}]})
    with pytest.raises(SpecError, match=r"spec.quotas\[0\].lendingLimit"):
        parse_tenant({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 1, "lendingLimit": 2}]})
    with pytest.raises(SpecError, match=r"spec.quotas\[1\].flavor"):
        parse_tenant({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 1},
                                                      {"flavor": "h200", "nominal": 1}]})
    with pytest.raises(SpecError, match="spec.namespaces"):
        parse_tenant({"namespaces": [], "quotas": [{"flavor": "h200", "nominal": 1}]})
    with pytest.raises(SpecError, match="spec.fairSharingWeight"):
        parse_tenant({"namespaces": ["a"], "fairSharingWeight": -1, "quotas": [{"flavor": "h200", "nominal": 1}]})
    with pytest.raises(SpecError, match=r"spec.quotas\[0\].cpu"):
        parse_tenant({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 1, "cpu": "-4"}]})
    zero_cpu = parse_tenant({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 1, "cpu": 0}]})
    assert zero_cpu.quotas[0].cpu == "0"


def test_served_name_and_tenant_key_secrets_shared_with_the_gateway() -> None:
    from kvfleet.operator.spec import served_name, tenant_key_secrets

    assert served_name({"source": "org/My-Model", "servedName": "chat"}) == "chat"
    assert served_name({"source": "pvc://models/llama/3b/"}) == "3b"
    assert tenant_key_secrets({"gateway": {"apiKeySecrets": [{"name": "a"}, {"name": "b"}]}}) == ("a", "b")
    assert tenant_key_secrets({"namespaces": ["x"]}) == ()


@pytest.mark.parametrize("flag", sorted(OWNED_FLAGS))
def test_flags_the_operator_sets_are_refused_in_extra_args(flag: str) -> None:
    for args in ([flag, "1"], [f"{flag}=1"]):
        with pytest.raises(SpecError) as err:
            parse_model_deployment({"model": {"source": "a/b"}, "engine": {"extraArgs": ["--enforce-eager", *args]}})
        assert err.value.field == "spec.engine.extraArgs" and flag in str(err.value)


def test_other_flags_pass_through_extra_args() -> None:
    args = ["--enforce-eager", "--shutdown-grace-period=30", "--port-range", "--max-num-batched-tokens", "4096"]
    assert owned_flag(args) is None
    spec = parse_model_deployment({"model": {"source": "a/b"}, "engine": {"extraArgs": args}})
    assert spec.extra_args == tuple(args)
