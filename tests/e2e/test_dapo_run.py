"""DAPO dynamic sampling through the real CLI: `rlfabric up` with configs/dapo_tiny_cpu.yaml (then, in the soak,
`--resume`).

The reward signal is built so that which groups survive is known in advance: the tiny model is fine-tuned for
a few seconds to answer every prompt with `\\boxed{1}` or `\\boxed{2}` at random, and the prompts' labels are
"1" (even rows: the group's `math_17k_acc` scores vary, it is kept) or "999" (odd rows: every sample scores 0,
no spread, the group is dropped). So every trained group must come from an even row, and generation must go on
past a prompt batch until `filter_groups_train_batch_size` groups are kept. The run is in integrated mode (as
every upstream DAPO config): the rollout stays awake over all generation batches of an iteration.
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


@pytest.fixture(scope="module")
def boxed_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model fine-tuned to answer ` \\boxed{1}` or ` \\boxed{2}` (about half each), then EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("boxed_model")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(40):
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
def split_prefix(boxed_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """N_ROWS prompts; even rows are labelled "1" (answerable), odd rows "999" (never answered)."""
    root = tmp_path_factory.mktemp("dapo_data")
    rows = [{"problem": f"What is {i} + {i + 1}? The answer is", "answer": "1" if i % 2 == 0 else "999"}
            for i in range(N_ROWS)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return preprocess_jsonl(repo_root, root / "rows.jsonl", boxed_model_dir, root / "data" / "split")


def run_dapo(repo_root: Path, model: Path, prefix: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "services.cli", "up", "configs/dapo_tiny_cpu.yaml",
            "-o", f"megatron_training.tokenizer_name_or_path={model}",
            "-o", f"megatron_training.data_path={prefix}",
            "-o", f"actor_config.load={model}", "-o", f"actor_config.save={run_dir / 'ckpt'}",
            "-o", f"megatron_training.global_batch_size={GBS}", "-o", f"rl_config.mini_batch_size={GBS // 2}",
            "-o", "rl_config.filter_groups_max_batches=-1",
            "-o", f"rl_config.filter_groups_train_batch_size={TARGET}",
            "-o", "rl_config.use_integrated_worker=true", "-o", "generate_config.offload_train_param=true",
            "-o", "generate_config.offload_train_grad=true", "-o", "generate_config.offload_train_optimizer=true",
            # The fine-tuned model answers in ~7 tokens: 16 bound the rollout, and overlong shaping never bites.
            "-o", "generate_config.sampling_config.max_tokens=16", "-o", "rl_config.rollout_max_tokens=16",
            "-o", "rl_config.overlong_buffer=4",
            "-o", "megatron_training.save_interval=1",
            "--run-dir", str(run_dir), "--run-id", "dapo", *extra]
    return subprocess.run(args, cwd=repo_root, capture_output=True, text=True, timeout=900)


def journal_details(run_dir: Path) -> dict[int, dict]:
    """Iteration -> what the run's journal says it consumed and trained (read back from the run's Redis files)."""
    from services.common.redis_store import RunJournal, connect, start_private_redis

    redis = start_private_redis(str(run_dir / "redis"), appendonly=True)
    try:
        return RunJournal(connect(redis.url), "dapo").details()
    finally:
        redis.stop()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "runs" / "dapo" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dapo_runs(repo_root: Path, boxed_model_dir: Path, split_prefix: Path, tmp_path_factory) -> tuple:
    """Two iterations; the soak's resume test (last in this file) adds the third in a new coordinator."""
    run_dir = tmp_path_factory.mktemp("dapo_run")
    first = run_dapo(repo_root, boxed_model_dir, split_prefix, run_dir, "-o", "megatron_training.train_iters=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return run_dir, journal_details(run_dir)


def test_zero_variance_groups_are_dropped_and_generation_goes_on_until_the_target(dapo_runs: tuple) -> None:
    run_dir, details = dapo_runs
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2]
    assert sorted(details) == [1, 2]
    for m in metrics:
        ids = details[int(m["iteration"])]["trained_groups"]
        assert len(ids) == TARGET and m["dapo/num_groups_trained"] == TARGET
        # Only answerable (even) rows can have a spread; an odd row trained would be a zero-variance group.
        assert all(int(g.rsplit("/p", 1)[1]) % 2 == 0 for g in ids), ids
        assert m["dapo/num_groups_kept"] >= TARGET
        assert m["dapo/num_groups_generated"] == GBS * m["train/num_gen_batches"] >= m["dapo/num_groups_kept"]
        assert m["global_batch_size"] == TARGET
    # Half the rows are unanswerable: over the iterations, groups were dropped and more batches generated.
    assert sum(m["dapo/num_groups_generated"] - m["dapo/num_groups_kept"] for m in metrics) > 0
    assert sum(m["train/num_gen_batches"] for m in metrics) > len(metrics)


