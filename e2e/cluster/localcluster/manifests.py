"""The objects and configuration files of the local cluster, as plain data (pure functions, no I/O)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
FLAVOR_LABEL = "kvfleet.dev/gpu-flavor"
GPU_RESOURCE = "nvidia.com/gpu"
KUEUE_NAMESPACE = "kueue-system"
KUEUE_WEBHOOK_SERVICE = "kueue-webhook-service"
KUEUE_WEBHOOK_SECRET = "kueue-webhook-server-cert"

# The kwok stages to run, from the kwok module's kustomize/stage/ folder. pod-complete is left out on purpose:
# it would end every pod at once, and serving pods are meant to stay Running.
KWOK_STAGE_FILES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-delete.yaml",
)

# kvfleet's engine pods (the operator's label): kwok gives them an address and no more; the engine kubelet runs them.
ENGINE_LABEL = "app.kubernetes.io/name"
ENGINE_LABEL_VALUE = "kvfleet-engine"
_ENGINE_KEY = f'.metadata.labels["{ENGINE_LABEL}"]'
ENGINE_KUBELET_USER = "kvfleet:engine-kubelet"
ENGINE_POD_STAGE = "kvfleet-engine-pod-address"

# An engine pod scheduled on a fake node: kwok v0.8.0's pod-ready stage (its addresses), except that it stays Pending
# and not Ready, its container waiting in ContainerCreating, until the engine kubelet has started its engine and
# /health answers.
ENGINE_POD_STAGE_TEMPLATE = """\
{{ $now := Now }}

conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: PodReadyToStartContainers
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  type: ContainersReady
  reason: ContainersNotReady
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  type: Ready
  reason: ContainersNotReady

containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  started: false
  restartCount: 0
  state:
    waiting:
      reason: ContainerCreating
{{ end }}

{{ $hostIPs := NodeIPsWith .spec.nodeName }}
{{ with $hostIPs }}
hostIP: {{ index . 0 | Quote }}
hostIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) \
( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
{{ with $podIPs }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
phase: Pending
startTime: {{ $now | Quote }}
"""

# The CRDs whose CA bundle Kueue's internal certificate rotator injects (sigs.k8s.io/kueue pkg/util/cert); the
# rotator only reports ready once each has a conversion webhook clientConfig to inject into.
KUEUE_CONVERSION_CRDS = frozenset(
    {
        "localqueues.kueue.x-k8s.io",
        "clusterqueues.kueue.x-k8s.io",
        "workloads.kueue.x-k8s.io",
        "cohorts.kueue.x-k8s.io",
        "multikueueclusters.kueue.x-k8s.io",
    }
)


@dataclass(frozen=True)
class GpuFlavor:
    """A kind of fake GPU node: what its labels and capacity say."""

    name: str
    product: str
    gpus: int
    gpu_memory_mib: int
    cpu: str
    memory: str


FLAVORS = {
    "h200": GpuFlavor("h200", "NVIDIA-H200", 8, 143771, "96", "1536Gi"),
    "l40s": GpuFlavor("l40s", "NVIDIA-L40S", 4, 46068, "48", "384Gi"),
}
DEFAULT_NODES = "h200=2,l40s=2"


def parse_node_spec(spec: str) -> list[tuple[GpuFlavor, int]]:
    """Parses 'h200=2,l40s=2' (flavor=count, comma separated) into flavors and counts."""
    result: list[tuple[GpuFlavor, int]] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, count = item.partition("=")
        if not sep or name not in FLAVORS:
            raise ValueError(f"nodes: expected FLAVOR=COUNT with FLAVOR one of {sorted(FLAVORS)}, got {item!r}")
        if not count.isdigit() or not 0 < int(count) <= 50:
            raise ValueError(f"nodes: count for {name} must be 1-50, got {count!r}")
        result.append((FLAVORS[name], int(count)))
    if not result:
        raise ValueError("nodes: at least one FLAVOR=COUNT is needed")
    return result


def gpu_node(flavor: GpuFlavor, ordinal: int, internal_ip: str) -> dict[str, Any]:
    """A Node managed by kwok, with GPU capacity and the labels GPU feature discovery would set."""
    name = f"gpu-{flavor.name}-{ordinal}"
    resources = {
        "cpu": flavor.cpu,
        "memory": flavor.memory,
        "ephemeral-storage": "2Ti",
        "pods": "110",
        GPU_RESOURCE: str(flavor.gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                FLAVOR_LABEL: flavor.name,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": flavor.product,
                "nvidia.com/gpu.count": str(flavor.gpus),
                "nvidia.com/gpu.memory": str(flavor.gpu_memory_mib),
            },
        },
        "spec": {},
        # Kept on create (as a kubelet registers); kwok's node-initialize stage keeps capacity and addresses.
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": internal_ip}, {"type": "Hostname", "address": name}],
        },
    }


def gpu_nodes(spec: str, node_ip: Any) -> list[dict[str, Any]]:
    """Every node of a node spec; `node_ip(n)` gives the n-th node's address."""
    nodes: list[dict[str, Any]] = []
    for flavor, count in parse_node_spec(spec):
        for ordinal in range(count):
            nodes.append(gpu_node(flavor, ordinal, node_ip(len(nodes))))
    return nodes


def kwok_stages(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kwok's stages with kvfleet's engine pods left to the engine kubelet: kwok's pod stages skip them, and one
    more stage gives them their address (Pending, not Ready)."""
    not_engine = {"key": _ENGINE_KEY, "operator": "NotIn", "values": [ENGINE_LABEL_VALUE]}
    out = []
    for stage in stages:
        if stage.get("spec", {}).get("resourceRef", {}).get("kind") == "Pod":
            stage = {**stage, "spec": {**stage["spec"], "selector": dict(stage["spec"].get("selector") or {})}}
            selector = stage["spec"]["selector"]
            selector["matchExpressions"] = [*(selector.get("matchExpressions") or []), not_engine]
        out.append(stage)
    out.append({
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": ENGINE_POD_STAGE},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": [
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".status.podIP", "operator": "DoesNotExist"},
                {"key": _ENGINE_KEY, "operator": "In", "values": [ENGINE_LABEL_VALUE]},
            ]},
            "next": {"statusTemplate": ENGINE_POD_STAGE_TEMPLATE},
        },
    })  # fmt: skip
    return out


def engine_kubelet_rbac() -> list[dict[str, Any]]:
    """What the engine kubelet may do: read and watch pods, write their status, delete the pods whose engine it
    stopped, read Secrets (for Secret volumes and env), namespaces and nodes, and record Events."""
    name = "kvfleet:engine-kubelet"
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch", "update"]},
        {"apiGroups": [""], "resources": ["secrets", "namespaces", "nodes"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ]
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": ENGINE_KUBELET_USER}]},
    ]  # fmt: skip


def kubeconfig(server: str, ca_pem: bytes, user: str, cert_pem: bytes, key_pem: bytes) -> dict[str, Any]:
    """A kubeconfig with one cluster, one user and one context, certificates embedded."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kvfleet", "cluster": {"server": server, "certificate-authority-data": b64(ca_pem)}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(cert_pem), "client-key-data": b64(key_pem)}}],
        "contexts": [{"name": "kvfleet", "context": {"cluster": "kvfleet", "user": user}}],
        "current-context": "kvfleet",
    }


