"""Where the images live on this machine, and the buildah / podman / skopeo command lines that reach them.

Everything sits under one cache root outside the checkout (`~/.cache/kvfleet/images`, or `$KVFLEET_CACHE/images`),
in its own containers-storage (overlay driver), so the images never mix with other users' podman storage and a
fresh clone on the same machine finds them.
"""
from __future__ import annotations

import fcntl
import os
import resource
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

TOOLS = ("buildah", "podman", "skopeo", "runc", "debootstrap")


def cache_root() -> Path:
    base = os.environ.get("KVFLEET_CACHE") or str(Path.home() / ".cache" / "kvfleet")
    return Path(base) / "images"


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]


@dataclass(frozen=True)
class Store:
    """One containers-storage and the archives made from it."""
    root: Path

    @classmethod
    def default(cls) -> "Store":
        return cls(cache_root())

    @property
    def graph(self) -> Path:
        return self.root / "storage"

    @property
    def runroot(self) -> Path:
        return self.root / "run"

    @property
    def archives(self) -> Path:
        return self.root / "archives"

    @property
    def tmp(self) -> Path:
        """TMPDIR of the builds: buildah's temporary files and its RUN --mount=type=cache directories."""
        return self.root / "tmp"

    def clear_tmp(self) -> None:
        """Empty the temporary directory (call with the lock held), keeping the builds' cache mounts."""
        for item in self.tmp.glob("*"):
            if item.name.startswith("buildah-cache"):
                continue
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item, ignore_errors=True)
            else:
                item.unlink(missing_ok=True)

    def storage_flags(self) -> list[str]:
        return ["--root", str(self.graph), "--runroot", str(self.runroot), "--storage-driver", "overlay"]

    def transport(self, reference: str) -> str:
        """skopeo's name for an image in this storage."""
        return f"containers-storage:[overlay@{self.graph}+{self.runroot}]{reference}"

    def env(self) -> dict[str, str]:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "TMPDIR": str(self.tmp)}

    def podman(self, *args: str) -> list[str]:
        # crun fails here (setrlimit, hybrid cgroups); runc works (shared/design/images.md).
        return ["podman", *self.storage_flags(), "--runtime", "runc", *args]

    def buildah(self, *args: str) -> list[str]:
        return ["buildah", *self.storage_flags(), *args]

    def run(self, argv: Sequence[str], check: bool = True, capture: bool = False,
            timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=self.env(), check=check, text=True, timeout=timeout,
                              capture_output=capture)

    def image_label(self, reference: str, label: str) -> str | None:
        """A label of an image in this storage, or None when the image is not there."""
        out = self.run(self.podman("image", "inspect", "--format", f'{{{{index .Labels "{label}"}}}}', reference),
                       check=False, capture=True)
        return out.stdout.strip() if out.returncode == 0 else None

    @contextmanager
    def lock(self) -> Iterator[None]:
        """One build at a time on this machine (worktrees share the storage)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / "build.lock").open("w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


# podman's defaults (about a million open files, 4 million processes) are more than runc may set in this sandbox,
# and so are its own hard limits (nproc 65536 fails where 32768 works): ask for a modest amount, within them.
_ULIMIT_CAP = 16384


def ulimit_flags() -> list[str]:
    flags = []
    for name, kind in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        _, hard = resource.getrlimit(kind)
        value = _ULIMIT_CAP if hard == resource.RLIM_INFINITY else min(hard, _ULIMIT_CAP)
        flags += ["--ulimit", f"{name}={value}:{value}"]
    return flags
