"""Tenant API keys: `Authorization: Bearer KEY` -> tenant name.

Keys are compared with `hmac.compare_digest` against every configured key (no early
exit on a match, so timing does not tell how many keys exist or which matched), and
they never appear in logs or error messages.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Mapping

import yaml

DEFAULT_TENANT = "default"


class KeyFileError(ValueError):
    pass


def parse_keys(text: str, source: str) -> dict[str, str]:
    """Parse a YAML or JSON mapping `key: tenant`; raises KeyFileError naming what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise KeyFileError(f"{source}: neither JSON nor YAML ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or not data:
        raise KeyFileError(f"{source}: expected a non-empty mapping of API key to tenant name")
    keys: dict[str, str] = {}
    for i, (key, tenant) in enumerate(data.items()):
        # Never echo the key itself: say which entry, by position.
        if not isinstance(key, str) or not key.strip():
            raise KeyFileError(f"{source}: entry {i + 1}: the key must be a non-empty string")
        if not isinstance(tenant, str) or not tenant.strip():
            raise KeyFileError(f"{source}: entry {i + 1}: the tenant name must be a non-empty string")
        keys[key.strip()] = tenant.strip()
    return keys


def load_keys(api_key: str | None, api_keys_file: str | None) -> dict[str, str] | None:
    """The key table from the flags; None means the server is open (no auth)."""
    if api_keys_file:
        path = Path(api_keys_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise KeyFileError(f"--api-keys-file {path}: cannot read ({exc.strerror})") from None
        return parse_keys(text, f"--api-keys-file {path}")
    if api_key:
        return {api_key: DEFAULT_TENANT}
    return None


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def tenant_for(token: str | None, keys: Mapping[str, str]) -> str | None:
    """The tenant of `token`, or None; constant time in the position of the matching key."""
    if token is None:
        return None
    given = token.encode()
    found: str | None = None
    for key, tenant in keys.items():
        if hmac.compare_digest(given, key.encode()):
            found = tenant
    return found
