"""vLLM's wheels for the H200, which reaches no registry: check, pack into carry-sized parts, rebuild there.

The lent H200 runs each call over a copy of the repository of at most 64 MiB, so the 303 MB vLLM wheel and the
small wheels it needs beyond the image's packages travel as parts: one xz-compressed tar (the small wheels as they
are, the vLLM wheel's members unzipped; its CUDA fatbins compress ~3.5x better with xz than with the wheel's
deflate), split into pieces of ``--part-mib`` each, one folder per piece (``part1``, ``part2``, ...), each with a
copy of ``SHA256SUMS``. On the device ``rebuild`` makes the vLLM wheel again from the unpacked members and checks
every file against the wheel's own RECORD (sha256 per file), so what pip installs there is byte for byte what PyPI
served. ``bench/vllm_wheels.sh`` drives the steps; this module holds the parts that need Python.

    python bench/vllm_wheels.py check DL_DIR LIST [--image-packages KINDS.md]
    python bench/vllm_wheels.py pack DL_DIR OUT_DIR [--part-mib 50]
    python bench/vllm_wheels.py rebuild UNPACKED_DIR WHEEL_DIR
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

VLLM_MEMBERS = "vllm-wheel"  # folder in the bundle holding the vLLM wheel's members
MANIFEST = "manifest.json"


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of '-', '_', '.' as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(list_file: Path) -> dict[str, str]:
    """``name==version`` lines of the wheel list (comments and blanks skipped) as {canonical name: version}."""
    pins = {}
    for line in list_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"{list_file}: {line!r} is not name==version")
        pins[canonical(name)] = version.strip()
    return pins


def image_packages(kinds_md: Path) -> set[str]:
    """The H200 image's package names, from KINDS.md's 'Python packages already there' paragraph."""
    text = kinds_md.read_text()
    m = re.search(r"Packages: (.*?)\.\n", text)
    if not m:
        raise ValueError(f"{kinds_md}: no 'Packages: ...' list found")
    return {canonical(p) for p in m.group(1).split(", ")}


def wheel_metadata(whl: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines without extras-only ones) of a wheel."""
    with zipfile.ZipFile(whl) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        meta = z.read(meta_name).decode()
    name = re.search(r"^Name: (.+)$", meta, re.M)
    version = re.search(r"^Version: (.+)$", meta, re.M)
    if not name or not version:
        raise ValueError(f"{whl.name}: METADATA has no Name/Version")
    reqs = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
    return canonical(name.group(1).strip()), version.group(1).strip(), reqs


