"""API keys -> tenant.

A Tenant names Secrets (`spec.gateway.apiKeySecrets`, in the gateway's key namespace); every data entry
of such a Secret is one API key of the tenant, so a key rotates without a restart: add the new entry,
move the clients, delete the old one (the gateway watches the Secrets).

The table keeps only SHA-256 digests, never the keys: a key is looked up by the digest of what the
client sent. The only comparisons that touch a stored secret are between SHA-256 digests, so their
timing says nothing usable about any key (a key from its digest is a preimage search): the lookup is
constant time in what matters, and O(1) in the number of keys (a loop of `hmac.compare_digest` over
every key, as the engine's own small key file does, would be O(n) per request). Keys never appear in
logs, errors or metrics: problems name the Secret and the entry, never the value.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Mapping

MIN_KEY_LENGTH = 16


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class SecretRef:
    """A Secret a Tenant references for its keys."""

    namespace: str
    name: str


@dataclass(frozen=True)
class KeyTable:
    """digest -> tenant; built by `build_key_table`."""

    by_digest: Mapping[bytes, str] = field(default_factory=dict)

    def tenant_for(self, token: str | None) -> str | None:
        """The tenant of `token`, or None. Time depends only on the token's length (the SHA-256) and on
        digests (the lookup), never on how much of a stored key the token matches."""
        if not token:
            return None
        return self.by_digest.get(key_digest(token))

    def per_tenant(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tenant in self.by_digest.values():
            counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self.by_digest)


def secret_keys(data: Mapping[str, str] | None, where: str) -> tuple[list[str], list[str]]:
    """(keys, problems) from a Secret's base64 `data`: each entry is one key; bad entries are named."""
    keys: list[str] = []
    problems: list[str] = []
    for entry, encoded in sorted((data or {}).items()):
        try:
            value = base64.b64decode(encoded, validate=True).decode("utf-8").strip()
        except (binascii.Error, ValueError):
            problems.append(f"{where}: entry {entry!r} is not base64 of UTF-8 text; ignored")
            continue
        if len(value) < MIN_KEY_LENGTH:
            problems.append(f"{where}: entry {entry!r} is shorter than {MIN_KEY_LENGTH} characters; ignored")
            continue
        keys.append(value)
    return keys, problems


def build_key_table(refs: Mapping[str, Iterable[SecretRef]],
                    secrets: Mapping[SecretRef, Mapping[str, str] | None]) -> tuple[KeyTable, list[str]]:
    """The key table for `refs` (tenant -> the Secrets it names) from the Secrets' `data`.

    A key found for two tenants (the same value, or one Secret named by both) is ambiguous and is
    dropped for both; a missing Secret is a problem, not an error: the tenant has the keys it has.
    """
    owners: dict[bytes, set[str]] = {}
    problems: list[str] = []
    for tenant, tenant_refs in sorted(refs.items()):
        for ref in tenant_refs:
            where = f"tenant {tenant}: Secret {ref.namespace}/{ref.name}"
            if ref not in secrets:
                problems.append(f"{where} not found")
                continue
            keys, bad = secret_keys(secrets[ref], where)
            problems += bad
            for key in keys:
                owners.setdefault(key_digest(key), set()).add(tenant)
    table: dict[bytes, str] = {}
    clashes: dict[tuple[str, ...], int] = {}
    for digest, tenants in owners.items():
        if len(tenants) == 1:
            table[digest] = next(iter(tenants))
        else:
            names = tuple(sorted(tenants))
            clashes[names] = clashes.get(names, 0) + 1
    for names, n in sorted(clashes.items()):
        problems.append(f"{n} key(s) shared by tenants {', '.join(names)}: refused for all of them")
    return KeyTable(table), problems
