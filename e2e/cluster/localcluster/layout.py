"""Where the local cluster keeps its files, which loopback ports and addresses it uses, and the pinned versions.

Everything is derived from the checkout's path, so two checkouts on one machine (a developer's and CI's fresh clone)
get different ports and pod networks and never trip over each other. All addresses are inside 127.0.0.0/8.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CLUSTER_DIR = Path(__file__).resolve().parents[1]

# Offsets from the port base, one per listener.
_PORT_OFFSETS = {
    "etcd_client": 1,
    "etcd_peer": 2,
    "apiserver": 3,
    "controller_manager": 4,
    "scheduler": 5,
    "kwok": 6,
    "kueue_health": 7,
    "kueue_metrics": 8,
    "kueue_webhook": 9,
    "engine_kubelet": 10,
}
PORT_NAMES = tuple(_PORT_OFFSETS)
LAST_PORT_OFFSET = max(_PORT_OFFSETS.values())


def parse_env_file(text: str) -> dict[str, str]:
    """Parses KEY=VALUE lines (comments and blank lines skipped), as versions.env is written."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"versions.env line {number}: expected KEY=VALUE, got {raw!r}")
        values[key.strip()] = value.strip().strip('"')
    return values


def checkout_index(root: Path) -> int:
    """A stable number 0..89 for a checkout path: picks its port block and pod network."""
    digest = hashlib.sha256(str(root.resolve()).encode()).digest()
    return int.from_bytes(digest[:4], "big") % 90


PORT_BASE_FILE = ".cluster/port-base"


def block_base(index: int) -> int:
    """First port of block `index` (0..89): 20000, 20100, ... 28900."""
    return 20000 + 100 * (index % 90)


def port_base(root: Path, env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """First port of the checkout's block of 100: KVFLEET_CLUSTER_PORT_BASE, else the block the last cluster-up
    chose (.cluster/port-base), else the block the checkout's path hashes to."""
    override = env.get("KVFLEET_CLUSTER_PORT_BASE")
    if override:
        if not override.isdigit() or not 1024 <= int(override) <= 65000:
            raise ValueError(f"KVFLEET_CLUSTER_PORT_BASE must be a port number 1024-65000, got {override!r}")
        return int(override)
    chosen = root / PORT_BASE_FILE
    if chosen.exists():
        text = chosen.read_text().strip()
        if text.isdigit() and 1024 <= int(text) <= 65000:
            return int(text)
    return block_base(checkout_index(root))


@dataclass(frozen=True)
class Layout:
    """Paths, ports and addresses of one checkout's cluster."""

    root: Path
    base: int

    @classmethod
    def for_checkout(cls, root: Path = ROOT) -> "Layout":
        return cls(root=root, base=port_base(root))

    def with_base(self, base: int) -> "Layout":
        return Layout(root=self.root, base=base)

    @property
    def index(self) -> int:
        """0..89, from the port block: picks the loopback pod network, so it moves with the ports."""
        return ((self.base - 20000) // 100) % 90

    # --- files -----------------------------------------------------------------------------------------------
    @property
    def state(self) -> Path:
        return self.root / ".cluster"

    @property
    def bin(self) -> Path:
        return self.state / "bin"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def pki(self) -> Path:
        return self.state / "pki"

    @property
    def run(self) -> Path:
        """Pid files and the components' generated configuration."""
        return self.state / "run"

    @property
    def etcd_data(self) -> Path:
        return self.state / "etcd"

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def engine_records(self) -> Path:
        """The engine kubelet's record of each engine process it runs (pid, command), one JSON file per pod."""
        return self.run / "engines"

    @property
    def engine_logs(self) -> Path:
        """One log per engine pod, `<namespace>.<pod>.log` (kept after `down`, like the other logs)."""
        return self.logs / "engines"

    def binary(self, name: str) -> Path:
        return self.bin / name

    # --- network ---------------------------------------------------------------------------------------------
    def port(self, name: str) -> int:
        return self.base + _PORT_OFFSETS[name]

    @property
    def apiserver_url(self) -> str:
        return f"https://127.0.0.1:{self.port('apiserver')}"

    @property
    def pod_cidr(self) -> str:
        """kwok hands out pod IPs from here: loopback addresses where a test can bind a real process."""
        return f"127.{100 + self.index}.0.0/17"

    def node_ip(self, number: int) -> str:
        """The InternalIP of fake node `number` (outside the pod range, inside the same /16)."""
        if not 0 <= number < 250:
            raise ValueError(f"node number must be 0-249, got {number}")
        return f"127.{100 + self.index}.255.{number + 1}"

    @property
    def kwok_node_ip(self) -> str:
        """kwok's own --node-ip (used for host-network pods on nodes without an InternalIP)."""
        return f"127.{100 + self.index}.254.1"


def versions(path: Path = CLUSTER_DIR / "versions.env") -> dict[str, str]:
    """The pinned versions from versions.env."""
    return parse_env_file(path.read_text())
