"""The chart's values are documented line by line (`# --` before every value, helm-docs style)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfleet"
KEY = re.compile(r"^(\s*)([A-Za-z][\w.-]*):(.*)$")


def documented_keys() -> tuple[list[str], list[str]]:
    """(documented, undocumented) dotted keys; a key is covered when it or a parent has `# --`."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented, undocumented = [], []
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    prev = ""
    for line in lines:
        if line.lstrip().startswith("#") or not line.strip():
            if line.strip():
                prev = line.strip()
            continue
        m = KEY.match(line)
        if not m:
            prev = ""
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        here = prev.startswith("# --")
        covered = here or any(doc for _, _, doc in stack)
        path = ".".join([k for _, k, _ in stack] + [key])
        if m.group(3).strip():  # a leaf (or an inline list/map)
            (documented if covered else undocumented).append(path)
        stack.append((indent, key, here))
        prev = ""
    return documented, undocumented


def test_every_value_is_documented() -> None:
    documented, undocumented = documented_keys()
    assert len(documented) > 20
    assert undocumented == []


def test_values_parse_and_chart_metadata() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["autoscaler"]["metricsSource"] in ("scrape", "prometheus")
    assert {f["name"] for f in values["resourceFlavors"]} == {"h200", "l40s"}
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvfleet"
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for name in ("kvfleet.name", "kvfleet.fullname", "kvfleet.labels", "kvfleet.selectorLabels",
                 "kvfleet.serviceAccountName"):
        assert f'define "{name}"' in helpers
