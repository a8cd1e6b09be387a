"""The engine kubelet's decisions (e2e/cluster/localcluster/enginekubelet): which command serves an operator's
pod on CPU, the status it reports, its probes and restart back-off, and the kwok stages it relies on. Pure: the
operator's own pod builder makes the pods; no cluster, no process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "cluster"))

from kvfleet.operator.builders.pod import build_pod_template
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.constants import LABEL_NAME
from kvfleet.operator.spec import parse_model_deployment

from localcluster import manifests  # noqa: E402
from localcluster.enginekubelet import models, secret_volumes  # noqa: E402
from localcluster.enginekubelet.pods import (  # noqa: E402
    ENGINE_LABEL,
    ENGINE_LABEL_VALUE,
    EngineOptions,
    LocalModel,
    MissingSecret,
    SecretVolume,
    container_to_local,
    engine_command,
    is_engine_pod,
    parse_args,
    parse_pod,
    resolve_env,
    secret_files,
)
from localcluster.enginekubelet.probes import ProbeTracker  # noqa: E402
from localcluster.enginekubelet.status import (  # noqa: E402
    ContainerState,
    restart_delay,
    status_drifted,
    status_patch,
    terminated,
)

OPTIONS = EngineOptions(python="/venv/bin/python")
TINY = LocalModel("tiny", "/cache/models/tiny-llama-x", 1024)


def operator_pod(ip: str | None = "127.101.0.7", **spec: Any) -> dict[str, Any]:
    """A pod as the operator's template makes it, scheduled and addressed."""
    body = {"model": {"source": "HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "chat"},
            "engine": {"kind": "kvfleet", "tensorParallelSize": 2, "maxModelLen": 8192}, **spec}
    template = build_pod_template("chat", parse_model_deployment(body), OperatorConfig())
    status: dict[str, Any] = {"phase": "Pending"}
    if ip:
        status["podIP"] = ip
    return {"metadata": {**template["metadata"], "name": "chat-h200-abc", "namespace": "team-a", "uid": "u-1"},
            "spec": {**template["spec"], "nodeName": "gpu-h200-0"}, "status": status}


def test_the_operator_label_is_what_kwok_and_the_engine_kubelet_select_on() -> None:
    assert (ENGINE_LABEL, ENGINE_LABEL_VALUE) == (LABEL_NAME, "kvfleet-engine")
    assert (manifests.ENGINE_LABEL, manifests.ENGINE_LABEL_VALUE) == (ENGINE_LABEL, ENGINE_LABEL_VALUE)
    assert is_engine_pod(operator_pod())
    assert not is_engine_pod({"metadata": {"labels": {"app": "other"}}})


def test_an_operator_pod_becomes_a_cpu_kvfleet_serve_on_its_loopback_ip() -> None:
    pod = parse_pod(operator_pod())
    assert (pod.port, pod.container, pod.restart_policy) == (8000, "engine", "Always")
    assert pod.readiness and pod.readiness.period_s == 5 and pod.readiness.failure_threshold == 3
    cmd = engine_command(pod, TINY, OPTIONS, {}, {})
    argv = list(cmd.argv)
    assert argv[:5] == ["/venv/bin/python", "-m", "kvfleet.engine.cli", "serve", TINY.path]
    assert argv[-8:] == ["--host", "127.101.0.7", "--port", "8000", "--device", "cpu", "--tensor-parallel-size", "1"]
    assert "0.0.0.0" not in argv and "--gpu-memory-utilization" not in argv
    assert argv.count("--host") == argv.count("--port") == argv.count("--tensor-parallel-size") == 1
    assert argv[argv.index("--served-model-name") + 1] == "chat"
    assert argv[argv.index("--max-model-len") + 1] == "1024"  # capped to the tiny model's
    assert argv[argv.index("--max-num-seqs") + 1] == "4"  # frugal default when the pod sets none
    assert any("capped to 1024" in n for n in cmd.notes)
    assert any("HuggingFaceTB/SmolLM2-135M-Instruct served by the local model tiny" in n for n in cmd.notes)


def test_pod_values_that_fit_are_kept_and_too_many_seqs_are_capped() -> None:
    pod = parse_pod(operator_pod(engine={"kind": "kvfleet", "maxModelLen": 512, "maxNumSeqs": 2,
                                         "extraArgs": ["--enable-prefix-caching", "--max-queue-len=8"]}))
    argv = list(engine_command(pod, TINY, OPTIONS, {}, {}).argv)
    assert argv[argv.index("--max-model-len") + 1] == "512"
    assert argv[argv.index("--max-num-seqs") + 1] == "2" and argv.count("--max-num-seqs") == 1
    assert "--enable-prefix-caching" in argv and "--max-queue-len" in argv
    big = parse_pod(operator_pod(engine={"kind": "vllm", "maxNumSeqs": 128}))
    cmd = engine_command(big, TINY, OPTIONS, {}, {})
    assert cmd.argv[cmd.argv.index("--max-num-seqs") + 1] == "16"
    assert big.engine_kind == "vllm" and any("vLLM pod" in n for n in cmd.notes)


def test_the_api_keys_file_is_read_from_the_secret_volumes_local_copy() -> None:
    pod = parse_pod(operator_pod(apiKeySecretRef={"name": "chat-keys", "key": "keys.yaml"}))
    assert pod.secret_volumes == (SecretVolume("api-keys", "chat-keys", "/etc/kvfleet/api-keys"),)
    cmd = engine_command(pod, TINY, OPTIONS, {"/etc/kvfleet/api-keys": "/run/v/u-1/api-keys"}, {})
    assert cmd.argv[cmd.argv.index("--api-keys-file") + 1] == "/run/v/u-1/api-keys/keys.yaml"
    assert container_to_local("/etc/kvfleet/api-keys-other/x", {"/etc/kvfleet/api-keys": "/l"}) == \
        "/etc/kvfleet/api-keys-other/x"
    volume = SecretVolume("v", "s", "/m", items=(("a", "dir/a.txt"),))
    assert secret_files(volume, {"a": b"1", "b": b"2"}) == {"dir/a.txt": b"1"}


def test_a_pod_whose_ip_is_not_loopback_gets_no_engine() -> None:
    with pytest.raises(ValueError, match="not a loopback"):
        engine_command(parse_pod(operator_pod(ip="10.0.0.7")), TINY, OPTIONS, {}, {})
    assert parse_pod(operator_pod(ip=None)).loopback_ip() is None


def test_the_engine_environment_resolves_fields_and_secrets_and_stays_frugal() -> None:
    obj = operator_pod(engine={"kind": "vllm", "env": [{"name": "EXTRA", "value": "1"}]},
                       apiKeySecretRef={"name": "k", "key": "api-key"})
    pod = parse_pod(obj)
    env = resolve_env(pod, {"PATH": "/bin", "HOME": "/root", "SECRET_OF_THE_NODE": "x"},
                      lambda name, key: f"{name}/{key}")
    assert env["KVFLEET_POD_NAME"] == "chat-h200-abc" and env["KVFLEET_NAMESPACE"] == "team-a"
    assert env["KVFLEET_SERVED_MODEL_NAME"] == "chat" and env["EXTRA"] == "1"
    assert env["VLLM_API_KEY"] == env["KVFLEET_API_KEY"] == "k/api-key"
    assert env["OMP_NUM_THREADS"] == "1" and env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert "SECRET_OF_THE_NODE" not in env and "HF_HOME" not in env
    # The pod's HOME and caches are its emptyDirs' paths: the engine keeps the node's.
    assert env["HOME"] == "/root" and "XDG_CACHE_HOME" not in env and "TRITON_CACHE_DIR" not in env
    with pytest.raises(MissingSecret, match="'k' key 'api-key'"):
        resolve_env(pod, {}, lambda name, key: None)


def test_args_parse_like_the_engine_cli() -> None:
    parsed = parse_args(["m", "--enforce-eager", "--port", "1", "--x=y", "--vllm-only", "v",
                         "--no-enable-chunked-prefill"])
    assert parsed.model == "m"
    assert parsed.flags == (("--enforce-eager", None), ("--port", "1"), ("--x", "y"), ("--vllm-only", "v"),
                            ("--no-enable-chunked-prefill", None))


def test_status_patch_keeps_transition_times_and_reports_like_a_kubelet() -> None:
    current = {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "T0"},
                              {"type": "ContainersReady", "status": "True", "lastTransitionTime": "T0"}]}
    running = ContainerState("engine", "img", restart_count=1, ready=False, running_since="T1",
                             last=terminated(-9, "T0", "T1"))
    patch = status_patch(current, running, "Running", "T2")["status"]
    ready = {c["type"]: c for c in patch["conditions"]}
    assert ready["Ready"]["lastTransitionTime"] == "T0" and ready["Ready"]["reason"] == "ContainersNotReady"
    assert ready["ContainersReady"]["status"] == "False" and ready["ContainersReady"]["lastTransitionTime"] == "T2"
    [container] = patch["containerStatuses"]
    assert container["state"] == {"running": {"startedAt": "T1"}} and container["restartCount"] == 1
    assert container["lastState"]["terminated"]["exitCode"] == 137
    assert container["lastState"]["terminated"]["message"] == "killed by SIGKILL"
    assert terminated(0, "a", "b").reason == "Completed" and terminated(2, "a", "b").reason == "Error"


