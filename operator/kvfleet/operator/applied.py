"""Skipping server-side applies that would change nothing.

A server-side apply costs the apiserver a decode, a merge of managed fields and a comparison even when nothing
changes, and it was most of what a reconcile wrote. An object we build carries the hash of what we built
(`ANNOTATION_HASH`); when the live object has that hash *and* still holds every field we set with our values
(`covers`: nobody changed or removed them since), applying again is a no-op and is skipped. A changed spec changes
the hash (so fields we stop setting are dropped by the apply, as before), and an edit by someone else fails
`covers` (so we put our values back, as before).
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from .constants import GROUP

ANNOTATION_HASH = f"{GROUP}/applied-hash"


def covers(live: Any, desired: Any) -> bool:
    """Every field of `desired` is in `live` with the same value (dicts by key, lists item by item); what the
    apiserver or others added to `live` does not matter."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(k in live and covers(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(
            covers(a, b) for a, b in zip(live, desired, strict=True))
    return bool(live == desired and type(live) is type(desired))


def with_hash(obj: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` with the hash of its content in an annotation."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]
    meta = dict(obj["metadata"])
    meta["annotations"] = {**(meta.get("annotations") or {}), ANNOTATION_HASH: digest}
    return {**obj, "metadata": meta}


def unchanged(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """True when applying `desired` (built by `with_hash`) onto `live` would change nothing. `live` may be an
    item of a list, which carries no apiVersion and kind."""
    if live is None:
        return False
    want = (desired["metadata"].get("annotations") or {}).get(ANNOTATION_HASH)
    have = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_HASH)
    content = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    return want is not None and want == have and covers(live, content)


@dataclass(frozen=True)
class ApplyTicket:
    """Leave to record `key` as applied, valid only if nothing was forgotten since it was handed out."""
    key: tuple[str, ...]
    epoch: int


class AppliedOnce:
    """Objects this process applied and whose content cannot change (a ModelDeployment's Service: built from its
    name and uid only): applied once, again only after `forget` (the object was deleted or edited).

    An edit can land while a pass applies: the pass applied the object as it was, the edit's event forgets it,
    and the pass must not then record it as applied (the next pass would skip the repair). So `needed` hands out a
    ticket and `done` records it only when no `forget` came in between; the epoch is shared by all keys (a stale
    ticket costs one more no-op apply, and nothing grows with the objects ever forgotten)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[tuple[str, ...]] = set()
        self._epoch = 0  # forgets so far

    def needed(self, key: tuple[str, ...]) -> ApplyTicket | None:
        """None when `key` was applied already; else the ticket `done` takes once it is."""
        with self._lock:
            return None if key in self._done else ApplyTicket(key, self._epoch)

    def done(self, ticket: ApplyTicket) -> None:
        with self._lock:
            if ticket.epoch == self._epoch:
                self._done.add(ticket.key)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._epoch += 1
            self._done = {k for k in self._done if k[:2] != (namespace, name)}
