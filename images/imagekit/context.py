"""The build context (exactly the files an image is built from) and the key that names its cache entry."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterable

from .specs import CONTEXT_ROOTS, REPO, ImageSpec

# Bump when the way images are built changes in a way the inputs do not show (build flags, the base recipe).
RECIPE = "2"
_SKIP_PARTS = {"__pycache__", ".mypy_cache", ".pytest_cache"}


def context_files(repo: Path = REPO) -> list[str]:
    """Relative paths of the context: tracked and untracked-but-not-ignored files under the roots that exist."""
    roots = [r for r in CONTEXT_ROOTS if (repo / r).exists()]
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *roots],
                             cwd=repo, capture_output=True, check=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked source tarball)
        files = [str(p.relative_to(repo)) for r in roots for p in ([repo / r] if (repo / r).is_file()
                                                                      else sorted((repo / r).rglob("*")))]
    keep = {f for f in files if (repo / f).is_file() and not _SKIP_PARTS.intersection(Path(f).parts)
            and not f.endswith(".pyc") and ".egg-info" not in f}
    return sorted(keep)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def input_key(spec: ImageSpec, files: Iterable[str], build_args: dict[str, str], repo: Path = REPO) -> str:
    """sha256 over the Containerfile, every context file (path, executable bit, content) and the build args."""
    h = hashlib.sha256(f"recipe={RECIPE}\nimage={spec.name}\n".encode())
    for name in [spec.containerfile, *files]:
        path = repo / name
        mode = "x" if os.access(path, os.X_OK) else "-"
        h.update(f"{name}\0{mode}\0{_digest(path)}\n".encode())
    for k in sorted(build_args):
        h.update(f"arg {k}={build_args[k]}\n".encode())
    return h.hexdigest()


def stage(files: Iterable[str], dest: Path, repo: Path = REPO) -> None:
    """Copy the context into `dest` (a fresh directory): the build sees exactly what the key was made of."""
    if dest.exists():
        shutil.rmtree(dest)
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, target)
