"""Errors the operator reports as conditions and Events instead of crashing."""
from __future__ import annotations


class SpecError(ValueError):
    """A spec the apiserver accepted but the operator cannot use; names the field."""

    def __init__(self, field: str, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = reason
        self.message = f"{field}: {message}"
