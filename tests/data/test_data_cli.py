"""The entry points as a user runs them: `rlfabric preprocess`, `bash examples/data/preprocess_data.sh NAME`,
their exit codes and messages, and what a killed run leaves behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_support import DAPO_106, DEEPSCALER_803, DEEPSCALER_MATH_7474

from services.cli import build_parser

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _bins(prefix: Path) -> list[str]:
    return sorted(p.name for p in prefix.parent.glob(prefix.name + "*") if p.suffix in (".bin", ".idx"))


def test_preprocess_is_an_rlfabric_subcommand():
    args = build_parser().parse_args(["preprocess", "configs/datasets/deepscaler.yaml", "--set", "workers=2"])
    assert args.command == "preprocess" and args.overrides == ["workers=2"] and callable(args.func)


def test_upstream_script_runs_deepscaler_yaml_with_progress_and_summary(repo_root, shared_data, tiny_model_dir,
                                                                         tmp_path):
    prefix = tmp_path / "data"
    summary_json = tmp_path / "summary.json"
    proc = subprocess.run(
        ["bash", "examples/data/preprocess_data.sh", "deepscaler",
         "--set", f"input={shared_data / DEEPSCALER_803}", "--set", f"tokenizer_name_or_path={tiny_model_dir}",
         "--set", f"output_prefix={prefix}", "--set", "workers=1", "--set", "log_interval=100",
         "--summary-json", str(summary_json)],
        cwd=repo_root, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # A progress line every log_interval rows, with rows done, rate and ETA.
    progress = re.findall(r"(\d+)/803 rows \([\d.]+%\), \d+ rows/s, ETA [\d.]+ s", proc.stderr)
    assert len(progress) >= 5 and int(progress[-1]) == 803
    assert "rows read: 803\nrows written: 803\nrows dropped: 0" in proc.stdout
    for name in _bins(prefix):
        assert f"{prefix.parent / name}  {(prefix.parent / name).stat().st_size} bytes" in proc.stdout
    assert len(_bins(prefix)) == 6
    summary = json.loads(summary_json.read_text())
    assert (summary["rows_read"], summary["rows_written"], summary["rows_dropped"]) == (803, 803, 0)


def test_script_rejects_an_unknown_dataset_name(repo_root):
    proc = subprocess.run(["bash", "examples/data/preprocess_data.sh", "deepscaler_v2"], cwd=repo_root, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no dataset config configs/datasets/deepscaler_v2.yaml" in proc.stderr
    assert "deepscaler math_17k" in proc.stderr


@pytest.mark.parametrize(("overrides", "message"), [
    (["input=./dataset/missing.json"], "input ./dataset/missing.json not found"),
    (["handler_name=Math17kHandler"], "unknown handler_name 'Math17kHandler'; valid names:"),
    (["prompt_type=qwen25"], "unknown prompt_type 'qwen25'"),
])
def test_cli_errors_exit_2_with_one_clear_line(repo_root, shared_data, tiny_model_dir, tmp_path, overrides, message):
    base = [f"input={shared_data / DAPO_106}", f"tokenizer_name_or_path={tiny_model_dir}",
            f"output_prefix={tmp_path / 'data'}"]
    cmd = [sys.executable, "-m", "services.cli", "preprocess", "configs/datasets/math_17k.yaml"]
    for item in base + overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=repo_root, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("rlfabric preprocess: error: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def big_jsonl(shared_data, tmp_path_factory) -> Path:
    """The 7,474-row MATH file four times over as JSON lines: long enough to be stopped half way."""
    rows = json.loads((shared_data / DEEPSCALER_MATH_7474).read_text())
    path = tmp_path_factory.mktemp("big") / "math_x4.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    return path


def _start_and_wait_for_progress(repo_root, big_jsonl, tiny_model_dir, prefix) -> tuple[subprocess.Popen, Path]:
    log = prefix.parent / "stderr.log"
    cmd = [sys.executable, "-m", "services.data.cli", "configs/datasets/deepscaler.yaml",
           "--set", f"input={big_jsonl}", "--set", f"tokenizer_name_or_path={tiny_model_dir}",
           "--set", f"output_prefix={prefix}", "--set", "workers=2", "--set", "log_interval=500"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=repo_root, env=ENV, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if re.search(r" (\d+)/29896 rows", log.read_text()):
            return proc, log
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no progress line before the deadline: {log.read_text()[-2000:]}")


def _reap(proc: subprocess.Popen) -> int:
    rc = proc.wait(timeout=60)
    try:  # the run's own process group: pool workers, should any outlive their parent
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return rc


def test_sigkill_mid_run_leaves_no_dataset_files(repo_root, shared_data, big_jsonl, tiny_model_dir, tmp_path):
    prefix = tmp_path / "out" / "data"
    prefix.parent.mkdir()
    proc, log = _start_and_wait_for_progress(repo_root, big_jsonl, tiny_model_dir, prefix)
    os.kill(proc.pid, signal.SIGKILL)
    assert _reap(proc) == -signal.SIGKILL
    done = [int(n) for n in re.findall(r" (\d+)/29896 rows", log.read_text())]
    assert 0 < max(done) < 29896  # it was stopped half way
    assert _bins(prefix) == []
    leftovers = [p for p in prefix.parent.iterdir() if p.name.startswith(".data.rlfabric-tmp-")]
    assert len(leftovers) == 1  # the dead run's temporary folder...

    from data_support import deepscaler_config

    from services.data.preprocess import preprocess

    preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix, input=str(shared_data / DEEPSCALER_803)))
    assert not leftovers[0].exists()  # ...is removed by the next run into the same place
    assert len(_bins(prefix)) == 6


def test_sigterm_mid_run_cleans_up_and_exits_143(repo_root, big_jsonl, tiny_model_dir, tmp_path):
    prefix = tmp_path / "out" / "data"
    prefix.parent.mkdir()
    proc, _ = _start_and_wait_for_progress(repo_root, big_jsonl, tiny_model_dir, prefix)
    os.kill(proc.pid, signal.SIGTERM)
    assert _reap(proc) == 128 + signal.SIGTERM
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["stderr.log"]
