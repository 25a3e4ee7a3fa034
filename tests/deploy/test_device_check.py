"""`make device-check` (bench/device_check.py) on a machine without CUDA: every row SKIP, exit status 0.

The rows themselves need a GPU; this is the path CI (no accelerator) and a laptop take.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_without_cuda_every_check_is_skipped():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, even on a GPU machine
    done = subprocess.run([sys.executable, "-m", "bench.device_check"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split("  ") for line in done.stdout.splitlines()]
    assert [[cell.strip() for cell in row if cell.strip()] for row in rows] == [
        ["trainer fp32", "SKIP", "no CUDA device"], ["trainer bf16", "SKIP", "no CUDA device"],
        ["bf16 fp32 masters", "SKIP", "no CUDA device"], ["rollout vLLM", "SKIP", "no CUDA device"], ["weight sync NCCL", "SKIP", "no CUDA device"]]


def test_make_device_check_runs_the_script():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "--no-print-directory", "-n", "device-check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == ".venv/bin/python -m bench.device_check"
