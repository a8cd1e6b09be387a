"""Fixtures: one real `kvfleet serve` process with a tiny model, shared by the API-level modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from server_proc import ALPHA, KEYS, Server, start_server


@pytest.fixture(scope="session")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text("".join(f"{k}: {t}\n" for k, t in KEYS.items()))
    return path


@pytest.fixture(scope="session")
def api_server(tiny_model_dir: Path, keys_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Shared by the API, schemathesis and bench modules: tenant keys on, context 128 (bounds every
    request, schemathesis' included)."""
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--api-keys-file", str(keys_file),
                          "--max-model-len", "128")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(api_server: Server) -> openai.OpenAI:
    """The real `openai` client on the shared server, as tenant alpha."""
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key=ALPHA, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def offline(tiny_model_dir: Path) -> Iterator[Any]:
    """The offline engine on the shared server's folder: the server must agree with it token for token."""
    from kvfleet.engine.llm import LLM

    yield LLM(str(tiny_model_dir), device="cpu", max_model_len=128)
