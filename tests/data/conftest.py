"""Fixtures for the data tests: the tiny tokenizer, the real input files, and one preprocessed DeepScaleR."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_support import R1_FRAME_HEAD, R1_FRAME_TAIL, deepscaler_config


@pytest.fixture(scope="session")
def qwen_r1_prompt():
    """The exact qwen_r1 prompt text for a problem, written out independently of the template code."""
    return lambda problem: R1_FRAME_HEAD + problem + R1_FRAME_TAIL


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def decode(tiny_tokenizer):
    """Exact text of token ids under the tiny tokenizer: special tokens kept, no whitespace clean-up."""

    def _decode(ids) -> str:
        return tiny_tokenizer.decode([int(i) for i in ids], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    return _decode


@pytest.fixture(scope="session")
def deepscaler_prefix(shared_data: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 803-row DeepScaleR file preprocessed once with deepscaler.yaml's settings."""
    from services.data.preprocess import preprocess

    prefix = tmp_path_factory.mktemp("deepscaler") / "data"
    summary = preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix))
    assert summary.rows_written == 803
    return prefix
