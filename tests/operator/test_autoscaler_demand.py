"""The gateway's demand annotation as the operator sees it: parsed, fresh or stale, and visible to kopf's diff."""

from __future__ import annotations

import kopf

from kvfleet.operator.autoscaler.demand import demand_value, gateway_waiting
from kvfleet.operator.constants import GATEWAY_DEMAND_ANNOTATION, GROUP


def test_kopf_diffs_the_annotation_so_its_field_handler_fires() -> None:
    """kopf leaves its own storage prefix (`serving.kvfleet.dev/`) out of the essence it diffs: the annotation
    must live elsewhere, or the autoscaler would wake a model only at its next timer tick."""
    storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    body = kopf.Body({"apiVersion": "v1", "kind": "X", "spec": {},
                      "metadata": {"annotations": {f"{GROUP}/last-handled-configuration": "{}",
                                                   f"{GROUP}/kopf-managed": "yes", f"{GROUP}/other": "x",
                                                   GATEWAY_DEMAND_ANNOTATION: demand_value(1, 5.0)}}})
    annotations = storage.build(body=body)["metadata"]["annotations"]
    assert GATEWAY_DEMAND_ANNOTATION in annotations and f"{GROUP}/other" not in annotations


def test_fresh_demand_counts_and_stale_does_not() -> None:
    annotations = {GATEWAY_DEMAND_ANNOTATION: demand_value(2, 100.0)}
    assert gateway_waiting(annotations, 120.0) == 2
    assert gateway_waiting(annotations, 131.0) == 0
