"""A real Kubernetes control plane on loopback, with Kueue and fake GPU nodes, for kvfleet's e2e tests and demo.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok and the Kueue controller run as local processes
built from their Go modules (see ../build.sh and ../versions.env). `python e2e/cluster/cluster.py up|down|status`.
"""

from .control import down, is_up, kubectl, up
from .layout import Layout

__all__ = ["Layout", "down", "is_up", "kubectl", "up"]