def check(dl_dir: Path, list_file: Path, kinds_md: Path | None) -> list[str]:
    """Problems: a pin without its wheel, two versions of one package, a third-party module that importing vLLM's
    entry points imports unguarded and nothing provides, and (reported, not fatal) each Requires-Dist (markers
    evaluated for CPython 3.12 on x86-64 Linux) met neither by a wheel here nor by the image: vLLM declares kernel
    packages (flashinfer, tilelang, ...) it imports only inside functions of paths the benchmark does not take."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = default_environment()
    env.update(python_version="3.12", python_full_version="3.12.3", platform_machine="x86_64",
               platform_system="Linux", sys_platform="linux", implementation_name="cpython")
    pins = read_pins(list_file)
    wheels: dict[str, tuple[str, list[str]]] = {}
    problems: list[str] = []
    for whl in sorted(dl_dir.glob("*.whl")):
        name, version, reqs = wheel_metadata(whl)
        if name in wheels:
            problems.append(f"two wheels of {name}: {wheels[name][0]} and {version}")
        wheels[name] = (version, reqs)
    for name, version in pins.items():
        if name not in wheels:
            problems.append(f"missing wheel: {name}=={version}")
        elif wheels[name][0] != version:
            problems.append(f"{name}: list pins {version}, wheel is {wheels[name][0]}")
    image = image_packages(kinds_md) if kinds_md else set()
    unmet: dict[str, set[str]] = {}
    for name, (_, reqs) in sorted(wheels.items()):
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonical(req.name)
            if dep in wheels:
                if wheels[dep][0] not in req.specifier and req.specifier:
                    problems.append(f"{name} needs {req}, the wheel is {wheels[dep][0]}")
            elif dep not in image:
                unmet.setdefault(dep, set()).add(name)
    for dep, by in sorted(unmet.items()):
        problems.append(f"declared, not in the wheels nor the image: {dep} (needed by {', '.join(sorted(by))})")
    vllm = [w for w in dl_dir.glob("*.whl") if wheel_metadata(w)[0] == "vllm"]
    if vllm:
        provided = {canonical(m) for w in dl_dir.glob("*.whl") for m in _top_levels(w)} | image
        for top, by in sorted(unguarded_imports(vllm[0]).items()):
            if not {canonical(top), canonical(IMPORT_ALIASES.get(top, top))} & provided:
                problems.append(f"IMPORTED and missing: {top} (by {', '.join(sorted(by)[:3])})")
    return problems


# Import names of image packages that differ from their distribution's name (the wheels' own come from RECORD).
IMPORT_ALIASES = {"PIL": "pillow", "yaml": "pyyaml", "cv2": "opencv-python-headless", "cpuinfo": "py-cpuinfo",
                  "google": "protobuf", "dateutil": "python-dateutil", "sklearn": "scikit-learn",
                  "pynvml": "nvidia-ml-py", "jwt": "pyjwt", "dotenv": "python-dotenv"}
# Where the benchmark enters vLLM: offline LLM, `vllm serve`, the engine core and GPU worker, the two models.
VLLM_ENTRIES = ("vllm", "vllm.entrypoints.llm", "vllm.entrypoints.cli.main", "vllm.entrypoints.openai.api_server",
                "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
                "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3",
                "vllm.v1.attention.backends.flash_attn", "vllm.model_executor.layers.quantization.fp8")


def _module_imports(tree: ast.Module, modname: str, is_pkg: bool) -> list[tuple[str, bool]]:
    """(module, guarded) for every import that runs when the module is imported: module and class bodies,
    both arms of an `if`, `try` bodies (guarded when a handler catches ImportError or wider); function bodies and
    `if TYPE_CHECKING` are skipped. An `if` counts as guarded too: its test is usually a platform check."""
    out: list[tuple[str, bool]] = []

    def catches_import_error(h: ast.ExceptHandler) -> bool:
        if h.type is None:
            return True
        elts = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        names = {e.id if isinstance(e, ast.Name) else getattr(e, "attr", "") for e in elts}
        return bool(names & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "OSError"})

    def walk(body: list[ast.stmt], guarded: bool) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" in ast.unparse(node.test):
                    walk(node.orelse, guarded)
                else:
                    walk(node.body, True)
                    walk(node.orelse, True)
            elif isinstance(node, ast.Try):
                walk(node.body, guarded or any(catches_import_error(h) for h in node.handlers))
                for h in node.handlers:
                    walk(h.body, guarded)
                walk(node.orelse, guarded)
                walk(node.finalbody, guarded)
            elif isinstance(node, (ast.ClassDef, ast.With)):
                walk(node.body, guarded)
            elif isinstance(node, ast.Import):
                out.extend((a.name, guarded) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    base = modname.split(".")[: None if is_pkg else -1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([mod] if mod else []))
                out.append((mod, guarded))
                out.extend((f"{mod}.{a.name}", guarded) for a in node.names)

    walk(tree.body, False)
    return out


def unguarded_imports(vllm_wheel: Path, entries: tuple[str, ...] = VLLM_ENTRIES) -> dict[str, set[str]]:
    """Third-party top-level modules imported, unguarded, by the vLLM modules that importing ``entries`` runs
    (following vLLM's own imports), as {top-level name: importing modules}."""
    sources: dict[str, tuple[str, bool]] = {}
    with zipfile.ZipFile(vllm_wheel) as z:
        for n in z.namelist():
            if n.startswith("vllm/") and n.endswith(".py"):
                parts = n[:-3].split("/")
                is_pkg = parts[-1] == "__init__"
                sources[".".join(parts[:-1] if is_pkg else parts)] = (z.read(n).decode(), is_pkg)
    stdlib = set(sys.stdlib_module_names)
    found: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod in seen or mod not in sources:
                continue
            seen.add(mod)
            text, is_pkg = sources[mod]
            for imp, guarded in _module_imports(ast.parse(text), mod, is_pkg):
                top = imp.split(".")[0]
                if top == "vllm":
                    if not guarded:
                        todo.append(imp)
                elif not guarded and top and top not in stdlib:
                    found.setdefault(top, set()).add(mod)
    return found


def _top_levels(whl: Path) -> set[str]:
    with zipfile.ZipFile(whl) as z:
        return {n.split("/")[0].removesuffix(".py") for n in z.namelist()
                if ".dist-info/" not in n and ".data/" not in n.split("/")[0] + "/"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# vLLM's FlashAttention-2 kernels: 305 MB, and xz does not shrink them below the wheel's deflate (~129 MB). On a
# Hopper GPU vLLM runs FlashAttention-3 (v1/attention/backends/fa_utils.py: sm90 -> FA3), and the module that
# loads FA2 catches its ImportError. They travel as their own optional stream: without them vLLM needs half the
# parts (and calls); with them it is complete.
OPTIONAL_MEMBERS = {"fa2": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",)}


def _tar_member(tar: tarfile.TarFile, name: str, payload: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    info.mode = mode
    tar.addfile(info, io.BytesIO(payload))


def _split(path: Path, out_dir: Path, prefix: str, part_bytes: int, first: int) -> list[Path]:
    parts = []
    with path.open("rb") as f:
        i = first
        while chunk := f.read(part_bytes):
            d = out_dir / f"{prefix}{i}"
            d.mkdir()
            (d / f"{path.name}.{i - first + 1:02d}").write_bytes(chunk)
            parts.append(d)
            i += 1
    return parts


def pack(dl_dir: Path, out_dir: Path, part_mib: int, xz_threads: int = 2) -> list[Path]:
    """OUT_DIR/partN/core.tar.xz.NN (the small wheels and vLLM without its optional members, xz -9) and
    OUT_DIR/fa2-partN/fa2.tar.xz.NN (OPTIONAL_MEMBERS, xz -2: it does not compress further), each piece at most
    part_mib MiB, and SHA256SUMS in every part folder."""
    wheels = sorted(dl_dir.glob("*.whl"))
    vllm = [w for w in wheels if wheel_metadata(w)[0] == "vllm"]
    if len(vllm) != 1:
        raise ValueError(f"{dl_dir}: expected one vllm wheel, found {len(vllm)}")
    small = [w for w in wheels if w != vllm[0]]
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("part*"), *out_dir.glob("*-part*")]:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    optional = {m: group for group, members in OPTIONAL_MEMBERS.items() for m in members}
    manifest = {"vllm_wheel": vllm[0].name, "vllm_wheel_sha256": _sha256(vllm[0]),
                "wheels": {w.name: _sha256(w) for w in small}, "optional": OPTIONAL_MEMBERS}
    tars = {"core": out_dir / "core.tar", **{g: out_dir / f"{g}.tar" for g in OPTIONAL_MEMBERS}}
    handles = {k: tarfile.open(p, "w", format=tarfile.PAX_FORMAT) for k, p in tars.items()}
    try:
        _tar_member(handles["core"], MANIFEST, json.dumps(manifest, indent=1).encode())
        for w in small:
            handles["core"].add(w, arcname=f"wheels/{w.name}")
        with zipfile.ZipFile(vllm[0]) as z:
            for zi in z.infolist():
                if not zi.is_dir():
                    _tar_member(handles[optional.get(zi.filename, "core")], f"{VLLM_MEMBERS}/{zi.filename}",
                                z.read(zi), (zi.external_attr >> 16) & 0o7777 or 0o644)
    finally:
        for h in handles.values():
            h.close()
    parts: list[Path] = []
    sums = ""
    for kind, tar_path in tars.items():
        level = "-9" if kind == "core" else "-2"
        subprocess.run(["xz", "-f", level, f"-T{xz_threads}", str(tar_path)], check=True)
        xz = tar_path.with_name(tar_path.name + ".xz")
        pieces = _split(xz, out_dir, "part" if kind == "core" else f"{kind}-part", part_mib << 20, 1)
        sums += f"{_sha256(xz)}  {xz.name}\n" + "".join(
            f"{_sha256(d / f'{xz.name}.{n:02d}')}  {xz.name}.{n:02d}\n" for n, d in enumerate(pieces, 1))
        sums += f"# {kind} parts: {len(pieces)}\n"
        parts += pieces
        xz.unlink()
    for d in parts:
        (d / "SHA256SUMS").write_text(sums)
    return parts


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rebuild(unpacked: Path, wheel_dir: Path) -> Path:
    """The vLLM wheel again (stored, no compression: pip only unpacks it) from UNPACKED/vllm-wheel, every member
    checked against its RECORD line; the small wheels checked against the manifest's sha256 and copied over."""
    manifest = json.loads((unpacked / MANIFEST).read_text())
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for name, digest in manifest["wheels"].items():
        src = unpacked / "wheels" / name
        if _sha256(src) != digest:
            raise ValueError(f"{name}: sha256 differs from the manifest")
        (wheel_dir / name).write_bytes(src.read_bytes())
    root = unpacked / VLLM_MEMBERS
    record_path = next(root.glob("*.dist-info/RECORD"))
    record_rel = record_path.relative_to(root).as_posix()
    rows = [r for r in csv.reader(record_path.read_text().splitlines()) if r]
    optional = {m for members in manifest.get("optional", {}).values() for m in members}
    left_out = [r[0] for r in rows if r[0] in optional and not (root / r[0]).is_file()]
    out = wheel_dir / manifest["vllm_wheel"]
    checked = 0
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        for row in rows:
            rel, digest = row[0], row[1] if len(row) > 1 else ""
            if rel in left_out:
                continue
            if rel == record_rel and left_out:   # the RECORD pip writes lists what is really there
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(r for r in rows if r[0] not in left_out)
                text = buf.getvalue()
                zi = zipfile.ZipInfo(rel, date_time=(2020, 1, 1, 0, 0, 0))
                z.writestr(zi, text)
                continue
            data = (root / rel).read_bytes()
            if rel != record_rel:
                if not digest:
                    raise ValueError(f"RECORD has no hash for {rel}")
                if _record_hash(data) != digest:
                    raise ValueError(f"{rel}: sha256 differs from the wheel's RECORD")
                checked += 1
            zi = zipfile.ZipInfo(rel, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = ((root / rel).stat().st_mode & 0o7777) << 16
            z.writestr(zi, data)
    listed = {r[0] for r in rows}
    extra = [p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in listed]
    if extra:
        raise ValueError(f"files not in RECORD: {[str(p) for p in extra[:5]]}")
    print(f"rebuilt {out.name}: {checked} files match RECORD; {len(manifest['wheels'])} small wheels match"
          + (f"; left out (optional, not carried): {', '.join(left_out)}" if left_out else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("dl_dir", type=Path)
    c.add_argument("list_file", type=Path)
    c.add_argument("--image-packages", type=Path, default=None, help="KINDS.md with the image's package list")
    p = sub.add_parser("pack")
    p.add_argument("dl_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--part-mib", type=int, default=50)
    r = sub.add_parser("rebuild")
    r.add_argument("unpacked", type=Path)
    r.add_argument("wheel_dir", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "check":
            problems = check(args.dl_dir, args.list_file, args.image_packages)
            print("\n".join(problems) or "all pins present, every requirement met")
            return 1 if any(not p.startswith("declared,") for p in problems) else 0
        if args.cmd == "pack":
            for d in pack(args.dl_dir, args.out_dir, args.part_mib):
                size = sum(f.stat().st_size for f in d.iterdir())
                print(f"{d}: {size / 2**20:.1f} MiB")
            return 0
        rebuild(args.unpacked, args.wheel_dir)
        return 0
    except (ValueError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
