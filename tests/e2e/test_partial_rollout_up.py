"""Partial rollout through the real CLI: `rlfabric up` with `rl_config.partial_rollout_max_split: 4`, pipelined.

configs/grpo_tiny_cpu.yaml (disaggregated, KL on, 64-token responses) with chunks of 16 tokens and max_model_len 80,
on prompts of two lengths: the untrained tiny model's responses run to their limit, which max_model_len makes 22
tokens (two chunks) after a 58-token prompt and 64 (four chunks) after a 13-token one. Three prompts in four are long,
so the long groups complete first and train, and the short ones' responses are cut and continued in a later
iteration, each continuation with the weights of its own iteration. The run must finish with every trained response whole (its tokens tagged with the
versions that produced them, fenced to at most max_staleness + 3 versions behind the actor: the coordinator and the
trainer's Update both check it), weight the older tokens by the truncated importance ratio, and log what the pool did.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.data.synthetic import write_rows_jsonl
from tests.e2e.test_grpo_run import read_metrics, run_up
from tests.preprocessing import preprocess_jsonl

ITERATIONS = 4
SPLIT = 4
CAP = 2.0


def _two_length_prompts(repo_root: Path, tiny_model_dir: Path, root: Path) -> Path:
    rows = [{"problem": ("Please think step by step and carefully, then say: " * 2 if i % 4 else "")
             + f"What is {i} + {2 * i}? The answer is", "answer": str(3 * i)} for i in range(64)]
    return preprocess_jsonl(repo_root, write_rows_jsonl(root / "prompts.jsonl", rows), tiny_model_dir,
                            root / "data" / "prompts")


@pytest.fixture(scope="module")
def partial_run(repo_root: Path, tiny_model_dir: Path, tmp_path_factory) -> tuple:
    run_dir = tmp_path_factory.mktemp("partial")
    prompts = _two_length_prompts(repo_root, tiny_model_dir, tmp_path_factory.mktemp("partial_data"))
    proc = run_up(repo_root, tiny_model_dir, prompts, run_dir, "-o", "generate_config.max_model_len=80",
                  "-o", "megatron_training.seq_length=80",
                  "-o", f"megatron_training.train_iters={ITERATIONS}", "-o", "megatron_training.save_interval=1000",
                  "-o", "rlfabric.max_staleness=1", "-o", f"rlfabric.importance_sampling_cap={CAP}",
                  "-o", f"rl_config.partial_rollout_max_split={SPLIT}")
    return proc, run_dir


def test_partial_rollout_continues_responses_across_versions(partial_run: tuple) -> None:
    proc, run_dir = partial_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1))
    bound = 1 + SPLIT - 1
    for m in metrics:
        # Every update trains whole responses, none older than the fence allows.
        assert 0 <= m["staleness/token_mean"] <= m["staleness/max"] <= bound
        assert m["partial_rollout/stale_groups_dropped"] == 0
        assert 0 < m["response_length/mean"] <= 64
        assert 0 < m["actor/is_weight_mean"] <= CAP and 0 <= m["actor/is_clipfrac"] <= 1
        assert math.isfinite(m["actor/pg_loss"])
        # The reference's log-probs, streamed in the rollout where each response ended, belong to the trained
        # responses: the tiny learning rate keeps the actor within ~0 KL of the reference.
        assert 0 <= m["actor/kl_loss"] < 1e-4
    # The untrained model's responses run long: responses were cut, continued in a later iteration with newer
    # weights, and trained with tokens of more than one version.
    assert sum(m["partial_rollout/cut_responses"] for m in metrics) > 0
    assert sum(m["partial_rollout/continued_responses"] for m in metrics[1:]) > 0
    assert max(m["partial_rollout/older_token_fraction"] for m in metrics[1:]) > 0
    assert max(m["staleness/max"] for m in metrics) >= 2
    # The pool holds up to two batches' groups: the first rollout takes two prompt batches.
    assert metrics[0]["partial_rollout/groups_in_pool"] <= 8


def test_the_asynchronous_engine_interrupts_rounds_and_continues_the_responses(repo_root: Path, tiny_model_dir: Path,
                                                                               tmp_path_factory) -> None:
    """`rl_config.async_engine: true`: each request asks for the whole budget, and a round is interrupted through
    the rollout's Generate stream once the global batch's groups have ended (the long prompts' groups: 22 tokens);
    the short prompts' responses come back with what they have and continue in the next iteration, at the newer
    weights. Pipelined: while the update runs, the round is not interrupted."""
    run_dir = tmp_path_factory.mktemp("partial_async")
    prompts = _two_length_prompts(repo_root, tiny_model_dir, tmp_path_factory.mktemp("partial_async_data"))
    proc = run_up(repo_root, tiny_model_dir, prompts, run_dir, "-o", "generate_config.max_model_len=80",
                  "-o", "megatron_training.seq_length=80", "-o", "megatron_training.train_iters=4",
                  "-o", "megatron_training.save_interval=1000", "-o", "rlfabric.max_staleness=1",
                  "-o", f"rl_config.partial_rollout_max_split={SPLIT}", "-o", "rl_config.async_engine=true")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert 0 <= m["staleness/token_mean"] <= m["staleness/max"] <= SPLIT
        assert m["partial_rollout/stale_groups_dropped"] == 0 and 0 < m["response_length/mean"] <= 64
        assert math.isfinite(m["actor/pg_loss"]) and 0 <= m["actor/kl_loss"] < 1e-4
    # Interrupted responses (not chunk ends: the rounds run the whole budget) were continued and trained with
    # tokens of more than one version.
    assert sum(m["partial_rollout/cut_responses"] for m in metrics) > 0
    assert sum(m["partial_rollout/continued_responses"] for m in metrics[1:]) > 0
    assert max(m["partial_rollout/older_token_fraction"] for m in metrics) > 0


def test_a_resume_trains_each_prompt_once_across_the_checkpoint(repo_root: Path, tiny_model_dir: Path,
                                                                tmp_path_factory) -> None:
    """One iteration and a checkpoint with cut responses in the pool, then a resume to three: the checkpoint's data
    cursor goes back to the first batch with a group in the pool, and the prompts of later batches that trained
    before it are not admitted again."""
    from tests.e2e.test_dapo_run import journal_details

    run_dir = tmp_path_factory.mktemp("partial_resume")
    prompts = _two_length_prompts(repo_root, tiny_model_dir, tmp_path_factory.mktemp("partial_resume_data"))
    common = ["--run-id", "dapo", "-o", "generate_config.max_model_len=80", "-o", "megatron_training.seq_length=80",
              "-o", "rlfabric.max_staleness=1", "-o", f"rl_config.partial_rollout_max_split={SPLIT}",
              "-o", "megatron_training.save_interval=1"]
    first = run_up(repo_root, tiny_model_dir, prompts, run_dir, *common, "-o", "megatron_training.train_iters=1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    cursor = int(read_metrics(run_dir)[-1]["data/consumed_batches"])
    resumed = run_up(repo_root, tiny_model_dir, prompts, run_dir, *common, "--resume",
                     "-o", "megatron_training.train_iters=3", "-o", "actor_config.finetune=false",
                     "-o", f"actor_config.load={run_dir / 'ckpt'}", "-o", "actor_config.no_load_optim=false",
                     "-o", "actor_config.no_load_rng=false", "-o", f"ref_config.load={tiny_model_dir}",
                     "-o", "ref_config.finetune=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    details = journal_details(run_dir)
    assert sorted(details) == [1, 2, 3]
    keys = {i: [g.split("/", 1)[1] for g in d["trained_groups"]] for i, d in details.items()}
    # The case under test: the first iteration trained the long groups of the first batch, whose short groups were
    # still in the pool at the checkpoint (its cursor is that batch), so the resume generates that batch again.
    assert cursor == 0 and keys[1]
    every = [k for i in sorted(keys) for k in keys[i]]
    assert len(every) == len(set(every)) == 3 * 8
