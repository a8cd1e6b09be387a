"""Engines with their own key (`spec.apiKeySecretRef`): which keys the gateway sends them (pure).

The Secret entry holds what the engine reads: a kvfleet engine's keys file (`key: tenant`, YAML or JSON, its
`--api-keys-file`), a vLLM engine's one key (`VLLM_API_KEY`). Every key of a kvfleet file is a candidate. The
gateway sends each replica the key that last worked there (as long as it takes it, in the Secret or not), else
the entry's first, and the next one when the engine answers 401: an engine reads a rotated Secret a kubelet sync
after the gateway does (a vLLM engine only when it restarts), so for a while either may be the one it takes.
Problems name the Secret and the entry, never a key.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Iterable, Mapping

from kvfleet.engine.server.auth import KeyFileError, parse_keys


@dataclass(frozen=True)
class EngineKeyRef:
    """Where a ModelDeployment's engines' key is: a Secret of its namespace, one entry, read as `engine_kind`."""

    namespace: str
    name: str
    entry: str
    engine_kind: str = "kvfleet"

    @property
    def where(self) -> str:
        return f"Secret {self.namespace}/{self.name}, entry {self.entry!r}"


@dataclass(frozen=True)
class EngineKeys:
    """The keys an engine may take, in the Secret's order; none, with the reason, when there are none."""

    keys: tuple[str, ...] = ()
    problem: str = ""


def engine_keys(ref: EngineKeyRef, data: Mapping[str, str] | None) -> EngineKeys:
    """The candidates in the Secret's base64 `data` for an engine of `ref.engine_kind`."""
    raw = (data or {}).get(ref.entry)
    if raw is None:
        return EngineKeys(problem=f"{ref.where}: the Secret has no such entry")
    try:
        text = base64.b64decode(raw, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return EngineKeys(problem=f"{ref.where}: not base64 of UTF-8 text")
    if ref.engine_kind == "vllm":
        key = text.strip()
        return EngineKeys((key,)) if key else EngineKeys(problem=f"{ref.where}: empty")
    try:
        return EngineKeys(tuple(parse_keys(text, ref.where)))
    except KeyFileError as exc:
        return EngineKeys(problem=str(exc))


def key_order(keys: Iterable[str], preferred: str | None, fallbacks: Iterable[str] = (),
              tried: Iterable[str] = ()) -> tuple[str, ...]:
    """The keys to try on one replica, untried ones only: the one that last worked there first, then the Secret's
    in its order, then keys that work on other replicas though the Secret no longer holds them (a vLLM engine
    reads its key at start: pods started before a rotation keep the old key; the engine decides)."""
    order = ([preferred] if preferred is not None else []) + list(keys) + list(fallbacks)
    skip = set(tried)
    return tuple(dict.fromkeys(k for k in order if k not in skip))