def test_no_group_trains_twice_and_each_comes_from_its_own_iterations_batches(dapo_runs: tuple) -> None:
    run_dir, details = dapo_runs
    metrics = {int(m["iteration"]): m for m in read_metrics(run_dir)}
    every = [g for d in details.values() for g in d["trained_groups"]]
    assert len(every) == len(set(every)) == len(details) * TARGET
    for it, d in details.items():
        m = metrics[it]
        first, consumed = int(m["data/batch_index"]), int(m["data/consumed_batches"])
        assert d["batches"] == list(range(first, consumed)) and len(d["batches"]) == m["train/num_gen_batches"]
        for g in d["trained_groups"]:  # it{iteration}/b{batch}/p{prompt}
            g_it, g_batch, _ = g.split("/")
            assert g_it == f"it{it}" and int(g_batch[1:]) in d["batches"]


def test_the_rollout_stays_awake_over_every_generation_batch_of_an_iteration(dapo_runs: tuple) -> None:
    """Integrated DAPO: one wake before the first generation batch, one sleep after the last (as upstream's
    enter/exit_infer_mode around dynamic sampling); no reference (DAPO has none), old log-probs computed."""
    run_dir, _ = dapo_runs
    for m in read_metrics(run_dir):
        assert m["timeline/resharding_enter_infer/end"] <= m["timeline/rollout/start"]
        assert m["timeline/rollout/end"] <= m["timeline/resharding_exit_infer/start"]
        assert m["timeline/resharding_exit_infer/end"] <= m["timeline/old_log_p/start"]
        assert m["timing/reference_model"] == m["timing/ref_onload"] == 0 and m["timing/old_log_p"] > 0
        assert m["world_size"] == 1  # integrated: the actor's one device, shared


# Soak: a second `up` (~40 s); CI resumes in tests/reliability/test_crash_resume_short.py. Runs after the tests above
# have read the first run (the module's last test, as it adds iteration 3 to the run).
@pytest.mark.slow
def test_the_resumed_run_continues_the_cursor_exactly(dapo_runs: tuple, repo_root: Path, boxed_model_dir: Path,
                                                      split_prefix: Path) -> None:
    run_dir, _ = dapo_runs
    ckpt = run_dir / "ckpt"
    resumed = run_dapo(repo_root, boxed_model_dir, split_prefix, run_dir, "--resume",
                       "-o", "megatron_training.train_iters=3", "-o", "actor_config.finetune=false",
                       "-o", f"actor_config.load={ckpt}", "-o", "actor_config.no_load_optim=false",
                       "-o", "actor_config.no_load_rng=false")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    details = journal_details(run_dir)
    assert sorted(details) == [1, 2, 3]
    # Every generation batch is consumed once: each iteration starts where the previous one stopped, across
    # the resume (iteration 3 runs in a new coordinator, from the checkpoint of iteration 2).
    consumed = [b for it in sorted(details) for b in details[it]["batches"]]
    assert consumed == list(range(len(consumed)))
    m = {int(x["iteration"]): x for x in read_metrics(run_dir)}
    assert m[3]["data/batch_index"] == m[2]["data/consumed_batches"]
    ckpt = run_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
