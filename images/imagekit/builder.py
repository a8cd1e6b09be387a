"""Build an image into an OCI archive under the cache, keyed by its inputs; load an archive back for running."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .base import base_reference, ensure_base
from .context import context_files, input_key, stage
from .specs import REPO, ImageSpec, project_version
from .tools import Store

INPUTS_LABEL = "dev.kvfleet.image.inputs"
Log = Callable[[str], None]


@dataclass(frozen=True)
class Archive:
    """Where an image with these inputs is (or would be) kept, and under which reference."""
    spec: ImageSpec
    reference: str
    key: str
    files: tuple[str, ...]
    build_args: tuple[tuple[str, str], ...]
    path: Path

    @property
    def meta_path(self) -> Path:
        return self.path.with_suffix(".json")

    def meta(self) -> dict | None:
        try:
            return json.loads(self.meta_path.read_text())
        except (OSError, ValueError):
            return None

    @property
    def cached(self) -> bool:
        return self.path.is_file() and self.meta() is not None


def plan(spec: ImageSpec, store: Store, repo: Path = REPO) -> Archive:
    version = project_version(repo)
    args = {"VERSION": version, "BASE": base_reference()}
    files = context_files(repo)
    key = input_key(spec, files, args, repo)
    path = store.archives / f"kvfleet-{spec.name}-{version}-{key[:16]}.oci.tar"
    return Archive(spec, spec.reference(version), key, tuple(files), tuple(sorted(args.items())), path)


def _revision(repo: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def _ca_secret() -> list[str]:
    """The CA bundle pip trusts here, lent to the build's pip steps as a secret (never stored in a layer): these
    machines reach PyPI through a TLS-intercepting proxy whose CA only the host's bundle has."""
    ca = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    return ["--secret", f"id=build-ca,src={ca}"] if Path(ca).is_file() else []


