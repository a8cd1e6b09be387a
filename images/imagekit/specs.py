"""The two images: what each one is built from and what it is called."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REGISTRY = "ghcr.io/kvfleet"  # the chart's default repositories (charts/kvfleet/values.yaml) name the same


def project_version(repo: Path = REPO) -> str:
    """`version` of pyproject.toml's [project] (the images' tag and the chart's appVersion)."""
    text = (repo / "pyproject.toml").read_text()
    match = re.search(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    if not match:
        raise ValueError("pyproject.toml: no [project] version")
    return match.group(1)


@dataclass(frozen=True)
class ImageSpec:
    name: str                       # kvfleet-<name> is the repository's last component
    containerfile: str              # relative to the repository root
    requirements: tuple[str, ...]   # the pinned requirement files it installs (images/requirements/)
    keep_archives: int              # archives kept in the cache, this build's included (the engine's are GBs)

    @property
    def repository(self) -> str:
        return f"{REGISTRY}/kvfleet-{self.name}"

    def reference(self, version: str) -> str:
        return f"{self.repository}:{version}"


# The build context of both: project metadata and the Python source roots (.dockerignore says the same).
CONTEXT_ROOTS = ("pyproject.toml", "README.md", "engine", "operator", "gateway", "images/requirements",
                 ".dockerignore")

IMAGES: dict[str, ImageSpec] = {
    "control-plane": ImageSpec("control-plane", "images/control-plane.Containerfile",
                               ("build.txt", "control-plane.txt"), keep_archives=2),
    "engine": ImageSpec("engine", "images/engine.Containerfile",
                        ("build.txt", "engine.txt", "engine-model.txt"), keep_archives=1),
}
