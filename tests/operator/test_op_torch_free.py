"""The control-plane image has no torch: the operator's modules and `kvfleet operator` must never import it.

Each check runs in a fresh interpreter where torch and the engine's other heavy dependencies cannot be imported
(None in sys.modules: `import torch` fails and importlib finds no torch), as in kvfleet[operator,gateway].
"""
from __future__ import annotations

import subprocess
import sys

import pytest

BLOCKED = ("torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "gguf")
PRELUDE = f"import importlib, sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n"


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=120)


def test_torch_is_unimportable_here() -> None:
    proc = run("import importlib.util; assert importlib.util.find_spec('torch') is None; import torch")
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


@pytest.mark.parametrize("argv", [["operator", "--help"], ["--help"]])
def test_cli_answers_without_torch(argv: list[str]) -> None:
    proc = run(f"from kvfleet.engine.cli import main; sys.exit(main({argv!r}))")
    assert proc.returncode == 0, proc.stderr
    assert "usage: kvfleet" in proc.stdout


def test_every_control_plane_module_imports_without_torch() -> None:
    """The operator's modules, and the gateway's once it is there: all of what the control-plane image runs."""
    proc = run("""
import importlib.util, pkgutil
names = []
for package in ("kvfleet.operator", "kvfleet.gateway"):
    if importlib.util.find_spec(package) is None:
        continue
    names += sorted(m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."))
for name in names:
    if not name.endswith("__main__"):
        importlib.import_module(name)
print(len(names))
""")
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) > 20


def test_serve_without_torch_says_what_is_missing() -> None:
    proc = run("from kvfleet.engine.cli import main; sys.exit(main(['serve']))")
    assert proc.returncode == 2
    assert "kvfleet[engine]" in proc.stderr and "Traceback" not in proc.stderr
