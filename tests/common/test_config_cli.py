"""`rlfabric config check` / `config keys` through the real CLI entry point, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _rlfabric(repo_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=repo_root, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def misspelled_7b(repo_root: Path, tmp_path: Path) -> Path:
    """The shipped 7B config with `clip_ratio` misspelled, beside a copy of its model file."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "qwen25_7b.yaml").write_text((repo_root / "configs/model/qwen25_7b.yaml").read_text())
    text = (repo_root / "configs/grpo_qwen25_7b_A3.yaml").read_text()
    assert "  clip_ratio: 0.2\n" in text
    path = tmp_path / "grpo_misspelled.yaml"
    path.write_text(text.replace("  clip_ratio: 0.2\n", "  clip_ration: 0.2\n"))
    return path


def test_check_upstream_7b_prints_sections_then_derived(repo_root: Path):
    out = _rlfabric(repo_root, "config", "check", "configs/grpo_qwen25_7b_A3.yaml", "--full")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    positions = [text.index(f"\n{section}:") for section in
                 ("model", "megatron_training", "actor_config", "ref_config", "rl_config", "generate_config",
                  "profiler_config", "msprobe_config", "derived")]
    assert positions == sorted(positions)
    assert "  actor_data_parallel_size: 4\n" in text
    assert "  clip_ratio: 0.2\n" in text and "  verifier_function: [math_17k_acc]\n" in text
    assert "OK: actor DP = 4 (16 devices / TP 2 x PP 2 x CP 1), rollout DP = 16" in text
    assert out.stderr == ""


def test_check_misspelled_key_exits_nonzero_naming_key_section_and_fix(repo_root: Path, misspelled_7b: Path):
    out = _rlfabric(repo_root, "config", "check", str(misspelled_7b))
    assert out.returncode == 2
    assert out.stdout == ""
    assert "unknown key `clip_ration` in section `rl_config`; did you mean `clip_ratio`?" in out.stderr
    assert f"{misspelled_7b}:" in out.stderr  # file:line of the key


def test_check_tiny_cpu_config(repo_root: Path):
    out = _rlfabric(repo_root, "config", "check", "configs/grpo_tiny_cpu.yaml", "--full",
                    "--override", "megatron_training.tokenizer_name_or_path=/tmp/tiny_model")
    assert out.returncode == 0, out.stderr
    assert "  params_dtype: float32\n" in out.stdout and "  actor_data_parallel_size: 1\n" in out.stdout
    assert "  tokenizer_name_or_path: /tmp/tiny_model\n" in out.stdout


def test_check_overrides_and_json(repo_root: Path):
    out = _rlfabric(repo_root, "config", "check", "configs/grpo_qwen25_7b_A3.yaml", "--json",
                    "-o", "rl_config.clip_ratio=0.3", "-o", "generate_config.infer_tensor_parallel_size=4")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] is True and doc["warnings"] == []
    assert doc["config"]["rl_config"]["clip_ratio"] == 0.3
    assert doc["config"]["derived"]["rollout_data_parallel_size"] == 4
    assert doc["config"]["derived"]["actor_data_parallel_size"] == 4


def test_check_json_errors(repo_root: Path, misspelled_7b: Path):
    out = _rlfabric(repo_root, "config", "check", str(misspelled_7b), "--json", "-o", "rl_config.epochs=0")
    assert out.returncode == 2
    doc = json.loads(out.stdout)
    assert doc["ok"] is False
    assert [e["key"] for e in doc["errors"]] == ["rl_config.clip_ration", "rl_config.epochs"]
    assert doc["errors"][1]["source"] == "--override rl_config.epochs=0"


def test_check_missing_file_and_syntax_error(repo_root: Path, tmp_path: Path):
    out = _rlfabric(repo_root, "config", "check", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and f"{tmp_path / 'nope.yaml'}: config file not found" in out.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("rl_config:\n  clip_ratio: 0.2\n   epochs: 1\n")
    out = _rlfabric(repo_root, "config", "check", str(broken))
    assert out.returncode == 2 and f"{broken}:3: YAML syntax error" in out.stderr


def test_keys_lists_defaults_and_help(repo_root: Path):
    out = _rlfabric(repo_root, "config", "keys", "sampling_config")
    assert out.returncode == 0, out.stderr
    assert "  temperature: 0.2  # Sampling temperature" in out.stdout
    out = _rlfabric(repo_root, "config", "keys", "nonsense")
    assert out.returncode == 2 and "unknown section `nonsense`" in out.stderr


def test_help_lists_config_command(repo_root: Path):
    out = _rlfabric(repo_root, "--help")
    assert out.returncode == 0 and "config" in out.stdout


def test_check_dapo_resolves_no_kl_and_lists_inert_keys(repo_root: Path):
    out = _rlfabric(repo_root, "config", "check", "../shared/reference/mindspeed_rl/configs/dapo_qwen25_32b_A3.yaml",
                    "--full")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "  use_kl_loss: false\n" in text and "  ref_world_size: null\n" in text and "  algorithm: dapo\n" in text
    assert "algorithm: DAPO (stage: ray_dapo): no KL term, no reference model; token-level loss, " \
           "clip [1 - 0.2, 1 + 0.28]" in text
    assert "# keys this file sets that rlfabric accepts and does not act on (inert), by reason:" in text
    assert "generate_config.offload_train_optimizer" not in text  # read by the coordinator (integrated mode)
    assert "megatron_training.use_flash_attn" in text
    assert "# rl_config.ref_forward_micro_batch_size is not read: ray_dapo has no KL term" in text


def test_check_lists_vllm_ascend_keys_as_inactive_here(repo_root: Path):
    out = _rlfabric(repo_root, "config", "check", "../shared/reference/mindspeed_rl/configs/grpo_qwen25_32b_A3.yaml")
    assert out.returncode == 0, out.stderr
    assert ("# keys inactive on this platform (only ascend acts on them): "
            "generate_config.ascend_scheduler_config_enabled") in out.stdout


def test_check_refuses_dpo_naming_it(repo_root: Path):
    out = _rlfabric(repo_root, "config", "check", "configs/grpo_qwen25_7b_A3.yaml", "-o", "megatron_training.stage=dpo")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "rlfabric does not support DPO" in out.stderr


def test_keys_markdown_prints_the_status_table(repo_root: Path):
    out = _rlfabric(repo_root, "config", "keys", "--markdown")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("| key | default | status | read by / reason |")
    assert "| `rl_config.init_kl_coef` | 0.01 | read |" in out.stdout
