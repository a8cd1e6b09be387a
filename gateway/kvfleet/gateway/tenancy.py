"""What a Tenant's `spec.gateway` asks of the gateway beyond its keys: limits and a fair-share weight (pure).

    spec:
      gateway:
        weight: 2                    # share of a saturated model's replicas against other tenants (default 1)
        limits:
          requestsPerMinute: 600     # requests admitted in any 60 s
          tokensPerMinute: 200000    # prompt + completion tokens (the engines' usage) in any 60 s
          maxConcurrentRequests: 32  # requests queued or in flight at once

Every limit is optional (absent: no limit). The CRD's schema holds each to >= 1; anything malformed
that still reaches the gateway (a static config, an older CRD) counts as absent, never as 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

LIMIT_FIELDS = {  # limit name (metrics, messages) -> the Tenant's field
    "requests_per_minute": "requestsPerMinute",
    "tokens_per_minute": "tokensPerMinute",
    "concurrent_requests": "maxConcurrentRequests",
}


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute,
                                            self.concurrent_requests))


@dataclass(frozen=True)
class TenantPolicy:
    weight: float = 1.0
    limits: Limits = Limits()


DEFAULT_POLICY = TenantPolicy()


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def tenant_policy(gateway: Mapping[str, Any] | None) -> TenantPolicy:
    """The policy from a Tenant's `spec.gateway` (or a static config's tenant entry, same field names)."""
    gateway = gateway or {}
    found = gateway.get("limits")
    raw: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    limits = Limits(**{name: _positive_int(raw.get(field)) for name, field in LIMIT_FIELDS.items()})
    weight = gateway.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        weight = 1
    return TenantPolicy(float(weight), limits)
