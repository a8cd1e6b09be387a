"""What the gateway knows of the cluster at one moment: immutable, swapped whole when anything changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from kvfleet.gateway.catalog import Catalog
from kvfleet.gateway.keys import KeyTable
from kvfleet.gateway.replicas import Replica


@dataclass(frozen=True)
class Snapshot:
    keys: KeyTable = field(default_factory=KeyTable)
    catalog: Catalog = field(default_factory=Catalog)
    replicas: Mapping[str, tuple[Replica, ...]] = field(default_factory=dict)  # model key -> ready replicas
    problems: tuple[str, ...] = ()  # what could not be used (missing Secrets, ambiguous keys), for the log

    def ready_replicas(self, model_key: str) -> tuple[Replica, ...]:
        return self.replicas.get(model_key, ())
