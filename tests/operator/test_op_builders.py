"""Builders: the pod template, workload, Deployment and Service as plain dicts."""
from __future__ import annotations

import dataclasses

import pytest

from kvfleet.operator.builders import (
    build_deployment,
    build_disruption_budget,
    build_engine_args,
    build_pod_template,
    build_service,
    build_workload,
    workload_hash,
)
from kvfleet.operator.builders.workload import workload_pod_template
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.constants import LABEL_FLAVOR, LABEL_MDEP, LABEL_ORDINAL, LABEL_WORKLOAD_HASH
from kvfleet.operator.errors import SpecError
from kvfleet.operator.kube import object_path
from kvfleet.operator.spec import check_node_path, parse_model_deployment, parse_model_source

from op_factories import make_mdep


def _spec(**over):
    base = {"model": {"source": "org/m", "servedName": "m"}, "engine": {"tensorParallelSize": 2}}
    base.update(over)
    return parse_model_deployment(base)


def test_kvfleet_args_and_env(op_config: OperatorConfig) -> None:
    spec = _spec(engine={"tensorParallelSize": 2, "maxModelLen": 4096, "maxNumSeqs": 64,
                         "extraArgs": ["--enforce-eager"]}, apiKeySecretRef={"name": "keys"})
    command, args = build_engine_args(spec, op_config)
    assert command == ["kvfleet", "serve"]
    assert args[0] == "org/m"
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--tensor-parallel-size"] == "2" and flags["--max-model-len"] == "4096"
    assert flags["--served-model-name"] == "m" and flags["--port"] == "8000"
    assert "--api-keys-file" in args and args[-1] == "--enforce-eager"


def test_vllm_gets_vllm_serve_and_key_env(op_config: OperatorConfig) -> None:
    spec = _spec(engine={"kind": "vllm"}, apiKeySecretRef={"name": "keys", "key": "k"})
    tpl = build_pod_template("llama", spec, op_config)
    c = tpl["spec"]["containers"][0]
    assert c["command"] == ["vllm", "serve"] and c["image"] == op_config.vllm_image
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "k"}
    assert "--api-keys-file" not in c["args"]


