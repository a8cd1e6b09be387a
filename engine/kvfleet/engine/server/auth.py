"""Tenant API keys: `Authorization: Bearer KEY` -> tenant name.

Keys are compared with `hmac.compare_digest` against every configured key (no early
exit on a match, so timing does not tell how many keys exist or which matched), and
they never appear in logs or error messages.

`--api-keys-file` is read again when it changes (checked at most once a second, on the
request path): a Kubernetes Secret mounted as a volume is rewritten in place when it is
rotated, so keys rotate without a restart. A file that no longer reads or parses keeps the
last good table (logged, naming the problem, never a key).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

DEFAULT_TENANT = "default"
RELOAD_CHECK_S = 1.0

logger = logging.getLogger("kvfleet.server")


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


def _file_stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()   # follows the symlinks a Secret volume swaps on an update
    return st.st_mtime_ns, st.st_size, st.st_ino


def _read_key_file(path: Path) -> tuple[dict[str, str], tuple[int, int, int]]:
    try:
        stamp = _file_stamp(path)
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyFileError(f"--api-keys-file {path}: cannot read ({exc.strerror})") from None
    return parse_keys(text, f"--api-keys-file {path}"), stamp


@dataclass
class ApiKeys:
    """The server's key table: fixed (`--api-key`), or `--api-keys-file`'s, read again when the file changes."""

    keys: dict[str, str]
    path: Path | None = None
    check_interval_s: float = RELOAD_CHECK_S
    _stamp: tuple[int, int, int] | None = field(default=None, repr=False)
    _checked: float = field(default=0.0, repr=False)
    _problem: str | None = field(default=None, repr=False)   # the last one logged: logged once, not every second

    @classmethod
    def from_file(cls, path: Path, check_interval_s: float = RELOAD_CHECK_S) -> "ApiKeys":
        keys, stamp = _read_key_file(path)
        return cls(keys, path, check_interval_s, stamp, time.monotonic())

    def tenant_for(self, token: str | None, now: float | None = None) -> str | None:
        if self.path is not None:
            self.refresh(time.monotonic() if now is None else now)
        return tenant_for(token, self.keys)

    def refresh(self, now: float) -> None:
        """Read the file again if it changed since the last look (at most once per `check_interval_s`)."""
        assert self.path is not None
        if now - self._checked < self.check_interval_s:
            return
        self._checked = now
        try:
            if _file_stamp(self.path) == self._stamp:
                return
            keys, stamp = _read_key_file(self.path)
        except (OSError, KeyFileError) as exc:
            problem = exc.strerror if isinstance(exc, OSError) else str(exc)
            if problem != self._problem:
                logger.warning("API keys not reloaded, the last good table stays", extra={"problem": problem})
                self._problem = problem
            return
        self.keys, self._stamp, self._problem = keys, stamp, None
        logger.info("API keys reloaded", extra={"keys": len(keys), "tenants": len(set(keys.values()))})


def load_keys(api_key: str | None, api_keys_file: str | None) -> ApiKeys | None:
    """The key table from the flags; None means the server is open (no auth)."""
    if api_keys_file:
        return ApiKeys.from_file(Path(api_keys_file))
    if api_key:
        return ApiKeys({api_key: DEFAULT_TENANT})
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
