"""`rlfabric system` (what `make up|ps|scale-reward|down` run): a detached system on this host, a run against
it, reward workers scaled 1 -> 3 after the first iteration and back to 1 two iterations after the new ones
registered, while the run goes on, and nothing left behind by `down`.

Sample accounting: every reward worker counts the verifications it ran (its /metrics; a removed worker logs
its total as it exits), and with one verifier the sum over workers must equal iterations x samples per
iteration: a sample scored twice or lost would break it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from services.launcher.system import pid_alive

CONFIG = "configs/grpo_tiny_cpu.yaml"
# Iterations took 0.16-0.64 s, starting two workers 4-15 s: 16 to 57 iterations passed meanwhile.
ITERATIONS = 150
SAMPLES = 8  # 2 prompts x 4 samples, one verifier


def rlfabric(repo_root: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=repo_root, capture_output=True,
                          text=True, timeout=timeout)


def config_args(tiny_model_dir: Path, arith_prefix: Path, tmp: Path) -> list[str]:
    values = [f"megatron_training.tokenizer_name_or_path={tiny_model_dir}", f"megatron_training.data_path={arith_prefix}",
              f"actor_config.load={tiny_model_dir}", f"actor_config.save={tmp / 'ckpt'}",
              f"megatron_training.train_iters={ITERATIONS}", "megatron_training.save_interval=100",
              "megatron_training.global_batch_size=2", "rl_config.n_samples_per_prompt=4", "rl_config.mini_batch_size=2",
              "actor_config.micro_batch_size=8", "rl_config.actor_forward_micro_batch_size=8",
              "rl_config.init_kl_coef=0", "generate_config.sampling_config.max_tokens=16"]
    return [a for v in values for a in ("-o", v)]


def scored(metrics_port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("rlfabric_reward_scores_total{")))


@pytest.mark.slow  # 2-4 minutes on 2 cores; the scaling path itself runs in CI in test_reward_drain.py
def test_up_train_scale_down(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, tmp_path: Path) -> None:
    system = tmp_path / "system"
    cfg = config_args(tiny_model_dir, arith_prefix, tmp_path)
    up = rlfabric(repo_root, "system", "up", CONFIG, *cfg, "--dir", str(system))
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert "coordinator" in up.stdout and "tensorboard" in up.stdout and str(system / "logs") in up.stdout
    state = json.loads((system / "state.json").read_text())
    pids = [s["pid"] for s in state["services"]]
    try:
        ps = rlfabric(repo_root, "system", "ps", "--dir", str(system), timeout=120)
        assert ps.returncode == 0, ps.stderr
        rows = {line.split()[1]: line.split() for line in ps.stdout.splitlines()[1:]}
        assert set(rows) == {"redis", "reward-0", "rollout-0", "trainer-actor", "coordinator"}, ps.stdout
        assert all(r[4] == "SERVING" for name, r in rows.items() if name != "redis"), ps.stdout
        assert rows["rollout-0"][5] == "0" and rows["trainer-actor"][5].isdigit(), ps.stdout

        train = subprocess.Popen([sys.executable, "-m", "services.cli", "train", CONFIG, *cfg, "--system-dir",
                                  str(system)], cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        lines: list[str] = []
        scaled: list[subprocess.CompletedProcess] = []
        seen = 0  # iterations finished
        up_done_at: list[int] = []  # iterations finished when `scale reward 3` had returned

        scaler: list[threading.Thread] = []

        def scale_up() -> None:
            started = time.monotonic()
            scaled.append(rlfabric(repo_root, "system", "scale", "reward", "3", "--dir", str(system)))
            up_done_at.append(seen)
            print(f"scale reward 3 took {time.monotonic() - started:.1f}s, returned after iteration {seen}")

        assert train.stdout is not None
        for line in train.stdout:
            lines.append(line)
            done = re.match(r"iteration (\d+)\b", line)
            if not done:
                continue
            seen = int(done.group(1))
            if seen == 1:
                scaler.append(threading.Thread(target=scale_up, daemon=True))
                scaler[0].start()  # the run goes on meanwhile
            # Every iteration that began after the new workers registered ran with them; scale down after two.
            elif up_done_at and seen == up_done_at[0] + 2:
                scaled.append(rlfabric(repo_root, "system", "scale", "reward", "1", "--dir", str(system)))
        assert train.wait(timeout=600) == 0, "".join(lines[-40:])
        scaler[0].join(timeout=600)
        assert up_done_at and up_done_at[0] + 2 < ITERATIONS, f"scaling up took until iteration {up_done_at}"
        assert [s.returncode for s in scaled] == [0, 0], [s.stdout + s.stderr for s in scaled]
        assert "started reward-1, reward-2" in scaled[0].stdout
        assert "reward-2 drained" in scaled[1].stdout and "reward-1 drained" in scaled[1].stdout

        (metrics_file,) = (system / "runs").glob("*/metrics.jsonl")
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1))
        assert all(m["global_batch_size"] * m["n_samples_per_prompt"] == SAMPLES and m["failed_samples"] == 0
                   for m in metrics)
        state = json.loads((system / "state.json").read_text())
        (kept,) = [s for s in state["services"] if s["service"] == "reward"]
        assert kept["instance"] == "reward-0"
        removed = {}
        for name in ("reward-1", "reward-2"):
            found = re.search(r"scored (\d+) verifications", (system / "logs" / f"{name}.log").read_text())
            assert found, f"{name} logged no drain summary"
            removed[name] = int(found.group(1))
        # The workers added during the run scored samples, and none was lost or doubled.
        assert all(n > 0 for n in removed.values()), removed
        assert scored(kept["metrics_port"]) + sum(removed.values()) == ITERATIONS * SAMPLES, removed

        # Rollout replicas scale the same way (a new one serves at weights version 0 until a run syncs it).
        more = rlfabric(repo_root, "system", "scale", "rollout", "2", "--dir", str(system))
        assert more.returncode == 0 and "started rollout-1" in more.stdout, more.stdout + more.stderr
        rows = {line.split()[1]: line.split() for line in
                rlfabric(repo_root, "system", "ps", "--dir", str(system), timeout=120).stdout.splitlines()[1:]}
        assert rows["rollout-1"][4:] == ["SERVING", "0"] and rows["rollout-0"][5] != "0", rows
        fewer = rlfabric(repo_root, "system", "scale", "rollout", "1", "--dir", str(system))
        assert fewer.returncode == 0 and "rollout-1 drained and stopped" in fewer.stdout, fewer.stdout + fewer.stderr
    finally:
        down = rlfabric(repo_root, "system", "down", "--dir", str(system), timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "system down" in down.stdout
    assert not (system / "state.json").exists() and not (system / "state.lock").exists()
    assert not any(pid_alive(pid) for pid in pids)  # (a zombie not yet reaped by init counts as gone)
    left = subprocess.run(["pgrep", "-f", str(system)], capture_output=True, text=True)
    assert left.stdout.strip() == ""


def test_up_with_a_broken_config_fails_before_starting_anything(repo_root: Path, tmp_path: Path) -> None:
    up = rlfabric(repo_root, "system", "up", CONFIG, "-o", "actor_config.micro_batch_size=3", "--dir",
                  str(tmp_path), timeout=120)
    assert up.returncode == 2
    assert "actor_config.micro_batch_size" in up.stderr
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "logs").exists()
    assert not (tmp_path / "state.lock").exists()


def test_up_fails_naming_the_service_that_did_not_start_and_stops_the_rest(repo_root: Path, tiny_model_dir: Path,
                                                                           arith_prefix: Path, tmp_path: Path) -> None:
    """The config is valid, but the actor's `load` folder has a config.json and no weights: the trainer exits,
    `up` says which service and why (its log's tail), and every process it had started is gone."""
    import shutil

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_model_dir / "config.json", no_weights / "config.json")
    system = tmp_path / "system"
    cfg = [*config_args(tiny_model_dir, arith_prefix, tmp_path), "-o", f"actor_config.load={no_weights}"]
    up = rlfabric(repo_root, "system", "up", CONFIG, *cfg, "--dir", str(system), timeout=600)
    assert up.returncode == 1, up.stdout + up.stderr
    assert re.search(r"trainer-actor \(pid \d+\) exited with code 1", up.stderr) and str(no_weights) in up.stderr, up.stderr
    assert "every service started was stopped again" in up.stderr
    assert not (system / "state.json").exists() and not (system / "state.lock").exists()
    pids = [int(p) for p in re.findall(r"pid (\d+)", up.stderr.rsplit("stopped again", 1)[1])]
    assert len(pids) == 5 and not any(pid_alive(pid) for pid in pids), up.stderr
