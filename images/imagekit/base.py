"""The base image: Debian stable from `debootstrap` (no registry needed), trimmed like debian:bookworm-slim.

The Containerfiles default to docker.io/library/debian:bookworm-slim; `make images` builds this instead and passes it
as the BASE build argument, so the same Containerfiles build here and anywhere else.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from .tools import Store

SUITE = "bookworm"  # Debian 12, the current stable release
MIRROR = os.environ.get("KVFLEET_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SECURITY_MIRROR = os.environ.get("KVFLEET_DEBIAN_SECURITY_MIRROR", "http://deb.debian.org/debian-security")

# What debian:*-slim leaves out (its /etc/dpkg/dpkg.cfg.d/docker): later apt installs skip these paths too.
DPKG_EXCLUDES = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""

SOURCES = f"""\
Types: deb
URIs: {MIRROR}
Suites: {SUITE} {SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: {SECURITY_MIRROR}
Suites: {SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def base_key() -> str:
    recipe = "\n".join(["base-1", SUITE, MIRROR, SECURITY_MIRROR, DPKG_EXCLUDES, SOURCES])
    return hashlib.sha256(recipe.encode()).hexdigest()


def base_reference() -> str:
    return f"localhost/kvfleet/debian-base:{SUITE}-{base_key()[:12]}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _trim(rootfs: Path) -> None:
    (rootfs / "etc/dpkg/dpkg.cfg.d/docker").write_text(DPKG_EXCLUDES)
    (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
    (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(SOURCES)
    doc = rootfs / "usr/share/doc"
    for pkg in doc.iterdir() if doc.is_dir() else ():
        for item in pkg.iterdir() if pkg.is_dir() and not pkg.is_symlink() else ():
            if item.name != "copyright":
                _remove(item)
    for rel in ("usr/share/man", "usr/share/info", "usr/share/groff", "usr/share/lintian"):
        shutil.rmtree(rootfs / rel, ignore_errors=True)
    locale = rootfs / "usr/share/locale"
    for item in locale.iterdir() if locale.is_dir() else ():
        if item.name != "locale.alias":
            _remove(item)
    for rel in ("var/cache/apt/archives", "var/lib/apt/lists", "var/log"):
        for item in (rootfs / rel).glob("*"):
            if item.is_file():
                item.unlink()
    (rootfs / "etc/hostname").write_text("")  # the runtime sets it


def ensure_base(store: Store, log: Callable[[str], None] = print) -> str:
    """The base image's reference, built first when this storage lacks it (about a minute and a half)."""
    ref = base_reference()
    if store.image_label(ref, "org.opencontainers.image.title") is not None:
        return ref
    rootfs = store.tmp / f"rootfs-{os.getpid()}"
    shutil.rmtree(rootfs, ignore_errors=True)
    log(f"[images] base: debootstrap --variant=minbase {SUITE} from {MIRROR}")
    try:
        logfile = store.root / "debootstrap.log"
        with logfile.open("w") as out:
            done = subprocess.run(["nice", "debootstrap", "--variant=minbase", SUITE, str(rootfs), MIRROR],
                                  stdout=out, stderr=subprocess.STDOUT, env=store.env())
        if done.returncode != 0:
            raise RuntimeError(f"debootstrap failed (exit {done.returncode}); see {logfile}")
        _trim(rootfs)
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        changes = ["CMD [\"/bin/bash\"]", f"LABEL org.opencontainers.image.title=debian-{SUITE}-debootstrap",
                   f"LABEL dev.kvfleet.base-key={base_key()}"]
        argv = store.podman("import", *[a for c in changes for a in ("--change", c)], "-", ref)
        imported = subprocess.run(argv, stdin=tar.stdout, env=store.env(), capture_output=True, text=True)
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"importing the base rootfs failed: {imported.stderr.strip()}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    log(f"[images] base: {ref}")
    return ref
