"""The command lines of the control plane's processes, in start order (pure: paths and ports in, argv out)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .layout import CLUSTER_DIR, Layout
from .procs import Component, Probe

# Start order; stopping goes the other way.
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kueue", "engine-kubelet")
# The local model engine pods get unless they or their namespace choose (see enginekubelet/models.py).
DEFAULT_ENGINE_MODEL = "embedded"
ENGINE_MODEL_ENV = "KVFLEET_CLUSTER_ENGINE_MODEL"


def model_cache() -> Path:
    """Where tiny models are built: outside the checkout, shared by checkouts (as the Go build cache is)."""
    return Path(os.environ.get("KVFLEET_CACHE") or Path.home() / ".cache" / "kvfleet") / "models"


def _admin_probe(layout: Layout, url: str) -> Probe:
    pki = layout.pki
    return Probe(url, ca=None, cert=pki / "admin.crt", key=pki / "admin.key")


def etcd(layout: Layout) -> Component:
    client = f"http://127.0.0.1:{layout.port('etcd_client')}"
    peer = f"http://127.0.0.1:{layout.port('etcd_peer')}"
    argv = (
        str(layout.binary("etcd")),
        "--name=kvfleet",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kvfleet={peer}",
        "--unsafe-no-fsync",  # a throw-away test cluster: speed over durability
        "--quota-backend-bytes=2147483648",
        "--log-level=warn",
    )
    return Component("etcd", argv, Probe(f"{client}/health"))


def apiserver(layout: Layout) -> Component:
    pki = layout.pki
    port = layout.port("apiserver")
    argv = (
        str(layout.binary("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{layout.port('etcd_client')}",
        "--bind-address=127.0.0.1",
        # Without it the apiserver looks for an interface with a default route, which a loopback-only host lacks.
        "--advertise-address=127.0.0.1",
        f"--secure-port={port}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer=https://127.0.0.1:{port}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        # Cluster IPs are only ever stored, never routed or contacted.
        "--service-cluster-ip-range=10.96.0.0/16",
        # A loopback advertise address fails Endpoints validation, so the `kubernetes` Service gets no endpoints.
        "--endpoint-reconciler-type=none",
        f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
        "--allow-privileged=true",
        "--profiling=false",
        f"--cert-dir={pki}",
    )
    return Component("kube-apiserver", argv, _admin_probe(layout, f"https://127.0.0.1:{port}/readyz"))


def _secure_client_flags(kubeconfig: str, port: int, cert_dir: Path) -> tuple[str, ...]:
    """What the controller manager and the scheduler share: one kubeconfig for everything, no leader
    election, a serving port on loopback."""
    return (f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={port}", f"--cert-dir={cert_dir}", "--profiling=false")


def controller_manager(layout: Layout) -> Component:
    pki, kubeconfig = layout.pki, str(layout.run / "controller-manager.kubeconfig")
    port = layout.port("controller_manager")
    argv = (
        str(layout.binary("kube-controller-manager")),
        *_secure_client_flags(kubeconfig, port, layout.run / "controller-manager-certs"),
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        "--use-service-account-credentials=true",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        # Pod IPs are loopback addresses here, which Endpoints and EndpointSlices may never hold: these controllers
        # could only fail, retry and post a Warning Event for every Service, forever (a third of the apiserver's
        # requests with 200 ModelDeployments, bench/operator_scale.py). Nothing here reads Endpoints.
        "--controllers=*,-endpoints-controller,-endpointslice-controller,-endpointslice-mirroring-controller",
    )
    return Component("kube-controller-manager", argv, _admin_probe(layout, f"https://127.0.0.1:{port}/healthz"))


def scheduler(layout: Layout) -> Component:
    kubeconfig = str(layout.run / "scheduler.kubeconfig")
    port = layout.port("scheduler")
    argv = (
        str(layout.binary("kube-scheduler")),
        *_secure_client_flags(kubeconfig, port, layout.run / "scheduler-certs"),
    )
    return Component("kube-scheduler", argv, _admin_probe(layout, f"https://127.0.0.1:{port}/healthz"))


def kwok(layout: Layout) -> Component:
    port = layout.port("kwok")
    argv = (
        str(layout.binary("kwok")),
        f"--kubeconfig={layout.kubeconfig}",
        f"--config={layout.run / 'kwok-stages.yaml'}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        # Pod IPs and node IPs inside 127.0.0.0/8: a test can bind a real process on a pod's IP.
        f"--cidr={layout.pod_cidr}",
        f"--node-ip={layout.kwok_node_ip}",
        "--node-lease-duration-seconds=40",
        f"--server-address=127.0.0.1:{port}",
    )
    return Component("kwok", argv, Probe(f"http://127.0.0.1:{port}/healthz"))


def kueue(layout: Layout) -> Component:
    argv = (
        str(layout.binary("kueue")),
        f"--kubeconfig={layout.kubeconfig}",
        f"--config={layout.run / 'kueue-config.yaml'}",
    )
    return Component("kueue", argv, Probe(f"http://127.0.0.1:{layout.port('kueue_health')}/readyz"))


def engine_kubelet(layout: Layout, model: str = DEFAULT_ENGINE_MODEL) -> Component:
    """Runs a real `kvfleet serve` for every kvfleet engine pod on the fake nodes (localcluster/enginekubelet),
    with this checkout's Python (the virtualenv that runs cluster.py)."""
    port = layout.port("engine_kubelet")
    pki = layout.pki
    argv = (
        sys.executable, "-m", "localcluster.enginekubelet",
        f"--apiserver={layout.apiserver_url}",
        f"--ca={pki / 'ca.crt'}", f"--cert={pki / 'engine-kubelet.crt'}", f"--key={pki / 'engine-kubelet.key'}",
        f"--port={port}",
        f"--records={layout.engine_records}",
        f"--logs={layout.engine_logs}",
        f"--volumes={layout.run / 'engine-volumes'}",
        f"--model={model}",
        f"--model-cache={model_cache()}",
    )  # fmt: skip
    return Component("engine-kubelet", argv, Probe(f"http://127.0.0.1:{port}/healthz"),
                     env=(("PYTHONPATH", str(CLUSTER_DIR)),))


def all_components(layout: Layout, engine_model: str = DEFAULT_ENGINE_MODEL) -> dict[str, Component]:
    """Every component by name, in start order."""
    makers = (etcd, apiserver, controller_manager, scheduler, kwok, kueue)
    components = {c.name: c for c in (make(layout) for make in makers)}
    components["engine-kubelet"] = engine_kubelet(layout, engine_model)
    assert tuple(components) == ORDER
    return components
