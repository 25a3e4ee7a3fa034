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


BASE = "input: a\ntokenizer_name_or_path: t\noutput_prefix: o\nhandler_name: h\n"


@pytest.mark.parametrize(("text", "overrides", "match"), [
    (BASE + "worker: 2\n", [], "d.yaml:5: dataset.worker: unknown key `worker` in section `dataset`; "
                                "did you mean `workers`?"),
    (BASE + "workers: two\n", [], "d.yaml:5: dataset.workers: `workers` in section `dataset` must be integer, "
                                   "got 'two' (str)"),
    ("input: a\ntokenizer_name_or_path: t\noutput_prefix: o\n", [], r"missing required keys ['handler_name']"),
    (BASE + "tokenizer_type: Sentencepiece\n", [],
     "d.yaml:5: dataset.tokenizer_type: tokenizer_type 'Sentencepiece' is not supported"),
    (BASE + "map_keys: {instruction: x}\n", [], "d.yaml:5: dataset.map_keys: map_keys has unknown slots ['instruction']"),
    (BASE + "map_keys: {prompt: [x]}\n", [], "map_keys values must be field names"),
    (BASE, ["workers=0"], "--set workers=0: dataset.workers: workers must be >= 1"),
    (BASE, ["workers"], "--set workers: workers: override 'workers' must look like key=value"),
    (BASE, ["wrkers=3"], "--set wrkers=3: dataset.wrkers: unknown key `wrkers` in section `dataset`; did you mean"),
    (BASE + "workers: 2\nworkers: 3\n", [], "d.yaml:6: workers: duplicate key `workers` (first set at d.yaml:5)"),
    ("input: [a\n", [], "d.yaml:1: YAML syntax error"),  # the unclosed bracket's line, not the stream end
    ("- input\n", [], "a dataset config must be a mapping of keys, got list"),
])
def test_bad_configs(tmp_path, text, overrides, match):
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(DataError) as info:
        load_dataset_config(path, overrides)
    assert match.replace("d.yaml", str(path)) in str(info.value)


def test_every_problem_is_reported_at_once(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("input: a\nworker: 2\nlog_interval: x\n")
    with pytest.raises(DataError) as info:
        load_dataset_config(path)
    message = str(info.value)
    assert message.startswith(f"3 configuration errors in {path}:")
    assert f"{path}:2: dataset.worker: unknown key" in message and f"{path}:3: dataset.log_interval:" in message
    assert "missing required keys ['tokenizer_name_or_path', 'output_prefix', 'handler_name']" in message


def test_dashes_read_as_underscores_as_upstream(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(BASE + "log-interval: 7\n")
    assert load_dataset_config(path).log_interval == 7


def test_missing_config_file(tmp_path):
    with pytest.raises(DataError, match="none.yaml: dataset config not found"):
        load_dataset_config(tmp_path / "none.yaml")


def test_every_dataset_key_has_a_true_status(repo_root):
    import ast
    import dataclasses

    from services.common.config.schema import INERT, READ, REFUSED, field_status
    from services.data.dataset_config import DatasetConfig

    for f in dataclasses.fields(DatasetConfig):
        status = field_status(f)
        assert status is not None and status.kind in (READ, REFUSED, INERT), f.name
        for module in status.modules:  # a READ key is read where it says (an attribute access in the code)
            tree = ast.parse((repo_root / module).read_text())
            assert f.name in {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}, (f.name, module)
