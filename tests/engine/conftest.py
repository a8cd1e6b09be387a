"""Fixtures shared by the engine modules that hold constrained outputs to transformers (module-scoped: each module
gets its own engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine import LLM


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path) -> Any:
    """transformers on the tiny model's weights, float32: the reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tiny(request: pytest.FixtureRequest, tiny_model_dir: Path) -> LLM:
    """The offline engine on the same folder, with synchronous and with async scheduling."""
    return LLM(str(tiny_model_dir), num_kv_blocks=96, max_num_batched_tokens=64, async_scheduling=request.param)
