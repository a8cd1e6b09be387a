"""Constants and small helpers of the gateway tests (imported by path, like the other test helpers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KEY_A, KEY_B = "team-a-key-0123456789", "team-b-key-0123456789"


def write_config(path: Path, tenants: dict[str, Any]) -> Path:
    """A static gateway config (`kvfleet gateway --config`)."""
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path
