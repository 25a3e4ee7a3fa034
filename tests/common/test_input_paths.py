"""Every file a run reads is checked before a launcher starts anything (services/common/config/input_paths.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigError, check_run_files, load_config
from services.common.config.input_paths import TINY_ASSETS_COMMAND, missing_input_paths

TINY = "configs/grpo_tiny_cpu.yaml"


def _paths(model: Path, data: Path) -> list[str]:
    return [f"megatron_training.tokenizer_name_or_path={model}", f"actor_config.load={model}",
            f"megatron_training.data_path={data}"]


def test_missing_paths_are_named_with_their_keys_and_what_makes_them(repo_root: Path, tmp_path: Path) -> None:
    cfg = load_config(repo_root / TINY, overrides=_paths(tmp_path / "model", tmp_path / "data" / "arith"))
    issues = {i.key: i for i in missing_input_paths(cfg)}
    assert set(issues) == {"megatron_training.tokenizer_name_or_path", "megatron_training.data_path"}
    assert f"no folder {tmp_path / 'model'}" in issues["megatron_training.tokenizer_name_or_path"].message
    data = issues["megatron_training.data_path"]
    assert f"{tmp_path}/data/arith_packed_input_ids_document.idx" in data.message and "rlfabric preprocess" in data.message
    assert data.source == f"--override megatron_training.data_path={tmp_path / 'data' / 'arith'}"


def test_the_default_config_points_at_the_tiny_assets_command(repo_root: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a fresh clone: runs/tiny_cpu does not exist here
    issues = missing_input_paths(load_config(repo_root / TINY))
    assert len(issues) == 2 and all(TINY_ASSETS_COMMAND in i.message for i in issues)
    assert {i.source.rsplit(":", 1)[0] for i in issues} == {str(repo_root / TINY)}


def test_present_paths_pass(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path) -> None:
    cfg = load_config(repo_root / TINY, overrides=_paths(tiny_model_dir, arith_prefix))
    assert check_run_files(cfg) == [tiny_model_dir]


def test_system_up_names_every_missing_path_before_starting_anything(repo_root: Path, tmp_path: Path) -> None:
    args = [a for o in _paths(tmp_path / "model", tmp_path / "data") for a in ("-o", o)]
    up = subprocess.run([sys.executable, "-m", "services.cli", "system", "up", TINY, *args, "--dir",
                         str(tmp_path / "system")], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert up.returncode == 2, up.stderr
    assert "2 configuration errors" in up.stderr and "megatron_training.data_path" in up.stderr
    assert not (tmp_path / "system").exists()
    with pytest.raises(ConfigError):
        check_run_files(load_config(repo_root / TINY, overrides=_paths(tmp_path / "model", tmp_path / "data")))


def test_validation_data_is_checked_only_when_validation_runs(repo_root: Path, tiny_model_dir: Path,
                                                             arith_prefix: Path, tmp_path: Path) -> None:
    paths = [*_paths(tiny_model_dir, arith_prefix), f"rlfabric.val_data_path={tmp_path / 'heldout'}"]
    assert missing_input_paths(load_config(repo_root / TINY, overrides=paths)) == []
    (issue,) = missing_input_paths(load_config(repo_root / TINY, overrides=[*paths, "rlfabric.val_interval=5"]))
    assert issue.key == "rlfabric.val_data_path" and str(tmp_path / "heldout") in issue.message


SEVEN_B = "configs/grpo_qwen25_7b_A3.yaml"


def test_the_7b_configs_missing_inputs_name_the_quick_starts_commands(repo_root: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(repo_root)  # the quick start's root: ./Qwen2.5-7B, ./ckpt and ./dataset are not in the repo
    issues = {i.key: i.message for i in missing_input_paths(load_config(SEVEN_B))}
    assert issues == {
        "megatron_training.tokenizer_name_or_path": "no folder ./Qwen2.5-7B; put the Hugging Face model folder there "
                                                    "(config.json, tokenizer files, *.safetensors)",
        "actor_config.load": "no folder ./ckpt; convert the Hugging Face model with `rlfabric convert hf2mcore --tp 2 "
                             "--pp 2 ./Qwen2.5-7B ./ckpt` (or point it at a Hugging Face model folder)",
        "megatron_training.data_path": "no preprocessed dataset at ./dataset/deepscaler/data (missing "
                                       "dataset/deepscaler/data_packed_input_ids_document.idx, "
                                       "dataset/deepscaler/data_packed_input_ids_document.bin); run `bash "
                                       "examples/data/preprocess_data.sh deepscaler` from the repository root"}


def _check(repo_root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "config", "check", *args], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)


def test_config_check_lists_missing_inputs_and_fails_on_them_only_when_asked(repo_root: Path) -> None:
    listed = _check(repo_root, SEVEN_B)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    start = lines.index("input paths not here (3; `rlfabric up` stops on them, --require-files fails on them):")
    assert [line.split(": ")[1] for line in lines[start + 1:start + 4]] == [
        "megatron_training.tokenizer_name_or_path", "actor_config.load", "megatron_training.data_path"]
    assert lines[-1].startswith("OK: ")  # the verdict stays last
    doc = json.loads(_check(repo_root, SEVEN_B, "--json").stdout)
    assert [i["key"] for i in doc["missing_inputs"]] == ["megatron_training.tokenizer_name_or_path",
                                                          "actor_config.load", "megatron_training.data_path"]
    required = _check(repo_root, SEVEN_B, "--require-files")
    assert required.returncode == 2 and required.stdout == ""
    assert required.stderr.startswith(f"error: 3 configuration errors in {SEVEN_B}:")
    assert "run `bash examples/data/preprocess_data.sh deepscaler`" in required.stderr


def test_config_check_says_when_every_input_is_here(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path) -> None:
    args = [a for o in _paths(tiny_model_dir, arith_prefix) for a in ("-o", o)]
    out = _check(repo_root, TINY, *args, "--require-files")
    assert out.returncode == 0, out.stderr
    assert "input paths: every folder and dataset the run reads is here" in out.stdout
