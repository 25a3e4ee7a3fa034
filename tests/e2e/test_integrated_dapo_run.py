"""Integrated mode and DAPO dynamic sampling through the real CLI: `rlfabric up`, then `--resume`.

One run (two iterations, then a resumed third) covers both, to keep the suite fast:
- integrated (all-shared-device) mode with every `offload_train_*` key on and a reference model (an explicit
  `init_kl_coef`), and two optimizer steps per iteration (so old log-probs are computed): every timing the seed
  lists for that mode is measured, and the trainer's and rollout's resident memory falls while they sleep;
- DAPO dynamic sampling. The reward signal is built so that which groups survive is known in advance: the tiny
  model is fine-tuned for a few seconds to answer every prompt with `\\boxed{1}` or `\\boxed{2}` at random,
  and the prompts' labels are "1" (even rows: the group's `math_17k_acc` scores vary, it is kept) or "999"
  (odd rows: every sample scores 0, no spread, the group is dropped). So every trained group must come from an
  even row, and generation must go on past a prompt batch until `filter_groups_train_batch_size` groups are kept.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MIB = 1 << 20
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
    for _ in range(80):
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
    prefix = root / "data" / "split"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "preprocess", "configs/datasets/deepscaler.yaml",
         "--set", f"input={root / 'rows.jsonl'}", "--set", f"tokenizer_name_or_path={boxed_model_dir}",
         "--set", f"output_prefix={prefix}", "--set", "prompt_type=empty", "--set", "workers=1", "--quiet"],
        cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return prefix


def run_dapo(repo_root: Path, model: Path, prefix: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "services.cli", "up", "configs/grpo_tiny_cpu.yaml",
            "-o", f"megatron_training.tokenizer_name_or_path={model}",
            "-o", f"megatron_training.data_path={prefix}",
            "-o", f"actor_config.load={model}", "-o", f"actor_config.save={run_dir / 'ckpt'}",
            "-o", "megatron_training.stage=ray_dapo", "-o", "rl_config.init_kl_coef=0.001",
            "-o", f"megatron_training.global_batch_size={GBS}", "-o", f"rl_config.mini_batch_size={GBS // 2}",
            "-o", "rl_config.use_integrated_worker=true", "-o", "generate_config.offload_train_param=true",
            "-o", "generate_config.offload_train_grad=true", "-o", "generate_config.offload_train_optimizer=true",
            "-o", "rl_config.filter_groups_enable=true", "-o", "rl_config.filter_groups_metric=math_17k_acc",
            "-o", "rl_config.filter_groups_max_batches=-1",
            "-o", f"rl_config.filter_groups_train_batch_size={TARGET}",
            "-o", "generate_config.sampling_config.max_tokens=16",
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
    run_dir = tmp_path_factory.mktemp("dapo_run")
    first = run_dapo(repo_root, boxed_model_dir, split_prefix, run_dir, "-o", "megatron_training.train_iters=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ckpt = run_dir / "ckpt"
    resumed = run_dapo(repo_root, boxed_model_dir, split_prefix, run_dir, "--resume",
                       "-o", "megatron_training.train_iters=3", "-o", "actor_config.finetune=false",
                       "-o", f"actor_config.load={ckpt}", "-o", "actor_config.no_load_optim=false",
                       "-o", "actor_config.no_load_rng=false",
                       # The reference keeps loading the ORIGINAL weights, not the trained actor's checkpoint.
                       "-o", f"rl_config.integrated_mode_config.ref_model_load_path={boxed_model_dir}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return run_dir, journal_details(run_dir)


def test_zero_variance_groups_are_dropped_and_generation_goes_on_until_the_target(dapo_runs: tuple) -> None:
    run_dir, details = dapo_runs
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert sorted(details) == [1, 2, 3]
    for m in metrics:
        ids = details[int(m["iteration"])]["trained_groups"]
        assert len(ids) == TARGET and m["dapo/num_groups_trained"] == TARGET
        # Only answerable (even) rows can have a spread; an odd row trained would be a zero-variance group.
        assert all(int(g.rsplit("/p", 1)[1]) % 2 == 0 for g in ids), ids
        assert m["dapo/num_groups_kept"] >= TARGET
        assert m["dapo/num_groups_generated"] == GBS * m["train/num_gen_batches"] >= m["dapo/num_groups_kept"]
        assert m["global_batch_size"] == TARGET
    # Half the rows are unanswerable: over three iterations, groups were dropped and more batches generated.
    assert sum(m["dapo/num_groups_generated"] - m["dapo/num_groups_kept"] for m in metrics) > 0
    assert sum(m["train/num_gen_batches"] for m in metrics) > len(metrics)


def test_no_group_trains_twice_and_each_comes_from_its_own_iterations_batches(dapo_runs: tuple) -> None:
    run_dir, details = dapo_runs
    metrics = {int(m["iteration"]): m for m in read_metrics(run_dir)}
    every = [g for d in details.values() for g in d["trained_groups"]]
    assert len(every) == len(set(every)) == 3 * TARGET
    for it, d in details.items():
        m = metrics[it]
        first, consumed = int(m["data/batch_index"]), int(m["data/consumed_batches"])
        assert d["batches"] == list(range(first, consumed)) and len(d["batches"]) == m["train/num_gen_batches"]
        for g in d["trained_groups"]:  # it{iteration}/b{batch}/p{prompt}
            g_it, g_batch, _ = g.split("/")
            assert g_it == f"it{it}" and int(g_batch[1:]) in d["batches"]


def test_the_resumed_run_continues_the_cursor_exactly(dapo_runs: tuple) -> None:
    run_dir, details = dapo_runs
    # Every generation batch is consumed once: each iteration starts where the previous one stopped, across
    # the resume (iteration 3 runs in a new coordinator, from the checkpoint of iteration 2).
    consumed = [b for it in sorted(details) for b in details[it]["batches"]]
    assert consumed == list(range(len(consumed)))
    m = {int(x["iteration"]): x for x in read_metrics(run_dir)}
    assert m[3]["data/batch_index"] == m[2]["data/consumed_batches"]
    ckpt = run_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


# Timings the seed's table lists that must have run in this configuration (integrated, with a reference, old
# log-probs computed); no reward model, so its two are 0; the non-overlap ones may legitimately be 0.
RUN_TIMINGS = ["timing/all", "timing/update", "timing/rollout", "timing/old_log_p", "timing/reference_model",
               "timing/resharding_to_train", "timing/resharding_to_infer", "timing/adv", "timing/rule_reward",
               "timing/ref_onload", "timing/ref_offload"]


def test_integrated_mode_measures_every_timing_of_the_seed(dapo_runs: tuple) -> None:
    run_dir, _ = dapo_runs
    for m in read_metrics(run_dir):
        assert all(m[k] > 0 for k in RUN_TIMINGS), {k: m[k] for k in RUN_TIMINGS}
        assert m["timing/reward_model"] == 0 and m["timing/non_overlap_reward_model"] == 0
        # The seed: in the all-shared-device mode these phases run one after another.
        serial = sum(m[f"timing/{k}"] for k in ("rollout", "old_log_p", "update", "reference_model",
                                                "resharding_to_train", "resharding_to_infer"))
        assert m["timing/all"] >= serial + max(m["timing/non_overlap_rule_reward"],
                                               m["timing/non_overlap_reference_model"])
        # The transitions happen in upstream's order: wake/sync/offload, generate, sleep, the reference between
        # its onload and offload, then the actor's old log-probs, its onload, update, offload.
        order = ["resharding_enter_infer", "rollout", "resharding_exit_infer", "ref_onload", "reference_model",
                 "ref_offload", "old_log_p", "resharding_enter_train", "update", "resharding_exit_train"]
        ends = [m[f"timeline/{p}/end"] for p in order]
        starts = [m[f"timeline/{p}/start"] for p in order]
        assert all(e <= s for e, s in zip(ends, starts[1:], strict=False)), dict(zip(order, zip(starts, ends,
                                                                                            strict=True), strict=True))


def test_integrated_mode_frees_memory_while_a_service_sleeps(dapo_runs: tuple) -> None:
    """Resident set sizes the services report: the rollout drops its 1 GiB CPU KV cache while asleep, the actor
    writes out its weights, gradients and Adam moments (16 MiB for the tiny model) while the rollout runs.
    Margins from several runs: the rollout fell by 0.97-0.98 GiB; the actor by 20-32 MiB here (130-170 MiB with
    a batch of 8 prompts: the heap the passes freed is returned with the state)."""
    run_dir, _ = dapo_runs
    for m in read_metrics(run_dir):
        assert m["memory/rollout/resident_bytes_awake"] - m["memory/rollout/resident_bytes_asleep"] > 512 * MIB
        assert m["memory/actor/resident_bytes_onloaded"] - m["memory/actor/resident_bytes_offloaded"] > 8 * MIB
