"""The CRDs in crds/ (the one source) and the chart's copy of them."""
from __future__ import annotations

from pathlib import Path

import yaml

from kvfleet.operator.spec import OWNED_FLAGS

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"


def load(name: str) -> dict:
    return yaml.safe_load((CRDS / name).read_text())


def test_model_deployment_crd() -> None:
    crd = load("serving.kvfleet.dev_modeldeployments.yaml")
    assert crd["spec"]["group"] == "serving.kvfleet.dev" and crd["spec"]["scope"] == "Namespaced"
    assert "mdep" in crd["spec"]["names"]["shortNames"]
    (v,) = crd["spec"]["versions"]
    assert v["name"] == "v1alpha1" and v["storage"] and v["served"]
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                          "statusReplicasPath": ".status.replicas",
                                          "labelSelectorPath": ".status.selector"}
    assert "status" in v["subresources"]
    cols = {c["name"] for c in v["additionalPrinterColumns"]}
    assert {"Engine", "Desired", "Admitted", "Ready", "Age"} <= cols
    spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["replicas"]["minimum"] == 0
    assert spec["engine"]["properties"]["kind"]["enum"] == ["kvfleet", "vllm"]
    assert spec["engine"]["properties"]["gpuMemoryUtilization"]["x-kubernetes-validations"]
    assert "minReplicas <= " in spec["autoscaling"]["x-kubernetes-validations"][0]["rule"]
    # the flags the operator sets: the CRD's rule refuses the list the operator's parse refuses
    (extra_rule,) = spec["engine"]["properties"]["extraArgs"]["x-kubernetes-validations"]
    listed = extra_rule["rule"].split("a in [", 1)[1].split("]", 1)[0]
    assert [f.strip(" '") for f in listed.split(",")] == list(OWNED_FLAGS)
    root_rules = [r["rule"] for r in v["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]]
    assert any("self.metadata.name.size() <= 63" in r for r in root_rules)  # the Service's name
    for res in ("cpu", "memory", "shmSize"):
        assert "isGreaterThan" in spec["resources"]["properties"][res]["x-kubernetes-validations"][0]["rule"]
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["autoscaler"]["x-kubernetes-preserve-unknown-fields"] is True
    for key in ("conditions", "replicas", "admittedReplicas", "readyReplicas", "desiredReplicas", "endpoint",
                "observedGeneration"):
        assert key in status


def test_tenant_crd() -> None:
    crd = load("serving.kvfleet.dev_tenants.yaml")
    assert crd["spec"]["scope"] == "Cluster"
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert schema["properties"]["quotas"]["x-kubernetes-list-map-keys"] == ["flavor"]
    quota = schema["properties"]["quotas"]["items"]["properties"]
    assert {"nominal", "borrowingLimit", "lendingLimit"} <= quota.keys()
    assert any("cohort" in r["rule"] for r in schema["x-kubernetes-validations"])
    assert "kube-" in schema["properties"]["namespaces"]["x-kubernetes-validations"][0]["rule"]
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert any("self.metadata.name.size() <= 63" in r["rule"] for r in root["x-kubernetes-validations"])


def test_chart_carries_the_same_crds() -> None:
    chart_crds = ROOT / "charts" / "kvfleet" / "crds"
    ours = sorted(p.name for p in CRDS.glob("*.yaml"))
    assert ours and sorted(p.name for p in chart_crds.glob("*.yaml")) == ours
    for name in ours:
        assert (chart_crds / name).read_bytes() == (CRDS / name).read_bytes(), name


def undescribed(schema: dict, path: str = "") -> list[str]:
    """Fields without a description (what `kubectl explain` would show as empty). The root `metadata` is the
    apiserver's ObjectMeta, which it describes itself."""
    out = []
    for name, prop in (schema.get("properties") or {}).items():
        here = f"{path}.{name}"
        if not prop.get("description") and here != ".metadata":
            out.append(here)
        out += undescribed(prop, here)
    if isinstance(schema.get("items"), dict):
        out += undescribed(schema["items"], f"{path}[]")
    return out


def test_every_field_of_both_crds_is_described() -> None:
    for name in ("serving.kvfleet.dev_modeldeployments.yaml", "serving.kvfleet.dev_tenants.yaml"):
        for version in load(name)["spec"]["versions"]:
            schema = version["schema"]["openAPIV3Schema"]
            assert schema.get("description"), name
            assert undescribed(schema) == [], name


def test_tenant_gateway_keys_field_names_its_secrets() -> None:
    crd = load("serving.kvfleet.dev_tenants.yaml")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    keys = spec["properties"]["gateway"]["properties"]["apiKeySecrets"]
    assert keys["x-kubernetes-list-map-keys"] == ["name"] and keys["items"]["required"] == ["name"]
    assert "Authorization: Bearer" in keys["description"]
