"""kvfleet's images, run by a real container runtime (podman with runc): `make image-test` runs both; `make test`
the control-plane image, and the engine image when it is built for this source (`make images`).

Each image runs the container spec Kubernetes would run (imagekit.podrun): the chart's operator container and the
operator's own engine container, with their users, read-only root file systems, dropped capabilities, no privilege
escalation and emptyDirs, on the host's loopback network (`--network host`; every server binds 127.0.0.1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
import yaml

from kvfleet.operator.builders import build_pod_template
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.kube import Kube
from kvfleet.operator.spec import parse_model_deployment
from kvfleet.operator.testing import REPO, free_port, wait_for

from chart_fixtures import helm, render
from operator_fixtures import API, KUEUE

sys.path.insert(0, str(REPO / "images"))

from imagekit.builder import ensure_loaded, plan  # noqa: E402
from imagekit.podrun import Supplied, command_and_args, empty_dirs, podman_run_flags  # noqa: E402
from imagekit.specs import IMAGES, project_version  # noqa: E402
from imagekit.tools import Store, missing_tools, ulimit_flags  # noqa: E402

REQUIRED = os.environ.get("KVFLEET_IMAGES_REQUIRED") == "1"  # make image-test: a missing image fails
STORE = Store.default()
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def built_image(name: str) -> str:
    """The image built for this source, in the local storage (loaded from its archive when needed)."""
    missing = missing_tools()
    archive = None if missing else plan(IMAGES[name], STORE)
    if archive is None or not archive.cached:
        why = f"missing {', '.join(missing)} (make image-deps)" if missing else "not built for this source"
        message = f"the {name} image: {why}: make images"
        pytest.fail(message) if REQUIRED else pytest.skip(message)
    return ensure_loaded(archive, STORE)


@pytest.fixture(scope="module")
def control_plane_image() -> str:
    return built_image("control-plane")


@pytest.fixture(scope="module")
def engine_image() -> str:
    return built_image("engine")


def podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = STORE.run(STORE.podman(*args), check=False, capture=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])}...: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def run_once(image: str, *args: str, flags: tuple[str, ...] = (), entrypoint: str | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    ep = ["--entrypoint", entrypoint] if entrypoint else []
    return podman("run", "--rm", "--network", "host", *ulimit_flags(), *flags, *ep, image, *args, check=check)


class Container:
    """A detached `podman run`, removed at the end; its log is kept under .cluster/logs or the test's tmp dir."""

    def __init__(self, image: str, flags: list[str], entrypoint: list[str], args: list[str], log: Path) -> None:
        self.name = f"kvfleet-test-{uuid.uuid4().hex[:8]}"
        self.log = log
        podman("run", "--detach", "--name", self.name, "--network", "host", *ulimit_flags(), *flags, *entrypoint,
               image, *args)

    def running(self) -> bool:
        out = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return out.stdout.strip() == "true"

    def logs(self) -> str:
        out = podman("logs", self.name, check=False)
        return out.stdout + out.stderr

    def stop(self, timeout: int = 60) -> int:
        """SIGTERM, as the kubelet sends; the exit code."""
        podman("stop", "--time", str(timeout), self.name, check=False, timeout=timeout + 30)
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout.strip())

    def remove(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text(self.logs())
        podman("rm", "--force", self.name, check=False)


def empty_dir_root(pod: dict[str, Any], where: Path) -> str:
    """Host directories for the pod's emptyDirs, as a kubelet makes them: empty, mode 0777."""
    for name in empty_dirs(pod):
        (where / name).mkdir(parents=True, exist_ok=True)
        (where / name).chmod(0o777)
    return str(where)


def wait_http(url: str, container: Container, what: str, timeout: float) -> httpx.Response:
    def answer() -> httpx.Response | None:
        if not container.running():
            raise AssertionError(f"{what}: the container exited\n{container.logs()[-4000:]}")
        try:
            resp = httpx.get(url, timeout=5)
        except httpx.HTTPError:
            return None
        return resp if resp.status_code == 200 else None
    return wait_for(what, answer, timeout=timeout, interval=1)


def assert_clean_log(text: str) -> None:
    for bad in ("Traceback", "Read-only file system", "Permission denied", "forbidden"):
        assert bad not in text, f"{bad!r} in the container's log:\n{text[-4000:]}"


def image_config(image: str) -> dict[str, Any]:
    return json.loads(podman("image", "inspect", image).stdout)[0]


def assert_metadata(image: str, title: str) -> None:
    config = image_config(image)
    labels = config["Labels"]
    assert config["Config"]["User"] == "1000:1000"
    assert labels["org.opencontainers.image.title"] == title
    assert labels["org.opencontainers.image.version"] == project_version()
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert len(labels["org.opencontainers.image.revision"]) == 40  # the commit it was built from
    assert labels["org.opencontainers.image.source"].startswith("https://")


# --- the control plane ---

def test_control_plane_image_is_small_torch_free_and_answers_operator_help(control_plane_image: str) -> None:
    assert_metadata(control_plane_image, "kvfleet-control-plane")
    help_ = run_once(control_plane_image, "operator", "--help",
                     flags=("--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL"))
    assert "usage: kvfleet operator" in help_.stdout and "--peering" in help_.stdout
    # no Kubernetes client library either: the operator's and the gateway's credentials are their own
    probe = ("import importlib.util as u, shutil, json; print(json.dumps({'modules': [m for m in ('torch', 'pip', "
             "'setuptools', 'hatchling', 'kubernetes', 'kopf') if u.find_spec(m)], 'tools': [t for t in ('gcc', "
             "'cc', 'pip', 'pip3', 'make') if shutil.which(t)]}))")
    found = json.loads(run_once(control_plane_image, "-c", probe, entrypoint="python3").stdout)
    assert found == {"modules": ["kopf"], "tools": []}
    has_gateway = run_once(control_plane_image, "-c", "import importlib.util as u; print(bool(u.find_spec("
                           "'kvfleet.gateway')))", entrypoint="python3").stdout.strip() == "True"
    if has_gateway:  # the gateway lands in this image (kvfleet[operator,gateway])
        assert "usage: kvfleet gateway" in run_once(control_plane_image, "gateway", "--help").stdout
    refused = run_once(control_plane_image, "serve", check=False)
    assert refused.returncode == 2 and "kvfleet[engine]" in refused.stderr


def test_control_plane_image_runs_the_charts_operator_with_its_service_account(
        control_plane_image: str, cluster: Any, kube: Kube, crds: None, kubectl: Callable[..., Any],
        tmp_path: Path) -> None:
    """Install the chart, then run the chart's own operator container in the image as its pod would run: in-cluster
    configuration from the ServiceAccount's token, read-only root, /tmp on an emptyDir. It must answer its health
    endpoint and reconcile a Tenant under the chart's ClusterRole."""
    sfx = uuid.uuid4().hex[:5]
    release, ns, tenant = f"kvfleet-img-{sfx}", f"kvfleet-img-{sfx}", f"img-{sfx}"
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"operator": {"peeringName": f"kvfleet-img-{sfx}"}, "resourceFlavors": []}))
    container = None
    try:
        helm(cluster, "install", release, str(REPO / "charts" / "kvfleet"), "--namespace", ns, "--create-namespace",
             "-f", str(values), "--wait", "--timeout", "90s")
        dep = next(d for d in render(cluster, release, ns, values) if d["kind"] == "Deployment")
        pod = dep["spec"]["template"]["spec"]
        spec = next(c for c in pod["containers"] if c["name"] == "operator")
        health, metrics = free_port(), free_port()
        # The chart's own arguments, but loopback and free ports (the tests share this host's network).
        loopback = {"--liveness": f"--liveness=http://127.0.0.1:{health}/healthz",
                    "--metrics-addr": "--metrics-addr=127.0.0.1", "--metrics-port": f"--metrics-port={metrics}"}
        args = [loopback.get(a.split("=")[0], a) for a in spec["args"]]
        sa = tmp_path / "serviceaccount"
        sa.mkdir(mode=0o755)
        (sa / "token").write_text(kubectl("create", "token", pod["serviceAccountName"], "--namespace", ns,
                                          "--duration=1h").stdout.strip())
        (sa / "ca.crt").write_text((Path(cluster.pki) / "ca.crt").read_text())
        (sa / "namespace").write_text(ns)
        for f in sa.iterdir():
            f.chmod(0o644)
        server = yaml.safe_load(Path(cluster.kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
        port = server.rsplit(":", 1)[1]
        flags = podman_run_flags(pod, spec, Supplied(
            field_values={"metadata.name": f"operator-{sfx}"},
            extra_env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port,
                       "KVFLEET_LOOPBACK_ONLY": "1"},
            empty_dir_root=empty_dir_root(pod, tmp_path / "volumes")))
        entrypoint, _ = command_and_args(spec)
        container = Container(control_plane_image, [*flags, "--volume", f"{sa}:{SA_DIR}:ro"], entrypoint, args,
                              Path(cluster.logs) / f"image-operator-{sfx}.log")
        ok = wait_http(f"http://127.0.0.1:{health}{spec['livenessProbe']['httpGet']['path']}", container,
                       "the operator's health endpoint", timeout=120)
        assert ok.status_code == 200
        assert "kvfleet_" in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        kube.apply({"apiVersion": API, "kind": "Tenant", "metadata": {"name": tenant},
                    "spec": {"namespaces": [tenant], "quotas": [{"flavor": f"h200-{sfx}", "nominal": 2}]}})
        wait_for("ClusterQueue from the containerised operator", lambda: kube.get(KUEUE, "clusterqueues", tenant),
                 timeout=90)
        labels = wait_for("tenant namespace", lambda: (kube.get("v1", "namespaces", tenant) or {}).get("metadata"),
                          timeout=60)["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
        kube.delete(API, "tenants", tenant)
        wait_for("Tenant gone", lambda: kube.get(API, "tenants", tenant) is None, timeout=60)
        assert container.stop() == 0
        assert_clean_log(container.logs())
    finally:
        if container is not None:
            container.remove()
        kube.delete(API, "tenants", tenant)
        helm(cluster, "uninstall", release, "--namespace", ns, "--wait", "--timeout", "60s", check=False)
        kube.delete("v1", "namespaces", ns)
        kube.delete("v1", "namespaces", tenant)


# --- the engine ---

TRITON_PROBE = r'''
from triton.runtime.build import compile_module_from_src
src = """#include <Python.h>
static PyObject* answer(PyObject* self, PyObject* args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvfleet_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kvfleet_probe(void) { return PyModule_Create(&module); }
"""
print(compile_module_from_src(src, "kvfleet_probe").answer())
'''


def engine_pod(served_name: str = "smollm2") -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, engine container) exactly as the operator builds them for a ModelDeployment."""
    spec = parse_model_deployment({"model": {"source": "org/m", "servedName": served_name}})
    pod = build_pod_template("chat", spec, OperatorConfig())["spec"]
    return pod, pod["containers"][0]


def test_engine_image_has_cuda_torch_and_compiles_triton_launchers_read_only(engine_image: str,
                                                                            tmp_path: Path) -> None:
    """torch is the pinned CUDA build; Triton's launcher compile (what a GPU needs at first use) works as the pod
    runs: read-only root, caches on emptyDirs."""
    assert_metadata(engine_image, "kvfleet-engine")
    pinned = next(line.split("==")[1].split()[0] for line in (REPO / "images/requirements/engine.txt").read_text()
                  .splitlines() if line.startswith("torch=="))
    probe = ("import importlib.util as u, json, shutil, torch; print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'pip': bool(u.find_spec('pip')), 'gcc': bool(shutil.which('gcc'))}))")
    found = json.loads(run_once(engine_image, "-c", probe, entrypoint="python3").stdout)
    assert found["torch"].split("+")[0] == pinned and found["cuda"] and not found["pip"] and found["gcc"]
    pod, container = engine_pod()
    flags = podman_run_flags(pod, container, Supplied(field_values={"metadata.name": "chat-0",
                                                                    "metadata.namespace": "team-a"},
                                                      empty_dir_root=empty_dir_root(pod, tmp_path)))
    out = run_once(engine_image, "-c", TRITON_PROBE, flags=tuple(flags), entrypoint="python3")
    assert out.stdout.strip() == "42", out.stderr


def test_engine_image_serves_the_operators_engine_container_on_cpu(engine_image: str, tmp_path: Path) -> None:
    """The operator's engine container, in the image, with the embedded model on CPU: a chat completion through
    the openai client, /metrics, then a clean exit on SIGTERM."""
    from openai import OpenAI

    pod, spec = engine_pod()
    entrypoint, args = command_and_args(spec)
    model = run_once(engine_image, "-c", "from kvfleet.engine.tokenizer import find_default_model as f; print(f())",
                     entrypoint="python3").stdout.strip()
    port = free_port()
    # The pod's own flags, but the embedded model, loopback, a free port and the CPU.
    args = [model, *args[1:]]
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    args += ["--device", "cpu"]
    flags = podman_run_flags(pod, spec, Supplied(field_values={"metadata.name": "chat-0",
                                                               "metadata.namespace": "team-a"},
                                                 empty_dir_root=empty_dir_root(pod, tmp_path / "volumes")))
    container = Container(engine_image, flags, entrypoint, args, tmp_path / "engine.log")
    try:
        health_path = spec["readinessProbe"]["httpGet"]["path"]
        wait_http(f"http://127.0.0.1:{port}{health_path}", container, "the engine's readiness", timeout=600)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        answer = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=16)
        assert "Paris" in (answer.choices[0].message.content or ""), answer
        assert "kvfleet" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        started = time.monotonic()
        assert container.stop(timeout=60) == 0
        assert time.monotonic() - started < 60
        assert_clean_log(container.logs())
    finally:
        container.remove()
