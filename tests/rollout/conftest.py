"""Rollout fixtures: the transformers reference model. The engine, server and stub are the session's own
(tests/conftest.py), shared with tests/weight_sync."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.eval()
    return model