def test_pod_template_security_probes_volumes(op_config: OperatorConfig) -> None:
    spec = _spec(model={"source": "pvc://models/llama"})
    tpl = build_pod_template("llama", spec, op_config, {"gpu": "h200"}, [{"key": "t", "operator": "Exists"}])
    pod = tpl["spec"]
    c = pod["containers"][0]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2" == c["resources"]["limits"]["nvidia.com/gpu"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    startup_budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup_budget >= op_config.startup_timeout_seconds
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" == c["livenessProbe"]["httpGet"]["path"]
    # Liveness tolerates a busy engine (a long prefill) for a minute or more before a restart.
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 60
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vols["model"]["persistentVolumeClaim"]["claimName"] == "models"
    assert c["args"][0] == "/models/models/llama"
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert {"key": "t", "operator": "Exists"} in pod["tolerations"]
    assert tpl["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    env = {e["name"] for e in c["env"]}
    assert {"KVFLEET_MODEL_DEPLOYMENT", "KVFLEET_POD_NAME", "KVFLEET_NAMESPACE"} <= env


def test_file_source_is_a_read_only_host_path(op_config: OperatorConfig) -> None:
    privileged = dataclasses.replace(op_config, tenant_pod_security="privileged")
    tpl = build_pod_template("x", _spec(model={"source": "file:///var/cache/kvfleet/m"}), privileged)
    vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
    assert vols["model"]["hostPath"]["path"] == "/var/cache/kvfleet/m"
    mount = next(m for m in tpl["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True


@pytest.mark.parametrize("level", ["restricted", "baseline"])
def test_file_source_is_refused_where_pod_security_forbids_host_paths(op_config: OperatorConfig, level: str) -> None:
    """PodSecurity would reject the pod (hostPath volumes are only `privileged`): say so instead of making it."""
    cfg = dataclasses.replace(op_config, tenant_pod_security=level)
    with pytest.raises(SpecError) as err:
        build_pod_template("x", _spec(model={"source": "file:///var/cache/kvfleet/m"}), cfg)
    assert err.value.reason == "HostPathNotAllowed" and f"the {level} Pod Security Standard" in err.value.message
    assert "pvc://" in err.value.message and "podSecurity.tenantEnforce" in err.value.message


def test_engine_pod_meets_the_restricted_pod_security_standard(op_config: OperatorConfig) -> None:
    """What PodSecurity's restricted level checks (the e2e test has the apiserver check it too), and a read-only
    root file system whose writable places are emptyDirs: HOME (every cache) and /tmp."""
    pod = build_pod_template("x", _spec(model={"source": "pvc://models/llama"}), op_config)["spec"]
    c = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False, "runAsNonRoot": True,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert all(set(v) & {"emptyDir", "persistentVolumeClaim", "secret"} for v in pod["volumes"])
    empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/tmp"] in empty and mounts["/home/kvfleet"] in empty and mounts["/models/hf-cache"] in empty
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] == "/home/kvfleet" and env["TRITON_CACHE_DIR"].startswith("/home/kvfleet/")
    assert env["XDG_CACHE_HOME"].startswith("/home/kvfleet/")


def test_tenant_pod_security_comes_from_the_environment() -> None:
    assert OperatorConfig.from_env({}).tenant_pod_security == "restricted"
    assert OperatorConfig.from_env({"KVFLEET_TENANT_POD_SECURITY": "privileged"}).tenant_pod_security == "privileged"
    assert OperatorConfig.from_env({"KVFLEET_TENANT_POD_SECURITY": ""}).tenant_pod_security == ""
    with pytest.raises(ValueError, match="KVFLEET_TENANT_POD_SECURITY"):
        OperatorConfig.from_env({"KVFLEET_TENANT_POD_SECURITY": "strict"})


def test_workload_one_pod_with_requests_queue_priority(op_config: OperatorConfig) -> None:
    mdep = make_mdep()
    spec = _spec(resources={"gpuFlavor": "h200", "cpu": "8", "memory": "64Gi"})
    wl = build_workload(mdep, spec, op_config, 2, "team-a", ("high", 1000), {"gpu": "h200"})
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["metadata"]["name"] == "llama-2"
    assert wl["spec"]["queueName"] == "team-a"
    assert wl["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                              "name": "high"}
    assert wl["spec"]["priority"] == 1000
    (ps,) = wl["spec"]["podSets"]
    assert ps["count"] == 1
    assert ps["template"]["spec"]["containers"][0]["resources"]["requests"] == {
        "cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}
    assert ps["template"]["spec"]["nodeSelector"] == {"gpu": "h200"}
    labels = wl["metadata"]["labels"]
    assert labels[LABEL_MDEP] == "llama" and labels[LABEL_ORDINAL] == "2" and labels[LABEL_FLAVOR] == "h200"
    owner = wl["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-1234" and owner["controller"] is True


def test_workload_hash_tracks_immutable_parts(op_config: OperatorConfig) -> None:
    t1 = workload_pod_template(_spec(), op_config, None)
    t2 = workload_pod_template(_spec(engine={"tensorParallelSize": 4}), op_config, None)
    assert workload_hash(t1, "q", None) == workload_hash(t1, "q", None)
    assert workload_hash(t1, "q", None) != workload_hash(t2, "q", None)
    assert workload_hash(t1, "q", None) != workload_hash(t1, "other", None)
    assert workload_hash(t1, "q", None) != workload_hash(t1, "q", ("p", 1))
    # A new image rolls the Deployment; it must not replace admitted workloads.
    t3 = workload_pod_template(_spec(engine={"tensorParallelSize": 2, "image": "other:1"}), op_config, None)
    assert workload_hash(t3, "q", None) == workload_hash(t1, "q", None)
    wl = build_workload(make_mdep(), _spec(), op_config, 0, "q")
    assert wl["metadata"]["labels"][LABEL_WORKLOAD_HASH] == workload_hash(t1, "q", None)
    assert "priorityClassRef" not in wl["spec"]


def test_deployment_never_surges_and_selects_its_flavor(op_config: OperatorConfig) -> None:
    mdep = make_mdep()
    dep = build_deployment(mdep, _spec(), op_config, "h200", 3, {"gpu": "h200"}, shape_hash="abcdef123")
    assert dep["metadata"]["name"] == "llama-h200-abcdef" and dep["spec"]["replicas"] == 3
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    sel = dep["spec"]["selector"]["matchLabels"]
    assert sel[LABEL_FLAVOR] == "h200" and sel[LABEL_WORKLOAD_HASH] == "abcdef123"
    assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h200"}


def test_service_selects_every_flavor(op_config: OperatorConfig) -> None:
    svc = build_service(make_mdep())
    dep = build_deployment(make_mdep(), _spec(), op_config, "l40s", 1)
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert LABEL_FLAVOR not in svc["spec"]["selector"]
    assert svc["spec"]["ports"][0]["port"] == 8000


def test_disruption_budget_covers_every_flavor_one_at_a_time(op_config: OperatorConfig) -> None:
    """A drain evicts one replica at a time, whatever its flavor; replicas that are not Ready never block it."""
    mdep = make_mdep()
    pdb = build_disruption_budget(mdep)
    assert pdb["apiVersion"] == "policy/v1" and pdb["metadata"]["name"] == mdep["metadata"]["name"]
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == mdep["metadata"]["uid"]
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    for flavor in ("h200", "l40s"):
        dep = build_deployment(mdep, _spec(), op_config, flavor, 2, shape_hash="abcdef123")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert LABEL_FLAVOR not in pdb["spec"]["selector"]["matchLabels"]
    assert object_path(pdb) == f"/apis/policy/v1/namespaces/{mdep['metadata']['namespace']}/poddisruptionbudgets/" \
        + mdep["metadata"]["name"]  # the client can apply it


@pytest.mark.parametrize("source", ["file:///", "file:///var/lib/kubelet/pods", "file:///var/cache/kvfleet/../../etc",
                                    "file:///var/cache/kvfleet-other/m"])
def test_file_source_outside_the_node_cache_is_refused(op_config: OperatorConfig, source: str) -> None:
    """A tenant may not mount the node's own files (kubelet credentials, other pods' tokens)."""
    with pytest.raises(SpecError) as err:
        build_pod_template("x", _spec(model={"source": source}), op_config)
    assert err.value.field == "spec.model.source" and err.value.reason == "HostPathNotAllowed"


def test_node_cache_roots_come_from_the_environment() -> None:
    cfg = OperatorConfig.from_env({"KVFLEET_NODE_CACHE_ROOTS": "/mnt/models, /data/llm"})
    assert cfg.node_cache_roots == ("/mnt/models", "/data/llm")
    check_node_path(parse_model_source("file:///data/llm/x"), cfg.node_cache_roots)
    off = OperatorConfig.from_env({"KVFLEET_NODE_CACHE_ROOTS": ""})
    with pytest.raises(SpecError, match="file:// sources are off"):
        check_node_path(parse_model_source("file:///data/llm/x"), off.node_cache_roots)


def test_pod_outlives_the_engines_drain(op_config: OperatorConfig) -> None:
    """terminationGracePeriodSeconds = the engine's --shutdown-grace-period + a margin, whatever sets it."""
    from kvfleet.engine.server.args import SERVE_FLAGS
    from kvfleet.operator.builders.grace import (
        DEFAULT_ENGINE_GRACE_SECONDS,
        TERMINATION_MARGIN_SECONDS,
        engine_grace_seconds,
    )

    assert DEFAULT_ENGINE_GRACE_SECONDS == next(f.default for f in SERVE_FLAGS if f.name == "--shutdown-grace-period")
    cases = [({}, 30), ({"extraArgs": ["--shutdown-grace-period", "120"]}, 120),
             ({"extraArgs": ["--shutdown-grace-period=7.5"]}, 7.5),
             ({"env": [{"name": "KVFLEET_SHUTDOWN_GRACE_PERIOD", "value": "45"}]}, 45),
             ({"extraArgs": ["--shutdown-grace-period", "0"],
               "env": [{"name": "KVFLEET_SHUTDOWN_GRACE_PERIOD", "value": "45"}]}, 0),
             ({"extraArgs": ["--shutdown-grace-period", "soon"]}, 30)]
    for engine, grace in cases:
        spec = _spec(engine={"tensorParallelSize": 1, **engine})
        assert engine_grace_seconds(spec.extra_args, spec.env) == grace, engine
        tpl = build_pod_template("m", spec, op_config)
        args = tpl["spec"]["containers"][0]["args"]
        assert args[args.index("--shutdown-grace-period") + 1] == f"{grace:g}"
        assert tpl["spec"]["terminationGracePeriodSeconds"] == -(-grace // 1) + TERMINATION_MARGIN_SECONDS
    vllm = build_pod_template("m", _spec(engine={"kind": "vllm"}), op_config)
    assert "--shutdown-grace-period" not in vllm["spec"]["containers"][0]["args"]
    assert vllm["spec"]["terminationGracePeriodSeconds"] == 30 + TERMINATION_MARGIN_SECONDS
