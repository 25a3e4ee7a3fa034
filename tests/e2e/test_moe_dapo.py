"""DAPO on the tiny Qwen3-MoE at EP2 through `rlfabric up` (configs/dapo_tiny_moe_cpu.yaml): dynamic sampling
(filter_groups) drops the zero-variance groups and generates on until the target is kept, with routing replay on,
so the experts the replica chose must follow the kept groups into the trainer's passes.

The reward signal is test_dapo_run.py's: the model is fine-tuned for a few seconds to answer ` \\boxed{1}` or
` \\boxed{2}` at random, even rows are labelled "1" (the group's scores vary: kept) and odd rows "999" (every sample
scores 0: dropped). Every generation batch of GBS prompts keeps at most GBS / 2 groups, so each iteration needs
at least two batches to reach TARGET. Disaggregated, as the config (the integrated path is test_dapo_run.py's).
Slow (`make soak`): ~2.5-4 minutes on 2 shared cores (the start-up of the EP2 actor and the vLLM replica
alone is ~60 s).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.preprocessing import preprocess_jsonl

N_ROWS = 32
GBS = 4  # prompts per generation batch; mini-batches of GBS / 2 prompts: two optimizer steps per iteration
TARGET = 4  # filter_groups_train_batch_size
ITERS = 2
RUN_ID = "dapo-moe"


def fine_tune_to_boxed(model_dir: Path, out: Path, steps: int = 40) -> Path:
    """`model_dir` fine-tuned (transformers, AdamW) to answer ` \\boxed{1}` or ` \\boxed{2}` (about half each),
    then EOS, after any "What is A + B? The answer is" prompt; written to `out` with the tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(32):
            prompt = tok(f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}? The answer is").input_ids
            answer = tok(" \\boxed{" + rng.choice("12") + "}").input_ids + [tok.eos_token_id]
            ids.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(len(x) for x in ids)
        pad = [[tok.pad_token_id] * (width - len(x)) for x in ids]
        batch = torch.tensor([x + p for x, p in zip(ids, pad, strict=True)])
        target = torch.tensor([y + [-100] * len(p) for y, p in zip(labels, pad, strict=True)])
        mask = torch.tensor([[1] * len(x) + [0] * len(p) for x, p in zip(ids, pad, strict=True)])
        model(input_ids=batch, attention_mask=mask, labels=target).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def dapo_moe_run(repo_root: Path, tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("dapo_moe")
    model = fine_tune_to_boxed(tiny_moe_dir, root / "boxed_model")
    rows = [{"problem": f"What is {i} + {i + 1}? The answer is", "answer": "1" if i % 2 == 0 else "999"}
            for i in range(N_ROWS)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = preprocess_jsonl(repo_root, root / "rows.jsonl", model, root / "data" / "split")
    run_dir = root / "run"
    proc = subprocess.run([
        sys.executable, "-m", "services.cli", "up", "configs/dapo_tiny_moe_cpu.yaml",
        "-o", f"megatron_training.tokenizer_name_or_path={model}", "-o", f"megatron_training.data_path={prefix}",
        "-o", f"actor_config.load={model}", "-o", f"actor_config.save={run_dir / 'ckpt'}",
        "-o", f"megatron_training.train_iters={ITERS}", "-o", "megatron_training.save_interval=100",
        "-o", f"megatron_training.global_batch_size={GBS}", "-o", f"rl_config.mini_batch_size={GBS // 2}",
        "-o", f"actor_config.micro_batch_size={GBS // 2 * 8 // 2}",  # a rank's share of a mini-batch: 2 x n / DP
        "-o", "rl_config.filter_groups_max_batches=-1", "-o", f"rl_config.filter_groups_train_batch_size={TARGET}",
        # The fine-tuned model answers in ~7 tokens: 16 bound the rollout, and overlong shaping never bites.
        "-o", "generate_config.sampling_config.max_tokens=16", "-o", "rl_config.rollout_max_tokens=16",
        "-o", "rl_config.overlong_buffer=4", "-o", "rlfabric.routing_replay=rollout",
        "--run-dir", str(run_dir), "--run-id", RUN_ID], cwd=repo_root, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run {RUN_ID}: RUN_PHASE_DONE at iteration {ITERS}" in proc.stdout, proc.stdout[-3000:]
    metrics = [json.loads(x) for x in (run_dir / "runs" / RUN_ID / "metrics.jsonl").read_text().splitlines()]
    return run_dir, metrics, journal_details(run_dir)


def journal_details(run_dir: Path) -> dict[int, dict]:
    """Iteration -> what the run's journal says it consumed and trained (read back from the run's Redis files)."""
    from services.common.redis_store import RunJournal, connect, start_private_redis

    redis = start_private_redis(str(run_dir / "redis"), appendonly=True)
    try:
        return RunJournal(connect(redis.url), RUN_ID).details()
    finally:
        redis.stop()


@pytest.mark.slow
def test_dynamic_sampling_keeps_only_groups_with_a_spread_at_ep2(dapo_moe_run: tuple) -> None:
    _, metrics, details = dapo_moe_run
    assert [m["iteration"] for m in metrics] == list(range(1, ITERS + 1))
    assert sorted(details) == list(range(1, ITERS + 1))
    for m in metrics:
        ids = details[int(m["iteration"])]["trained_groups"]
        assert len(ids) == TARGET and m["dapo/num_groups_trained"] == TARGET and m["global_batch_size"] == TARGET
        # Only answerable (even) rows can have a spread; an odd row trained would be a zero-variance group.
        assert all(int(g.rsplit("/p", 1)[1]) % 2 == 0 for g in ids), ids
        assert TARGET <= m["dapo/num_groups_kept"] < m["dapo/num_groups_generated"]
        # At most GBS / 2 groups of a batch are kept: TARGET takes at least two batches.
        assert m["dapo/num_groups_generated"] == GBS * m["train/num_gen_batches"]
        assert m["train/num_gen_batches"] >= TARGET // (GBS // 2)
        # Disaggregated: the EP2 actor's 2 devices and the rollout's 2; DAPO has no reference model.
        assert m["world_size"] == 4 and m["timing/reference_model"] == 0


@pytest.mark.slow
def test_moe_metrics_and_replayed_routing_follow_the_kept_groups(dapo_moe_run: tuple) -> None:
    run_dir, metrics, _ = dapo_moe_run
    for m in metrics:
        assert m["moe/aux_loss"] > 0 and m["moe/expert_load_max_over_mean"] >= 1.0, m
        # Two optimizer steps per iteration: the old-log-prob pass runs and the mismatch is logged. The replica
        # holds the trainer's weights and the routing of each kept sample is its own: fp32 noise only.
        assert 0 <= m["rollout_mismatch/mean_abs_logp_diff"] < 1e-3, m["rollout_mismatch/mean_abs_logp_diff"]
        # Misaligned routings (a dropped group's experts on a kept group's tokens) would change most of them.
        assert 0 <= m["moe/routing_replay_changed_fraction"] < 0.1, m
    assert [m["weights_version"] for m in metrics] == list(range(2, ITERS + 2))
    assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
