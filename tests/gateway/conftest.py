"""Fixtures of the gateway tests: fast upstream processes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator

import httpx
import pytest

from kvfleet.gateway.testing import free_port, wait_until


@contextlib.contextmanager
def upstream(*extra: str) -> Iterator[str]:
    """`python -m kvfleet.gateway.testing upstream` (3 events per stream) as a process; its base URL."""
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
    with upstream() as url:
        yield url


@pytest.fixture
def locked_upstream() -> Iterator[str]:
    """The same, wanting its own API key (as an engine of a ModelDeployment with apiKeySecretRef)."""
    with upstream("--api-key", "engine-own-key-0123456789") as url:
        yield url


@pytest.fixture(scope="module")
def fast_upstream_pair() -> Iterator[tuple[str, str]]:
    """Two fast upstreams, shared by a module's tests (two replicas of one model)."""
    with upstream() as first, upstream() as second:
        yield first, second
