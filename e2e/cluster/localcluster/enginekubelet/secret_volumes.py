"""Secret volumes laid out as the kubelet's atomic writer does it, so an update is one rename.

    <folder>/..2026_12_04_22_01_02.123456/<files>   the data, one folder per version
    <folder>/..data -> ..2026_12_04_22_01_02.123456  swapped by rename when the Secret changes
    <folder>/<name> -> ..data/<name>                 one link per top-level entry, made once

A reader that opens `<folder>/<name>` sees the old version or the new one, never a mix; what an engine reads
from a mounted Secret (`--api-keys-file`) changes under it without a restart, as on a real node.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

DATA_LINK = "..data"


def digest(files: Mapping[str, bytes]) -> str:
    """Identifies a version of the volume's files (what decides whether to write a new one)."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    return h.hexdigest()


def write_version(folder: Path, files: Mapping[str, bytes]) -> None:
    """Writes `files` (relative path -> content) as the volume's new version and switches `..data` to it."""
    folder.mkdir(parents=True, mode=0o700, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y_%m_%d_%H_%M_%S.%f")
    version = folder / f"..{stamp}"
    version.mkdir(mode=0o700)
    for rel, content in files.items():
        path = version / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(0o600)
    link = folder / DATA_LINK
    previous = os.readlink(link) if link.is_symlink() else None
    tmp = folder / f"{DATA_LINK}_tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(version.name)
    os.replace(tmp, link)
    tops = {rel.split("/", 1)[0] for rel in files}
    for top in tops:
        entry = folder / top
        if not entry.is_symlink():
            entry.symlink_to(f"{DATA_LINK}/{top}")
    for entry in folder.iterdir():   # a key the Secret no longer has: its link goes too
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()
    if previous is not None and previous != version.name:
        shutil.rmtree(folder / previous, ignore_errors=True)
