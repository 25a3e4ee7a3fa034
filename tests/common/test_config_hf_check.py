"""The model block checked against the Hugging Face config.json the services load (config check, rlfabric up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigError, check_model_files, load_config
from services.common.config.hf_check import megatron_padded_vocab_size

TINY = ("configs/grpo_tiny_cpu.yaml",)


def _model_dir(tmp_path: Path, tiny_model_dir: Path, **changes) -> Path:
    """A folder holding the tiny model's config.json with `changes` applied (the check reads nothing else)."""
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    raw.update(changes)
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    return out


def _tiny(repo_root: Path, model: Path, *overrides: str):
    return load_config(repo_root / TINY[0], overrides=[f"megatron_training.tokenizer_name_or_path={model}",
                                                       f"actor_config.load={model}", *overrides])


def test_megatron_pads_to_a_multiple_of_divisible_by_times_tp():
    assert megatron_padded_vocab_size(151665, 128, 1) == 151680
    assert megatron_padded_vocab_size(151936, 128, 2) == 152064
    assert megatron_padded_vocab_size(4096, 1, 1) == 4096


def test_the_tiny_block_matches_the_tiny_model(repo_root: Path, tiny_model_dir: Path):
    cfg = _tiny(repo_root, tiny_model_dir)
    assert check_model_files(cfg) == [tiny_model_dir]


def test_a_4096_vocab_block_is_refused_against_a_smaller_model(repo_root: Path, tiny_model_dir: Path, tmp_path: Path):
    model = _model_dir(tmp_path, tiny_model_dir, vocab_size=1024, num_hidden_layers=3, num_key_value_heads=4,
                       tie_word_embeddings=False)
    with pytest.raises(ConfigError) as exc:
        check_model_files(_tiny(repo_root, model))
    issues = {i.key: i.message for i in exc.value.issues}
    assert set(issues) == {"model.tiny_qwen2.padded_vocab_size", "model.tiny_qwen2.num_layers",
                           "model.tiny_qwen2.num_query_groups", "model.tiny_qwen2.untie_embeddings_and_output_weights"}
    assert "`model.tiny_qwen2.padded_vocab_size` is 4096 but" in issues["model.tiny_qwen2.padded_vocab_size"]
    assert "has vocab_size: 1024" in issues["model.tiny_qwen2.padded_vocab_size"]
    assert "is 2 but" in issues["model.tiny_qwen2.num_layers"] and "num_hidden_layers: 3" in issues[
        "model.tiny_qwen2.num_layers"]
    assert "num_key_value_heads: 4" in issues["model.tiny_qwen2.num_query_groups"]


@pytest.mark.parametrize(("override", "key", "needle"), [
    ("model.tiny_qwen2.hidden_size=256", "hidden_size", "hidden_size: 128"),
    ("model.tiny_qwen2.ffn_hidden_size=1024", "ffn_hidden_size", "intermediate_size: 512"),
    ("model.tiny_qwen2.num_attention_heads=8", "num_attention_heads", "num_attention_heads: 4"),
    ("model.tiny_qwen2.max_position_embeddings=4096", "max_position_embeddings", "max_position_embeddings: 2048"),
    ("model.tiny_qwen2.rotary_base=1000000", "rotary_base", "rope_theta: 10000.0"),
    ("model.tiny_qwen2.qk_layernorm=true", "qk_layernorm", "q/k norm"),
    ("model.tiny_qwen2.kv_channels=64", "kv_channels", "head_dim: 32"),
])
def test_each_architecture_key_is_compared(repo_root: Path, tiny_model_dir: Path, override: str, key: str, needle: str):
    overrides = [override, "generate_config.infer_tensor_parallel_size=1"]
    with pytest.raises(ConfigError) as exc:
        check_model_files(_tiny(repo_root, tiny_model_dir, *overrides))
    assert [i.key for i in exc.value.issues] == [f"model.tiny_qwen2.{key}"]
    assert needle in exc.value.issues[0].message


def test_unpadded_vocab_follows_megatron_padding(repo_root: Path, tiny_model_dir: Path, tmp_path: Path):
    model = _model_dir(tmp_path, tiny_model_dir, vocab_size=4000)
    cfg = _tiny(repo_root, model, "model.tiny_qwen2.padded_vocab_size=null",
                "model.tiny_qwen2.make_vocab_size_divisible_by=128")
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by` is 128, which pads the vocabulary to 4096"):
        check_model_files(cfg)
    cfg = _tiny(repo_root, model, "model.tiny_qwen2.padded_vocab_size=null",
                "model.tiny_qwen2.make_vocab_size_divisible_by=1")
    assert check_model_files(cfg) == [model]


def test_no_model_folder_means_nothing_to_check(repo_root: Path, tmp_path: Path):
    absent = tmp_path / "absent"
    cfg = load_config(repo_root / TINY[0], overrides=[f"megatron_training.tokenizer_name_or_path={absent}",
                                                      f"actor_config.load={absent}"])
    assert check_model_files(cfg) == []


def _rlfabric(repo_root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(repo_root), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=repo_root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_config_check_and_up_refuse_a_mismatching_model(repo_root: Path, tiny_model_dir: Path, tmp_path: Path):
    model = _model_dir(tmp_path, tiny_model_dir, vocab_size=1024)
    args = ("-o", f"megatron_training.tokenizer_name_or_path={model}")
    check = _rlfabric(repo_root, "config", "check", TINY[0], *args)
    assert check.returncode == 2 and "model.tiny_qwen2.padded_vocab_size` is 4096" in check.stderr
    run_dir = tmp_path / "run"
    up = _rlfabric(repo_root, "up", TINY[0], *args, "--run-dir", str(run_dir))
    assert up.returncode == 2 and "model.tiny_qwen2.padded_vocab_size` is 4096" in up.stderr
    assert not run_dir.exists()  # refused before any service (or Redis) started
    ok = _rlfabric(repo_root, "config", "check", TINY[0], "-o", f"megatron_training.tokenizer_name_or_path={tiny_model_dir}")
    assert ok.returncode == 0 and f"model block checked against {tiny_model_dir}/config.json: it matches" in ok.stdout
