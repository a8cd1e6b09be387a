"""REST paths and Events (the client's pure parts)."""
from __future__ import annotations

from kvfleet.operator.events import build_event
from kvfleet.operator.kube import object_path, request_kind, resource_path

from op_factories import make_mdep


def test_paths() -> None:
    assert resource_path("v1", "namespaces", name="a") == "/api/v1/namespaces/a"
    assert resource_path("v1", "services", "ns", "svc") == "/api/v1/namespaces/ns/services/svc"
    assert resource_path("kueue.x-k8s.io/v1beta2", "clusterqueues", name="q") == \
        "/apis/kueue.x-k8s.io/v1beta2/clusterqueues/q"
    assert object_path(make_mdep(), "status") == \
        "/apis/serving.kvfleet.dev/v1alpha1/namespaces/team-a/modeldeployments/llama/status"


def test_event_refers_to_object() -> None:
    ev = build_event(make_mdep(), "Warning", "InsufficientQuota", "x" * 5000, "2026-01-01T00:00:00Z")
    assert ev["involvedObject"] == {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "ModelDeployment",
                                    "name": "llama", "namespace": "team-a", "uid": "uid-1234"}
    assert ev["metadata"]["namespace"] == "team-a" and len(ev["message"]) == 1024
    assert ev["type"] == "Warning" and ev["reason"] == "InsufficientQuota"


def test_request_kind_counts_as_the_apiserver_does() -> None:
    assert request_kind("GET", "/api/v1/namespaces") == ("list", "namespaces")
    assert request_kind("GET", "/api/v1/namespaces/a") == ("get", "namespaces")
    assert request_kind("GET", "/apis/kueue.x-k8s.io/v1beta2/namespaces/x/workloads") == ("list", "workloads")
    assert request_kind("GET", "/apis/kueue.x-k8s.io/v1beta2/clusterqueues/q") == ("get", "clusterqueues")
    assert request_kind("PATCH", object_path(make_mdep(), "status")) == ("patch", "modeldeployments/status")
    assert request_kind("POST", "/api/v1/namespaces/ns/events") == ("create", "events")
    assert request_kind("DELETE", "/apis/apps/v1/namespaces/ns/deployments/d") == ("delete", "deployments")
