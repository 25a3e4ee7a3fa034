"""Mistakes a user makes on the command line: one line on stderr naming what to fix, no traceback, exit 2.

Each case runs the real `rlfabric` entry point in a subprocess, with the Hugging Face hub pointed at a local
server that counts requests: a model folder that is not there must be "not found" at once, never tried as a hub
id (transformers and vLLM spent 37-55 s in hub retries on one before these checks).
"""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

# A bound on each command, far below the hub's retries; the commands take 1-3 s.
LIMIT_S = 20
EXIT_USAGE = 2
MISSING = "relative/missing"  # a path that is also a valid hub id (org/name)


class _Hub(http.server.ThreadingHTTPServer):
    requests: list[str]


@pytest.fixture(scope="module")
def hub() -> Iterator[_Hub]:
    """A stand-in for huggingface.co that answers 404 to everything and records each request path."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.server.requests.append(self.path)
            self.send_error(404)

        def do_HEAD(self) -> None:
            self.do_GET()

        def log_message(self, *args: object) -> None:
            pass

    server = _Hub(("127.0.0.1", 0), Handler)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _rlfabric(repo_root: Path, hub: _Hub, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(PYTHONPATH=str(repo_root), OMP_NUM_THREADS="1",
               HF_ENDPOINT=f"http://127.0.0.1:{hub.server_address[1]}")
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=repo_root, env=env,
                          capture_output=True, text=True, timeout=LIMIT_S)


def _one_line(out: subprocess.CompletedProcess[str], code: int = EXIT_USAGE) -> str:
    """The single stderr line of a refused command (after checking its exit code and the absent traceback)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("argv", [
    ("eval", "--model", MISSING, "--limit", "1"),
    ("sft", MISSING, "rows.jsonl", "out"),
    ("rollout", "serve", "--model", MISSING),
    ("trainer", "serve", "--hf-dir", MISSING),
    ("convert", "hf2mcore", MISSING, "out"),
], ids=["eval", "sft", "rollout-serve", "trainer-serve", "convert"])
def test_a_missing_model_folder_is_not_found_at_once(repo_root: Path, hub: _Hub, argv: tuple[str, ...]) -> None:
    before = len(hub.requests)
    line = _one_line(_rlfabric(repo_root, hub, *argv))
    flag = argv[argv.index(MISSING) - 1] if argv[argv.index(MISSING) - 1].startswith("--") else None
    assert f"'{MISSING}' not found (relative paths are resolved from {repo_root})" in line
    assert flag is None or flag in line
    assert "Hugging Face model folder" in line
    assert hub.requests[before:] == []  # never tried as a hub id


def test_convert_mcore2hf_without_a_checkpoint_is_not_found(repo_root: Path, hub: _Hub) -> None:
    line = _one_line(_rlfabric(repo_root, hub, "convert", "mcore2hf", MISSING, "out"))
    assert f"MCORE_DIR '{MISSING}' not found" in line and "Megatron checkpoint folder" in line


