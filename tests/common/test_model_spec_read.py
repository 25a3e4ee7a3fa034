"""`read_config_json`: the one reader of a Hugging Face folder's config.json, whose refusals name the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import DataError
from services.common.model_spec import read_config_json


def test_reads_the_config_as_written(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 512}')
    assert read_config_json(tmp_path) == {"model_type": "qwen2", "max_position_embeddings": 512}
    assert read_config_json(str(tmp_path))["model_type"] == "qwen2"


@pytest.mark.parametrize(("text", "says"), [
    (None, "no config.json"),
    ('{"model_type": ', "cannot read it as JSON"),
    ("[1, 2]", "is a JSON object, not list"),
])
def test_a_config_that_is_not_there_or_not_an_object_is_a_data_error_naming_the_file(
        tmp_path: Path, text: str | None, says: str) -> None:
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(DataError, match=says) as refused:
        read_config_json(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / 'config.json'}: ")