def _buildah_bud(archive: Archive, store: Store, context: Path, revision: str, log: Log, target: str = "",
                 tag: str = "") -> None:
    argv = store.buildah(
        "bud", "--isolation", "chroot", "--network", "host", "--layers", "--pull-never",
        "-f", str(context / archive.spec.containerfile), *(["--target", target] if target else []),
        *[a for k, v in archive.build_args for a in ("--build-arg", f"{k}={v}")],
        "--build-arg", f"REVISION={revision}",
        "--label", f"{INPUTS_LABEL}={archive.key}",
        *_ca_secret(),
        "-t", tag or archive.reference, str(context))
    logfile = store.root / "logs" / f"{archive.spec.name}-{archive.key[:12]}{'-' + target if target else ''}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with logfile.open("w") as out:
        proc = subprocess.Popen(["nice", *argv], env=store.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if "STEP " in line or line.startswith("COMMIT"):
                log(f"[images] {archive.spec.name}: {line.rstrip()[:150]}")
        if proc.wait() != 0:
            raise RuntimeError(f"building {archive.reference} failed (exit {proc.returncode}); see {logfile}")


# gzip's fastest level: the export is compression-bound (2.3x faster than the default level on these 2 shared
# cores) for archives 5 % (engine: 3359 vs 3206 MB) to 14 % (control plane: 111 vs 97 MB) larger.
COMPRESSION_LEVEL = "1"


def _export(archive: Archive, store: Store) -> None:
    """containers-storage -> OCI archive (gzip layers), written aside and renamed: never half an archive."""
    archive.path.parent.mkdir(parents=True, exist_ok=True)
    part = archive.path.with_name(archive.path.name + ".part")
    part.unlink(missing_ok=True)
    store.run(["nice", "skopeo", "--tmpdir", str(store.tmp), "copy", "--quiet",
               "--dest-compress-level", COMPRESSION_LEVEL, store.transport(archive.reference),
               f"oci-archive:{part}:{archive.reference}"])
    os.replace(part, archive.path)


def _image_bytes(store: Store, reference: str) -> int:
    out = store.run(store.podman("image", "inspect", "--format", "{{.Size}}", reference), capture=True)
    return int(out.stdout.strip())


def _tools_reference(spec: ImageSpec) -> str:
    """The build's `tools` stage, tagged so that collecting garbage keeps it (its layers are the next build's)."""
    return f"localhost/kvfleet/{spec.name}-tools:latest"


def collect_garbage(store: Store) -> int:
    """Remove images that are neither tagged nor an ancestor of a tagged one (layers of superseded builds); keep
    the layer chains of the current images, which are what the next build reuses. Returns how many went."""
    out = store.run(store.podman("images", "--all", "--format", "json"), capture=True)
    images = {i["Id"]: i for i in json.loads(out.stdout or "[]")}
    keep: set[str] = set()
    for image in images.values():
        node = image["Id"] if image.get("Names") or image.get("Containers") else ""
        while node and node not in keep:
            keep.add(node)
            node = (images.get(node) or {}).get("ParentId", "")
    garbage = [i for i in images if i not in keep]
    if garbage:
        store.run(store.podman("rmi", "--force", *garbage), check=False, capture=True)
    return len(garbage)


def _prune(archive: Archive, store: Store, log: Log) -> None:
    """Keep the newest `spec.keep_archives` archives of this image (this one first) and no superseded layers."""
    pattern = f"kvfleet-{archive.spec.name}-*.oci.tar"
    older = sorted((p for p in store.archives.glob(pattern) if p != archive.path),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in older[max(0, archive.spec.keep_archives - 1):]:
        log(f"[images] removing an older archive: {stale.name}")
        stale.unlink(missing_ok=True)
        stale.with_suffix(".json").unlink(missing_ok=True)
    removed = collect_garbage(store)
    if removed:
        log(f"[images] removed {removed} superseded image layers")


def build(spec: ImageSpec, store: Store, repo: Path = REPO, log: Log = print) -> Archive:
    """The image's archive: taken from the cache when these inputs were built before, else built now."""
    with store.lock():
        archive = plan(spec, store, repo)
        if archive.cached:
            log(f"[images] {spec.name}: cached {archive.path}")
            return archive
        started = time.monotonic()
        store.clear_tmp()  # what a killed build left (GBs for the engine)
        ensure_base(store, log)
        context = store.tmp / f"context-{spec.name}-{os.getpid()}"
        revision = _revision(repo)
        try:
            stage([*archive.files, spec.containerfile], context, repo)
            _buildah_bud(archive, store, context, revision, log, target="tools", tag=_tools_reference(spec))
            _buildah_bud(archive, store, context, revision, log)
        finally:
            shutil.rmtree(context, ignore_errors=True)
        built = time.monotonic()
        log(f"[images] {spec.name}: built in {built - started:.0f} s; exporting {archive.path.name}")
        _export(archive, store)
        exported = time.monotonic()
        image_bytes, archive_bytes = _image_bytes(store, archive.reference), archive.path.stat().st_size
        meta = {"reference": archive.reference, "inputs": archive.key, "revision": revision,
                "build_seconds": round(built - started, 1), "export_seconds": round(exported - built, 1),
                "image_bytes": image_bytes, "archive_bytes": archive_bytes,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        archive.meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        _prune(archive, store, log)
        log(f"[images] {spec.name}: {archive.reference} {image_bytes / 1e6:.0f} MB "
            f"({archive_bytes / 1e6:.0f} MB compressed) in {exported - started:.0f} s")
        return archive


def ensure_loaded(archive: Archive, store: Store) -> str:
    """The archive's image in the local storage under its reference (loaded from the archive when needed)."""
    if store.image_label(archive.reference, INPUTS_LABEL) == archive.key:
        return archive.reference
    if not archive.cached:
        raise FileNotFoundError(f"{archive.path} is not built: run `make images`")
    with store.lock():
        store.run(["nice", "skopeo", "--tmpdir", str(store.tmp), "copy", "--quiet", f"oci-archive:{archive.path}",
                   store.transport(archive.reference)])
    return archive.reference
