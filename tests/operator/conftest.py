"""Fixtures of the operator unit tests."""
from __future__ import annotations

import pytest

from kvfleet.operator.config import OperatorConfig


@pytest.fixture
def op_config() -> OperatorConfig:
    return OperatorConfig()