def test_a_status_someone_else_wrote_is_written_back() -> None:
    ready = ContainerState("engine", "img", restart_count=0, ready=True, running_since="T1")
    ours = status_patch({}, ready, "Running", "T2")["status"]
    assert not status_drifted(ours, ready, "Running")
    # the node lifecycle controller's MarkPodsNotReady after the node's lease lapsed
    marked = {**ours, "conditions": [{**c, "status": "False"} if c["type"] == "Ready" else c
                                     for c in ours["conditions"]]}
    assert status_drifted(marked, ready, "Running")
    assert status_drifted(ours, ready, "Pending")


def test_restart_back_off_is_a_kubelets() -> None:
    assert [restart_delay(n) for n in range(1, 9)] == [0, 10, 20, 40, 80, 160, 300, 300]


def test_probes_ready_on_first_health_unready_after_the_failure_window_restart_on_liveness() -> None:
    pod = parse_pod(operator_pod())
    t = ProbeTracker(pod.startup, pod.readiness, pod.liveness, began=100.0)
    assert t.next_due() == 100.0
    v = t.observe(False, 100.0)
    assert (v.started, v.ready) == (False, False) and t.next_due() == 101.0  # asked every second until it answers
    v = t.observe(True, 130.0)
    assert (v.started, v.ready) == (True, True)
    # readiness: every 5 s, 3 failures in a row; liveness: every 15 s, 6 failures in a row
    now, verdicts = 130.0, []
    while now < 240:
        now = t.next_due()
        verdicts.append((now, t.observe(False, now)))
    unready = next(n for n, v in verdicts if not v.ready)
    assert unready == 145.0
    restart = next(n for n, v in verdicts if v.restart)
    assert restart == 220.0


