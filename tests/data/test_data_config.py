"""Dataset YAML: the upstream files load unchanged; unknown keys, wrong types and bad overrides fail clearly."""

from __future__ import annotations

import pytest

from services.common.errors import DataError
from services.data.dataset_config import load_dataset_config


@pytest.mark.parametrize("name", ["deepscaler.yaml", "math_17k.yaml"])
def test_dataset_yamls_are_the_upstream_files(repo_root, shared_data, name):
    ours = repo_root / "configs" / "datasets" / name
    upstream = shared_data.parent / "reference" / "mindspeed_rl" / "configs" / "datasets" / name
    assert ours.read_bytes() == upstream.read_bytes()


def test_deepscaler_yaml_values(repo_root):
    cfg = load_dataset_config(repo_root / "configs/datasets/deepscaler.yaml")
    assert cfg.input == "./dataset/deepscaler.json"
    assert cfg.tokenizer_name_or_path == "./model_from_hf/qwen25-7b"
    assert cfg.output_prefix == "./dataset/data"
    assert cfg.handler_name == "R1AlpacaStyleInstructionHandler"
    assert cfg.tokenizer_type == "HuggingFaceTokenizer"
    assert (cfg.workers, cfg.log_interval, cfg.prompt_type) == (8, 1000, "qwen_r1")
    assert cfg.map_keys == {"prompt": "problem", "query": "", "response": "answer", "system": ""}
    assert cfg.dataset_additional_keys == ["labels"]


def test_math17k_yaml_values_and_overrides(repo_root):
    cfg = load_dataset_config(repo_root / "configs/datasets/math_17k.yaml",
                              ["input=/data/x.parquet", "workers=2", "seq_length=4096", "seed=7",
                               "prompt_type_path=/t.json"])
    assert cfg.handler_name == "Math17kAlpacaStyleInstructionHandler"
    assert cfg.prompt_type == "empty"
    assert cfg.map_keys == {"prompt": "prompt", "query": "", "response": "reward_model", "system": ""}
    assert (cfg.input, cfg.workers, cfg.seq_length, cfg.seed, cfg.prompt_type_path) == (
        "/data/x.parquet", 2, 4096, 7, "/t.json")


@pytest.mark.parametrize(("text", "overrides", "match"), [
    ("input: a\ntokenizer_name_or_path: t\noutput_prefix: o\nhandler_name: h\nworker: 2\n", [],
     "unknown key 'worker'; did you mean 'workers'"),
    ("input: a\ntokenizer_name_or_path: t\noutput_prefix: o\nhandler_name: h\nworkers: two\n", [],
     "key 'workers' must be int, got 'two'"),
    ("input: a\ntokenizer_name_or_path: t\noutput_prefix: o\n", [], r"missing required keys \['handler_name'\]"),
    ("input: a\ntokenizer_name_or_path: t\noutput_prefix: o\nhandler_name: h\ntokenizer_type: Sentencepiece\n", [],
     "tokenizer_type 'Sentencepiece' is not supported"),
    ("input: a\ntokenizer_name_or_path: t\noutput_prefix: o\nhandler_name: h\nmap_keys: {instruction: x}\n", [],
     r"map_keys has unknown slots \['instruction'\]"),
    ("input: a\ntokenizer_name_or_path: t\noutput_prefix: o\nhandler_name: h\n", ["workers=0"], "workers must be >= 1"),
    ("input: a\ntokenizer_name_or_path: t\noutput_prefix: o\nhandler_name: h\n", ["workers"], "must look like key=value"),
    ("input: [a\n", [], "not valid YAML"),
])
def test_bad_configs(tmp_path, text, overrides, match):
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(DataError, match=match):
        load_dataset_config(path, overrides)


def test_missing_config_file(tmp_path):
    with pytest.raises(DataError, match="dataset config .*none.yaml not found"):
        load_dataset_config(tmp_path / "none.yaml")
