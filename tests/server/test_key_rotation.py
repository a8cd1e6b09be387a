"""A real `kvfleet serve` whose `--api-keys-file` is a mounted Secret rotated in place, as the kubelet does it
(`keys.yaml -> ..data/keys.yaml`, `..data` swapped atomically to a new timestamped folder): the new key works and
the old one is refused without a restart; a broken update keeps the last good keys."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from server_proc import Server, start_server

OLD, NEW = "sk-rotation-old-0001", "sk-rotation-new-0002"
BOUND_S = 30.0   # the server looks at the file once a second; slack for a busy machine


def write_secret(volume: Path, version: str, text: str) -> None:
    """The kubelet's update: the data in a new folder, then `..data` pointed at it in one rename."""
    folder = volume / f"..{version}"
    folder.mkdir()
    (folder / "keys.yaml").write_text(text)
    tmp = volume / "..data_tmp"
    tmp.symlink_to(folder.name)
    os.replace(tmp, volume / "..data")
    if not (volume / "keys.yaml").is_symlink():
        (volume / "keys.yaml").symlink_to("..data/keys.yaml")


def status_with(server: Server, key: str) -> int:
    return httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {BOUND_S} s waiting for {what}")


@pytest.fixture(scope="module")
def rotated(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    volume = tmp_path_factory.mktemp("secret-volume")
    write_secret(volume, "2026_12_01_00_00_00.1", f"{OLD}: team-a\n")
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--api-keys-file",
                          str(volume / "keys.yaml"), "--max-model-len", "128")
    yield server, volume
    server.stop()


def test_a_rotated_secret_takes_effect_without_a_restart(rotated: tuple[Server, Path]) -> None:
    server, volume = rotated
    assert status_with(server, OLD) == 200 and status_with(server, NEW) == 401
    write_secret(volume, "2026_12_02_00_00_00.2", f"{NEW}: team-a\n")
    wait_until(lambda: status_with(server, NEW) == 200, "the new key to work")
    assert status_with(server, OLD) == 401
    done = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {NEW}"}, timeout=60,
                      json={"prompt": "hello", "max_tokens": 3})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    # a broken update: the last good keys stay, logged without any key (the file is looked at on requests)
    write_secret(volume, "2026_12_03_00_00_00.3", "- not a mapping\n")
    wait_until(lambda: status_with(server, NEW) == 200 and "API keys not reloaded" in server.log.read_text(),
               "the reload warning")
    assert NEW not in server.log.read_text() and OLD not in server.log.read_text()