def test_an_engine_that_never_answers_is_restarted_after_the_startup_window() -> None:
    pod = parse_pod(operator_pod())
    assert pod.startup is not None
    window = pod.startup.failure_threshold * pod.startup.period_s
    t = ProbeTracker(pod.startup, pod.readiness, pod.liveness, began=0.0)
    assert t.observe(False, window - 1).restart is None
    assert t.observe(False, window).restart


def test_model_choice_pod_then_namespace_then_default() -> None:
    assert models.choose("tiny", "/x", "embedded") == "tiny"
    assert models.choose(None, "tiny-qwen2", "embedded") == "tiny-qwen2"
    assert models.choose(" ", None, "embedded") == "embedded"
    for bad in ("huge", "tiny-gpt2", "relative/path"):
        with pytest.raises(models.ModelError, match="expected embedded, tiny"):
            models.check_choice(bad)


def test_kwok_leaves_engine_pods_to_the_engine_kubelet() -> None:
    ready = {"kind": "Stage", "metadata": {"name": "pod-ready"},
             "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Pod"},
                      "selector": {"matchExpressions": [{"key": ".status.podIP", "operator": "DoesNotExist"}]}}}
    node = {"kind": "Stage", "metadata": {"name": "node-initialize"},
            "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Node"}, "selector": {}}}
    stages = manifests.kwok_stages([ready, node])
    by_name = {s["metadata"]["name"]: s for s in stages}
    assert by_name["node-initialize"] == node
    not_engine = by_name["pod-ready"]["spec"]["selector"]["matchExpressions"][-1]
    assert not_engine == {"key": '.metadata.labels["app.kubernetes.io/name"]', "operator": "NotIn",
                          "values": ["kvfleet-engine"]}
    assert ready["spec"]["selector"]["matchExpressions"][-1]["key"] == ".status.podIP"  # input untouched
    engine = by_name["kvfleet-engine-pod-address"]
    assert {"key": '.metadata.labels["app.kubernetes.io/name"]', "operator": "In",
            "values": ["kvfleet-engine"]} in engine["spec"]["selector"]["matchExpressions"]
    template = engine["spec"]["next"]["statusTemplate"]
    assert "phase: Pending" in template and "PodIPsWith" in template and "\\" not in template


def test_a_secret_volume_version_is_swapped_in_by_one_rename(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    secret_volumes.write_version(folder, {"keys.yaml": b"sk-1: a\n", "extra": b"x", "sub/inner": b"y"})
    assert (folder / "keys.yaml").read_bytes() == b"sk-1: a\n" and (folder / "sub" / "inner").read_bytes() == b"y"
    assert (folder / "keys.yaml").is_symlink() and (folder / "..data").is_symlink()
    first = (folder / "..data").resolve()
    with (folder / "keys.yaml").open("rb") as held:   # a reader in the middle keeps its version
        secret_volumes.write_version(folder, {"keys.yaml": b"sk-2: a\n"})
        assert held.read() == b"sk-1: a\n"
    assert (folder / "keys.yaml").read_bytes() == b"sk-2: a\n"
    assert not first.exists() and not (folder / "extra").exists() and not (folder / "sub").exists()
    versions = {p.name for p in folder.iterdir() if p.name.startswith("..")}
    assert versions == {"..data", (folder / "..data").resolve().name}   # the old version's folder is gone
    one = secret_volumes.digest({"a": b"1", "b": b"2"})
    assert one == secret_volumes.digest({"b": b"2", "a": b"1"}) != secret_volumes.digest({"a": b"1", "b": b"3"})
