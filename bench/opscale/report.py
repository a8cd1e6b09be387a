"""A table of bench/operator_scale.py runs: python bench/opscale/report.py [RESULT.json ...] (default: all)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results" / "operator-scale"
COMPONENTS = ("kube-apiserver", "etcd", "operator", "kube-controller-manager", "kueue")


def row(r: dict[str, Any]) -> str:
    cpu = r["cpu_s"]
    ours = sum(cpu.get(c, 0) for c in (*COMPONENTS, "kube-scheduler", "kwok"))
    api = sum(x["value"] for x in r["requests"].get("kube-apiserver", []) if x["metric"] == "apiserver_request_total")
    op = sum(x["value"] for x in r["requests"].get("operator", [])
             if x["metric"] == "kvfleet_operator_api_requests_total")
    others = cpu.get("others", 0) / max(cpu.get("machine_capacity", 1), 1)
    stages = r["stages"]
    return (f"| {r['label']} | {r['started_utc'][11:16]} | {r['total_s']:.0f} | {stages['mdep_created']['max']:.0f} | "
            f"{r['machine']['loadavg_start'][0]:.1f} | {others:.0%} | {ours:.0f} | "
            + " | ".join(f"{cpu.get(c, 0):.0f}" for c in COMPONENTS)
            + f" | {r['operator_peak_rss_mib']:.0f} | {api:.0f} | {op:.0f} |")


def main(paths: list[str]) -> None:
    files = [Path(p) for p in paths] or sorted(RESULTS.glob("*.json"))
    runs = sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["started_utc"])
    print("| run | UTC | all Ready s | applied by s | load | others' CPU | our CPU s | "
          + " | ".join(f"{c} CPU s" for c in COMPONENTS) + " | operator peak RSS MiB | apiserver requests | "
          "operator requests |")
    print("|" + "---|" * (13 + len(COMPONENTS) - 5 + 2))
    for r in runs:
        print(row(r))


if __name__ == "__main__":
    main(sys.argv[1:])
