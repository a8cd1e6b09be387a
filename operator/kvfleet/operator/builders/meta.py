"""Metadata helpers shared by the builders: labels and owner references."""
from __future__ import annotations

from typing import Any, Mapping

from ..constants import LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_MDEP, LABEL_NAME, MANAGED_BY_VALUE


def owner_reference(owner: Mapping[str, Any], controller: bool = True) -> dict[str, Any]:
    """An ownerReference to `owner` so the garbage collector removes what we made with it."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def mdep_labels(mdep_name: str, component: str) -> dict[str, str]:
    """Labels of everything a ModelDeployment owns; `LABEL_MDEP` is what watches select on."""
    return {
        LABEL_NAME: "kvfleet-engine",
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY_VALUE,
        LABEL_MDEP: mdep_name,
    }


def selector_labels(mdep_name: str) -> dict[str, str]:
    """The stable subset used in selectors (selectors of Deployments are immutable)."""
    return {LABEL_NAME: "kvfleet-engine", LABEL_MDEP: mdep_name}


def owned_metadata(mdep: Mapping[str, Any], name: str, component: str,
                   extra_labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Metadata of an object a ModelDeployment owns in its namespace: its labels and the owner reference."""
    return {
        "name": name,
        "namespace": mdep["metadata"]["namespace"],
        "labels": {**mdep_labels(mdep["metadata"]["name"], component), **(extra_labels or {})},
        "ownerReferences": [owner_reference(mdep)],
    }
