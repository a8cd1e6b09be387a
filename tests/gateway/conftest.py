"""Fixtures of the gateway tests: a fast upstream process."""

from __future__ import annotations

import subprocess
import sys
from typing import Iterator

import httpx
import pytest

from kvfleet.gateway.testing import free_port, wait_until


def _upstream(*extra: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet.gateway.testing", "upstream", "--port", str(port),  # noqa: S603
                             "--tokens", "3", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/metrics", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until("fast upstream", up, timeout=30)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def fast_upstream() -> Iterator[str]:
    """A fast OpenAI-shaped server (kvfleet.gateway.testing), as a process; its base URL."""
    yield from _upstream()


@pytest.fixture
def locked_upstream() -> Iterator[str]:
    """The same, wanting its own API key (as an engine of a ModelDeployment with apiKeySecretRef)."""
    yield from _upstream("--api-key", "engine-own-key-0123456789")
