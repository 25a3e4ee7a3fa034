"""Failover under `rlfabric up` itself: with two reward workers and two rollout replicas, one of each is
SIGKILLed mid-run; the run finishes, every sample scored exactly once, and `up` says which child died, which
took over and that it restarted the dead one. A reward worker SIGSTOPped and continued is reported both ways.
The trainer-rank and coordinator deaths, and every child of a one-of-each `up`, are tests/reliability/
test_up_faults.py's (soak); the supervisor's rules on light children are test_up_children.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.reliability.test_up_faults import Up

ITERS, PROMPTS, SAMPLES = 5, 8, 8  # configs/grpo_tiny_cpu.yaml: global_batch_size 8, n_samples_per_prompt 8


def leaders(up: Up, needle: str) -> list[int]:
    """Pids of `up`'s direct children whose command line contains `needle`, oldest first."""
    children = Path(f"/proc/{up.proc.pid}/task/{up.proc.pid}/children").read_text().split()
    return sorted(int(p) for p in children
                  if needle in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))


# Either replica may die: the first `up` started (CI) or the second (soak).
@pytest.mark.parametrize("replica", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_up_with_two_workers_and_two_replicas_survives_losing_one_of_each(replica, repo_root, tiny_model_dir,
                                                                        arith_prefix, tmp_path) -> None:
    up = Up(repo_root, tiny_model_dir, arith_prefix, tmp_path / "run", "-o", f"megatron_training.train_iters={ITERS}",
            "-o", "generate_config.sampling_config.max_tokens=16", "--run-id", "failover",
            # two optimizer steps per iteration: the old-log-prob pass runs, so rollout_mismatch/* is logged
            "-o", "rl_config.mini_batch_size=4",
            "--reward-workers", "2", "--rollout-replicas", "2")
    try:
        up.wait_for(rf"(?m)^iteration 1/{ITERS}")
        workers, replicas = leaders(up, "reward serve"), leaders(up, "rollout serve")
        assert len(workers) == 2 and len(replicas) == 2, (workers, replicas)

        os.kill(workers[0], signal.SIGSTOP)
        up.wait_for(rf"reward-\d \(pid {workers[0]}\) is stopped .*it does nothing until it gets SIGCONT", 30)
        os.kill(workers[0], signal.SIGCONT)
        up.wait_for(rf"reward-\d \(pid {workers[0]}\) runs again", 30)

        # Both deaths at once, early in the run: the supervisor must see them while the run still goes (an
        # iteration of this run takes under a second).
        os.kill(workers[1], signal.SIGKILL)
        os.kill(replicas[replica], signal.SIGKILL)
        up.wait_for(rf"reward-\d \(pid {workers[1]}\) exited with code -9 \(killed by SIGKILL\); the run goes on "
                    r"with reward-\d; restarted it as pid \d+", 30)
        up.wait_for(rf"rollout-\d \(pid {replicas[replica]}\) exited with code -9 \(killed by SIGKILL\); the run goes on "
                    r"with rollout-\d; restarted it as pid \d+", 30)
        assert up.finish() == 0, up.output[-4000:]
    finally:
        up.cleanup()
    assert f"run failover: RUN_PHASE_DONE at iteration {ITERS}" in up.output, up.output[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "runs" / "failover" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    # Exactly once: every generated sample got one score (re-sent ones included), none was given up on.
    assert sum(r["reward/samples_scored"] for r in rows) == ITERS * PROMPTS * SAMPLES, [
        r["reward/samples_scored"] for r in rows]
    assert sum(r["reward/samples_given_up"] for r in rows) == 0
    # The engines agree on the sampled tokens' log-probs at the same weights (fp32 on both sides).
    assert all(0 <= r["rollout_mismatch/mean_abs_logp_diff"] < 1e-2 and r["rollout_mismatch/kl"] >= 0 for r in rows)
    assert not re.search(r"RUN_PHASE_FAILED|Traceback", up.output), up.output[-3000:]
