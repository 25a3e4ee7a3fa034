"""PPO with a critic (issue 27, MindSpeed-RL's `stage: ray_ppo`) through the real CLI: `rlfabric up
configs/ppo_demo_cpu.yaml` starts Redis, a reward worker, the demo's custom verifier, a vLLM replica, the Megatron
actor and critic trainers (no reference: PPO's loss has no KL term) and the coordinator, from the demo's warm-up.

- CI: 3 iterations. Every iteration logs MindSpeed-RL's PPO metrics (the critic's loss and clip fraction, the
  scores, GAE's advantages, returns and the critic's values), the critic's update moves its values, and the run's
  checkpoint holds the critic (with its value head) beside the actor.
- Slow (`make soak`): reward goes up over 100 iterations, as the GRPO learning test measures it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from services.report.run_metrics import find_metrics, read_metrics
from tests.e2e.addition_work import demo_up_command

CONFIG = "configs/ppo_demo_cpu.yaml"
PPO_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/lr", "critic/grad_norm", "critic/score/mean",
            "critic/advantages/mean", "critic/advantages/max", "critic/returns/mean", "critic/values/mean",
            "critic/values/min", "timing/critic_model", "timing/update_critic", "actor/pg_loss", "grad_norm")


def ppo_up(work: Path, run_dir: Path, iterations: int, *extra: str) -> subprocess.CompletedProcess:
    args = demo_up_command(work, run_dir, iterations, "-o", f"critic_config.load={work / 'sft_model'}",
                           "-o", f"critic_config.save={run_dir / 'ckpt'}", *extra, config=CONFIG)
    return subprocess.run(args, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=1800)


def test_ppo_run_trains_the_critic_and_logs_its_metrics(addition_warmup: Path, tmp_path: Path) -> None:
    iterations = 3
    run_dir = tmp_path / "run"
    proc = ppo_up(addition_warmup, run_dir, iterations, "-o", f"megatron_training.save_interval={iterations}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trainer-critic (Megatron) ready" in proc.stdout
    assert not list((run_dir / "logs").glob("trainer-reference*.log"))  # no KL anywhere: no reference model
    records = read_metrics(find_metrics(run_dir))
    assert [int(r["iteration"]) for r in records] == list(range(1, iterations + 1))
    for r in records:
        assert all(k in r for k in PPO_KEYS), sorted(k for k in PPO_KEYS if k not in r)
        assert r["critic/lr"] == pytest.approx(1e-3) and r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0
        # GAE's advantages are whitened over the batch's tokens; with gamma = lam = 1 the returns are the score.
        assert abs(r["critic/advantages/mean"]) < 1e-3 and r["critic/advantages/max"] > 0
        assert r["critic/returns/max"] <= 1.0 + 1e-6 and r["critic/returns/min"] >= -1e-6
        assert r["actor/kl_loss"] == 0.0
    # The critic learns: its values move towards the returns from one iteration to the next.
    assert records[0]["critic/values/mean"] != records[-1]["critic/values/mean"]
    critic_dir = run_dir / "ckpt" / "critic"
    assert (critic_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(iterations)
    shard = next(critic_dir.glob(f"iter_{iterations:07d}/mp_rank_*/model_optim_rng.pt"))
    state = torch.load(shard, map_location="cpu", weights_only=False)["model"]
    assert any("value_head" in k for k in state), sorted(state)[:8]
    assert (run_dir / "ckpt" / f"iter_{iterations:07d}").is_dir()  # the actor's, beside it


@pytest.mark.slow  # ~2-3 minutes
def test_ppo_reward_goes_up(addition_warmup: Path, tmp_path: Path) -> None:
    from tests.e2e.test_learning import MARGIN, SHORT_ITERATIONS, mean

    proc = ppo_up(addition_warmup, tmp_path / "run", SHORT_ITERATIONS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rewards = [r["critic/score/mean"] for r in read_metrics(find_metrics(tmp_path / "run"))]
    assert len(rewards) == SHORT_ITERATIONS
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    assert last - first >= MARGIN, f"reward {first:.3f} -> {last:.3f}: {rewards}"