def test_tiny_model_refuses_a_non_empty_folder(repo_root: Path, hub: _Hub, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    line = _one_line(_rlfabric(repo_root, hub, "tiny-model", str(tmp_path)))
    assert str(tmp_path) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_tiny_model_too_small_a_vocabulary_is_a_usage_error(repo_root: Path, hub: _Hub, tmp_path: Path) -> None:
    line = _one_line(_rlfabric(repo_root, hub, "tiny-model", str(tmp_path / "m"), "--vocab-size", "10"))
    assert line == "error: vocab_size 10 is too small: a byte-level BPE needs at least 300 entries"
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"], ids=["empty", "comment", "empty-mapping"])
def test_an_empty_config_is_one_error_naming_the_file(repo_root: Path, hub: _Hub, tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    line = _one_line(_rlfabric(repo_root, hub, "config", "check", str(path)))
    assert line.startswith(f"error: {path}: CONFIG is empty")


def test_a_missing_model_include_names_the_folder_it_looked_in(repo_root: Path, hub: _Hub, tmp_path: Path) -> None:
    copied = tmp_path / "grpo_qwen25_7b_A3.yaml"
    shutil.copy(repo_root / "configs/grpo_qwen25_7b_A3.yaml", copied)  # without its model/ folder
    line = _one_line(_rlfabric(repo_root, hub, "config", "check", str(copied)))
    assert f"model `qwen25_7b` not found: looked for qwen25_7b.yaml in {tmp_path.resolve() / 'model'}" in line
    assert f"rlfabric ships {repo_root.resolve() / 'configs/model/qwen25_7b.yaml'}: copy it there" in line
    (tmp_path / "model").mkdir()  # the fix the message names
    shutil.copy(repo_root / "configs/model/qwen25_7b.yaml", tmp_path / "model")
    assert _rlfabric(repo_root, hub, "config", "check", str(copied)).returncode == 0


@pytest.mark.parametrize(("text", "line_no"), [
    ("rl_config:\n  clip_ratio 0.2\n  epochs: 1\n", 2),  # a key without its colon: PyYAML notices it on line 3
    ("rl_config:\n  verifier_function: [acc, format\n  epochs: 1\n", 2),  # an unclosed bracket
    ("rl_config:\n  clip_ratio: 0.2\n   epochs: 1\n", 3),  # a mis-indented key
], ids=["missing-colon", "unclosed-bracket", "indent"])
def test_a_yaml_syntax_error_names_the_line_to_fix(repo_root: Path, hub: _Hub, tmp_path: Path, text: str,
                                                   line_no: int) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    line = _one_line(_rlfabric(repo_root, hub, "config", "check", str(path)))
    assert line.startswith(f"error: {path}:{line_no}: YAML syntax error")


def test_reward_score_names_a_missing_input_in_a_sentence(repo_root: Path, hub: _Hub, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    line = _one_line(_rlfabric(repo_root, hub, "reward", "score", str(missing), "--out", str(tmp_path / "o.jsonl"),
                               "--verifier", "math_equiv"))
    assert line == f"rlfabric reward score: input file {missing} not found"
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"response": "2", "ground_truth": "2"}\n')
    line = _one_line(_rlfabric(repo_root, hub, "reward", "score", str(rows), "--out",
                               str(tmp_path / "absent" / "o.jsonl"), "--verifier", "math_equiv"))
    assert f"folder {tmp_path / 'absent'} not found" in line and "Errno" not in line


def test_a_config_error_is_one_line_and_exit_2_in_every_command(repo_root: Path, hub: _Hub, tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    for argv in (("config", "check", str(path)), ("rollout", "serve", "--config", str(path)),
                 ("trainer", "serve", "--config", str(path))):
        line = _one_line(_rlfabric(repo_root, hub, *argv))
        assert f"{path}: CONFIG is empty" in line, argv
    plan = _rlfabric(repo_root, hub, "plan", str(path))  # adds a second line: what plan needs
    assert plan.returncode == EXIT_USAGE and "Traceback" not in plan.stderr
    assert f"{path}: CONFIG is empty" in plan.stderr.splitlines()[0]


def test_config_check_prints_its_summary_and_the_yaml_only_with_full(repo_root: Path, hub: _Hub) -> None:
    out = _rlfabric(repo_root, hub, "config", "check", "configs/grpo_qwen25_7b_A3.yaml")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == ("# configs/grpo_qwen25_7b_A3.yaml: model block qwen25_7b (--full prints the resolved "
                        "configuration)")
    assert lines[-1].startswith("OK: actor DP = 4 (16 devices / TP 2 x PP 2 x CP 1)")
    assert "\nrl_config:" not in out.stdout and "\nderived:" not in out.stdout
    assert len(lines) < 60
    full = _rlfabric(repo_root, hub, "config", "check", "configs/grpo_qwen25_7b_A3.yaml", "--full")
    assert full.returncode == 0, full.stderr
    assert full.stdout.startswith(out.stdout.replace("--full prints the resolved configuration",
                                                     "the resolved configuration follows"))
    assert full.stdout.index(lines[-1]) < full.stdout.index("\nrl_config:") < full.stdout.index("\nderived:")