def kueue_configuration(health_port: int, metrics_port: int, webhook_port: int, cert_dir: str) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for a controller running outside the cluster."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": cert_dir},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": KUEUE_WEBHOOK_SERVICE,
            "webhookSecretName": KUEUE_WEBHOOK_SECRET,
        },
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"]},
        # The visibility API server needs an APIService routed to it; nothing here uses it.
        "featureGates": {"VisibilityOnDemand": False},
    }


def with_conversion_webhook(crd: dict[str, Any], url: str) -> dict[str, Any]:
    """Kueue's CRD with a conversion webhook at `url` (Kueue's webhook server on loopback), as its kustomize patch
    adds for the same CRDs (there with a Service reference).

    The apiserver keeps a watch cache per served version and converts every object for it, so v1beta1 and v1beta2
    both need a working webhook; and Kueue's certificate rotator only reports ready once it has injected its CA
    into each of these CRDs.
    """
    if crd.get("metadata", {}).get("name") not in KUEUE_CONVERSION_CRDS:
        return crd
    patched = {**crd, "spec": dict(crd["spec"])}
    patched["spec"]["conversion"] = {
        "strategy": "Webhook",
        "webhook": {"clientConfig": {"url": url}, "conversionReviewVersions": ["v1"]},
    }
    return patched


def kueue_bootstrap_objects(ca_crt: bytes, ca_key: bytes, tls_crt: bytes, tls_key: bytes) -> list[dict[str, Any]]:
    """Kueue's namespace and its webhook Secret, seeded with our certificates (see pki.ensure_kueue_webhook_pki)."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": KUEUE_WEBHOOK_SECRET, "namespace": KUEUE_NAMESPACE},
            "type": "Opaque",
            "data": {"ca.crt": b64(ca_crt), "ca.key": b64(ca_key), "tls.crt": b64(tls_crt), "tls.key": b64(tls_key)},
        },
    ]


KUEUE_WEBHOOK_DNS = f"{KUEUE_WEBHOOK_SERVICE}.{KUEUE_NAMESPACE}.svc"
