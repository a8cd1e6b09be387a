"""The benchmark's cluster: kvfleet's engine pods made Ready by kwok, as every other pod, with no engine behind them.

The local cluster runs a real `kvfleet serve` for every engine pod (its engine kubelet, e2e/README.md); 200 of them
would need ~140 GB of memory and minutes of CPU each on this machine, and would measure engine start-up, not the
operator and the control plane at scale. So the benchmark's own cluster has kwok's stock pod stages (Ready as soon
as the pod is scheduled) and no engine kubelet. `make cluster-up` afterwards sees the engine kubelet missing and
starts that cluster again from a clean slate.
"""
from __future__ import annotations

import logging

import yaml

from localcluster import control, manifests, procs
from localcluster.layout import Layout

log = logging.getLogger(__name__)


def stock_kwok_stages(layout: Layout) -> str:
    stage_dir = layout.binary("kwok-stage")
    return control.dump_all([yaml.safe_load((stage_dir / f).read_text()) for f in manifests.KWOK_STAGE_FILES])


def engines_by_kwok(layout: Layout) -> None:
    """Stop the engine kubelet and restart kwok with its stock stages (idempotent)."""
    procs.stop(layout.run, "engine-kubelet")
    stages = layout.run / "kwok-stages.yaml"
    if manifests.ENGINE_POD_STAGE not in stages.read_text():
        return
    stages.write_text(stock_kwok_stages(layout))
    control.restart(layout, "kwok")
    log.info("engine pods are made Ready by kwok (no engine kubelet) for this benchmark")


def engines_by_kwok_already(layout: Layout) -> bool:
    stages = layout.run / "kwok-stages.yaml"
    return stages.exists() and manifests.ENGINE_POD_STAGE not in stages.read_text()
