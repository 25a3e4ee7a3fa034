"""Checkpoints of an expert-parallel trainer (tests/trainer/moe_checkpoint_checks.py, two gloo ranks): saved at EP 2
they load at EP 2 and at EP 1 (and back) with the same weights and every optimizer entry beside its parameter (the
trainer's own Adam state after a step at EP 2 too), and `convert_mcore_to_hf` turns the EP 2 checkpoint into the HF
weights bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import run_ranks


@pytest.fixture(scope="module")
def saved(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The work folder once every step of moe_checkpoint_checks.py passed on both ranks."""
    work = tmp_path_factory.mktemp("moe_ckpt")
    run_ranks("moe_checkpoint_checks.py", 2, ["--hf", str(tiny_moe_dir), "--work", str(work)], timeout_s=300)
    return work


def test_ep2_checkpoint_has_one_folder_per_expert_rank(saved: Path) -> None:
    from services.trainer import ckpt_layout

    iter_dir = saved / "ep2" / "iter_0000003"
    assert sorted(p.name for p in iter_dir.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert ckpt_layout.detect_tp_pp_ep(iter_dir) == (1, 1, 2)
    files = [torch.load(ckpt_layout.shard_path(iter_dir, 0, 0, 1, e, 2), weights_only=False) for e in (0, 1)]
    for e, payload in enumerate(files):
        assert payload["rlfabric"]["expert_model_parallel_size"] == 2 and payload["args"].iteration == 3
        experts = {k.split(".local_experts.")[1].split(".")[0] for k in payload["model"] if ".local_experts." in k}
        assert experts == {"0", "1", "2", "3"}, e
        assert set(payload["optimizer"]["params"]) == set(payload["model"])
    # EP rank 1 holds experts 4..7: local expert 0 of rank 1 is not local expert 0 of rank 0.
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    assert not torch.equal(files[0]["model"][name], files[1]["model"][name])
    shared = "decoder.layers.0.mlp.router.weight"
    assert torch.equal(files[0]["model"][shared], files[1]["model"][shared])
    assert ckpt_layout.detect_tp_pp_ep(saved / "ep1" / "iter_0000005") == (1, 1, 1)
    assert not (saved / "refused").exists()  # the refused save wrote nothing


def test_mcore2hf_of_the_ep2_checkpoint_is_the_hf_model_bitwise(saved: Path, tiny_moe_dir: Path) -> None:
    from services.trainer.convert import convert_mcore_to_hf, load_hf_state

    out = convert_mcore_to_hf(saved / "ep2", saved / "hf", hf_assets=tiny_moe_dir)
    got, expected = load_hf_state(out), load_hf_state(tiny_moe_dir)
    assert set(got) == set(expected) and any(".mlp.experts.7." in n for n in got)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_adam_state_saved_at_ep2_resumes_at_ep1(saved: Path) -> None:
    """Each expert's moments come back from the EP rank's file that holds it (expert X: file X // 4, local X % 4);
    the shared weights' moments from EP rank 0's file."""
    from services.trainer import ckpt_layout

    iter_dir = saved / "adam" / "iter_0000001"
    files = [torch.load(ckpt_layout.shard_path(iter_dir, 0, 0, 1, e, 2), weights_only=False) for e in (0, 1)]
    resumed = torch.load(saved / "adam_ep1.pt", weights_only=False)
    state = resumed["optimizer"]
    assert state["step"] == files[0]["optimizer"]["step"] == 1
    params = state["params"]
    assert set(params) == set(resumed["model"]) and len(params) > 40
    expert_names = 0
    for name, entry in params.items():
        saved_name, e = name, 0
        if ".local_experts." in name:
            head, tail = name.split(".local_experts.")
            x, rest = tail.split(".", 1)
            e, saved_name = int(x) // 4, f"{head}.local_experts.{int(x) % 4}.{rest}"
            expert_names += 1
        expected = files[e]["optimizer"]["params"][saved_name]
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[kind], expected[kind]), (name, kind)
        assert torch.equal(resumed["model"][name], files[e]["model"][saved_name]), name
    assert expert_names == 2 * 8 * 2  # layers x experts x (fc1, fc2)
    moved = files[1]["optimizer"]["params"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert moved["exp_avg"].abs().sum() > 0  # EP rank 1's experts took a step
