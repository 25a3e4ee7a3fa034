"""`rlfabric.deterministic`: where the key goes, what it refuses, and the per-process parts
(services/common/determinism.py). The whole-run check is tests/e2e/test_deterministic_run.py."""

from __future__ import annotations

import argparse
import platform
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common import determinism
from services.common.config import ConfigError, load_config
from services.coordinator.settings import settings_from_config
from services.report.seed_metrics import reads_the_clock
from services.rollout.cli import add_serve_arguments, build_options
from services.trainer.options import worker_options_from_config

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "configs" / "grpo_tiny_cpu.yaml"


def test_the_key_reaches_coordinator_trainer_and_rollout(tiny_model_dir: Path) -> None:
    for value in (False, True):
        cfg = load_config(GRPO, overrides=[f"rlfabric.deterministic={str(value).lower()}"])
        assert settings_from_config(cfg).deterministic is value
        assert worker_options_from_config(cfg, "actor")[0].deterministic is value
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        args = parser.parse_args(["--config", str(GRPO), "--model", str(tiny_model_dir),
                                  "--set", f"rlfabric.deterministic={str(value).lower()}"])
        engine, _ = build_options(args)
        assert engine.batch_invariant is value


@pytest.mark.parametrize("overrides, keys", [
    (["generate_config.sampling_config.seed=null"], "generate_config.sampling_config.seed"),
    (["rlfabric.max_staleness=1"], "max_staleness: 0"),
])
def test_refused_where_timing_or_fresh_entropy_decides(overrides: list[str], keys: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(GRPO, overrides=["rlfabric.deterministic=true", *overrides])
    assert "rlfabric.deterministic" in str(e.value) and keys in str(e.value)
    load_config(GRPO, overrides=overrides)  # the same values load without it


def test_host_generators_repeat_after_seeding() -> None:
    def draws() -> tuple:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    determinism.seed_host_rngs(1234)
    first = draws()
    determinism.seed_host_rngs(1234)
    assert draws() == first
    determinism.seed_host_rngs(1235)
    assert draws() != first


def test_batch_invariant_kernels_are_asked_for_on_accelerators_only() -> None:
    assert determinism.batch_invariant_environment(True) == {"VLLM_BATCH_INVARIANT": "1"}
    cpu = determinism.batch_invariant_environment(False)
    assert cpu == ({"MKL_CBWR": "AVX2,STRICT"} if platform.machine() in ("x86_64", "AMD64") else {})


def test_clock_metrics_are_told_apart() -> None:
    assert all(map(reads_the_clock, ("timing/all", "timeline/rollout/end", "e2e_tps", "val/seconds",
                                     "tool/latency_s_mean")))
    assert not any(map(reads_the_clock, ("actor/pg_loss", "grpo/score/mean", "grad_norm", "response_length/mean")))
