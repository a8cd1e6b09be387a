"""The autoscaler's tick when the apiserver cannot be read (restarting, overloaded): a kopf.TemporaryError retried at
the next interval (one log line), never an unhandled exception (a traceback, and kopf backs a failed timer off for
a minute)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import kopf
import pytest

from kvfleet.operator import handlers as operator_handlers
from kvfleet.operator.autoscaler import handlers as autoscaler_handlers
from kvfleet.operator.kube import KubeError


class FailingKube:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def get(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc


@pytest.mark.parametrize("exc", [httpx.ConnectError("[Errno 111] Connection refused"),
                                 KubeError(503, "the apiserver is shutting down")])
def test_an_unreadable_apiserver_is_retried_at_the_next_tick(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    monkeypatch.setattr(operator_handlers, "kube", lambda: FailingKube(exc))
    with pytest.raises(kopf.TemporaryError) as info:
        asyncio.run(autoscaler_handlers._tick("team-a", "chat"))
    assert info.value.delay == autoscaler_handlers.SETTINGS.interval
    assert "team-a/chat" in str(info.value)
