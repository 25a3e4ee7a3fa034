"""Writes the verl parity fixtures: verl's own functions run on fixed float64 inputs, the inputs and the outputs
stored exactly (float.hex) for tests/coordinator/test_advantages_verl.py and tests/trainer/test_loss_verl.py.

    MKL_CBWR=AVX2,STRICT python -m tests.verl_expected --verl /path/to/checkout  # github.com/volcengine/verl

The fixtures were made from verl commit b178a3cd56f58b2d502255daba591e92833930a7 (VERL_COMMIT). verl is imported
from the checkout's source without installing it: its heavy imports (ray, tensordict, omegaconf, its worker
configs), which the functions used here never call, are replaced by empty modules. Nothing of verl is copied:
the functions run from the checkout and only their outputs are stored.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

from services.common.determinism import MKL_BATCH_INVARIANT

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
HERE = Path(__file__).resolve().parent
ADVANTAGES = HERE / "coordinator" / "verl_advantages.json"
LOSSES = HERE / "trainer" / "verl_losses.json"
_STUB_ROOTS = ("omegaconf", "tensordict", "ray", "hydra", "codetiming", "pydantic", "torchdata", "datasets", "peft",
               "wandb", "accelerate", "flash_attn", "liger_kernel")
_STUB_PATHS = ("verl.workers", "verl.utils.model")


def hexes(t) -> list:
    """A float64 array (any shape) as nested lists of float.hex strings: exact in JSON."""
    return _hex_nested(np.asarray(t, dtype=np.float64).tolist())


def _hex_nested(v):
    return [_hex_nested(x) for x in v] if isinstance(v, list) else float(v).hex()


def unhex(v) -> np.ndarray:
    """Inverse of `hexes`."""
    def walk(x):
        return [walk(y) for y in x] if isinstance(x, list) else float.fromhex(x)
    return np.asarray(walk(v), dtype=np.float64)


# ----------------------------------------------------------------------------- importing verl from a checkout


class _Anything(type):
    """Stands for any name of a stubbed module: usable as a type, a decorator, a base or in `X | Y`."""

    def __getattr__(cls, name):
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __getitem__(cls, item):
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        stubbed = fullname.split(".")[0] in _STUB_ROOTS or any(
            fullname == p or fullname.startswith(p + ".") for p in _STUB_PATHS)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True) if stubbed else None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def import_verl(checkout: Path):
    """(core_algos, rollout_corr_helper) of the verl checkout, without running verl/__init__.py."""
    package = types.ModuleType("verl")
    package.__path__ = [str(checkout / "verl")]
    sys.modules["verl"] = package
    sys.meta_path.insert(0, _StubFinder())
    return (importlib.import_module("verl.trainer.ppo.core_algos"),
            importlib.import_module("verl.trainer.ppo.rollout_corr_helper"))


class ActorCfg(dict):
    """The fields of verl's ActorConfig its policy losses read; global_batch_info empty = one micro-batch."""

    def __init__(self, clip_ratio: float, clip_ratio_low: float, clip_ratio_high: float):
        super().__init__(clip_ratio_c=3.0)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = clip_ratio, clip_ratio_low, clip_ratio_high
        self.global_batch_info: dict = {}


# ----------------------------------------------------------------------------- inputs


def outcome_layout(rewards: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's token_level_rewards and response_mask `[B, max(lengths)]`: the reward on each response's last token."""
    width = int(lengths.max())
    scores = torch.zeros(len(rewards), width, dtype=torch.float64)
    mask = torch.zeros(len(rewards), width, dtype=torch.float64)
    for i, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        mask[i, :n] = 1.0
        scores[i, n - 1] = r
    return scores, mask


def advantage_cases() -> list[dict]:
    rng = np.random.default_rng(27)
    cases = [("normal_n5", rng.normal(size=40), 5),
             ("binary_n8_with_constant_groups", np.r_[np.ones(8), np.zeros(8), rng.integers(0, 2, 16)], 8),
             ("uniform_n3", rng.uniform(-1, 2, size=18), 3),
             ("normal_n16", rng.normal(size=32), 16)]
    return [{"name": name, "n": n, "rewards": r.astype(np.float64), "lengths": rng.integers(1, 50, size=len(r))}
            for name, r, n in cases]


def loss_inputs(seed: int, batch: int = 6, width: int = 9, spread: float = 0.25) -> dict[str, np.ndarray]:
    """Log-probs of a policy, an old one and a rollout engine near it, a ragged mask, advantages per sample."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.rand(batch, width, generator=g, dtype=torch.float64).mul(-3.0)
    old = logp + spread * torch.randn(batch, width, generator=g, dtype=torch.float64)
    rollout = old + 2 * spread * torch.randn(batch, width, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    lengths[0] = width
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    return {"log_probs": logp.numpy(), "old_log_probs": old.numpy(), "rollout_log_probs": rollout.numpy(),
            "mask": mask.numpy(), "advantages": adv.numpy()}


# ----------------------------------------------------------------------------- verl's outputs


def verl_advantages(core) -> list[dict]:
    out = []
    for case in advantage_cases():
        rewards, n, lengths = case["rewards"], case["n"], case["lengths"]
        index = np.repeat(np.arange(len(rewards) // n), n)
        scores, mask = outcome_layout(rewards, lengths)
        gamma1 = type("AlgoCfg", (), {"gamma": 1.0})()
        runs = {
            "dr_grpo": core.compute_grpo_outcome_advantage(scores, mask, index, norm_adv_by_std_in_grpo=False)[0],
            "rloo": core.compute_rloo_outcome_advantage(scores, mask, index)[0],
            "reinforce_plus_plus": core.compute_reinforce_plus_plus_outcome_advantage(scores, mask, config=gamma1)[0],
            "reinforce_plus_plus_baseline":
                core.compute_reinforce_plus_plus_baseline_outcome_advantage(scores, mask, index)[0],
        }
        # Every verl estimator here puts one value on all of a response's tokens: store it per sample.
        for name, adv in runs.items():
            assert torch.equal(adv, adv[:, :1] * mask), name
        out.append({"name": case["name"], "n": n, "rewards": hexes(rewards), "lengths": case["lengths"].tolist(),
                    "expected": {name: hexes(adv[:, 0]) for name, adv in runs.items()}})
    return out


LOSS_CASES = [  # (name, policy loss, loss_agg_mode, rollout_is, rollout_is_threshold, rollout_rs, rs threshold)
    ("vanilla_token_mean", "vanilla", "token-mean", None, None, None, None),
    ("vanilla_seq_mean_token_mean", "vanilla", "seq-mean-token-mean", None, None, None, None),
    ("vanilla_seq_mean_token_sum", "vanilla", "seq-mean-token-sum", None, None, None, None),
    ("dr_grpo_seq_mean_token_sum_norm", "vanilla", "seq-mean-token-sum-norm", None, None, None, None),
    ("gspo", "gspo", "seq-mean-token-mean", None, None, None, None),
    ("tis_token", "vanilla", "token-mean", "token", 1.5, None, None),
    ("tis_sequence", "vanilla", "token-mean", "sequence", 1.2, None, None),
    ("mis_token_k1", "vanilla", "token-mean", None, None, "token_k1", "0.6_2.0"),
    ("mis_seq_mean_k3_and_tis", "vanilla", "token-mean", "token", 2.0, "seq_mean_k3", 0.15),
    ("mis_seq_sum_k2_max_k3", "gspo", "seq-mean-token-mean", "sequence", 3.0, "seq_sum_k2,seq_max_k3", "1.0,0.6"),
    ("mis_rejects_whole_rows", "vanilla", "seq-mean-token-mean", None, None, "seq_max_k2", 0.3),
    ("mis_k1_upper_only_seq_sum", "vanilla", "seq-mean-token-sum", "token", 1.8, "seq_sum_k1", 3.0),
]
CLIP = (0.2, 0.2, 0.28)  # clip_ratio, clip_ratio_low, clip_ratio_high


def verl_losses(core, corr) -> list[dict]:
    out = []
    for seed, (name, mode, agg, is_level, is_thr, rs, rs_thr) in enumerate(LOSS_CASES):
        x = loss_inputs(seed)
        logp = torch.tensor(x["log_probs"], requires_grad=True)
        old, rollout, mask = (torch.tensor(x[k]) for k in ("old_log_probs", "rollout_log_probs", "mask"))
        adv = torch.tensor(x["advantages"]).unsqueeze(-1) * mask  # verl's token-level advantages
        log_ratio = old - rollout  # verl's decoupled mode: pi_old / pi_rollout
        weights, kept, rs_metrics = None, mask, {}
        if is_level is not None:
            weights, _ = corr.compute_rollout_correction_weights(log_ratio, mask, is_level, is_thr)
        if rs is not None:
            kept, rs_metrics = corr.compute_rollout_rejection_mask(log_ratio, mask, rs, rs_thr)
        cfg = ActorCfg(*CLIP)
        core.ActorConfig = ActorCfg  # verl's GSPO checks isinstance(config, ActorConfig)
        fn = core.compute_policy_loss_gspo if mode == "gspo" else core.compute_policy_loss_vanilla
        loss, metrics = fn(old, logp, adv, kept, loss_agg_mode=agg, config=cfg, rollout_is_weights=weights)
        loss.backward()
        out.append({
            "name": name, "policy_loss_mode": mode, "loss_agg_mode": agg, "rollout_is": is_level,
            "rollout_is_threshold": is_thr, "rollout_rs": rs, "rollout_rs_threshold": rs_thr,
            "clip": list(CLIP), "inputs": {k: hexes(v) for k, v in x.items()},
            "expected": {"loss": loss.item().hex(), "grad": hexes(logp.grad), "mask": hexes(kept),
                         "weights": None if weights is None else hexes(weights),
                         "pg_clipfrac": float(metrics["actor/pg_clipfrac"]).hex(),
                         "ppo_kl": float(metrics["actor/ppo_kl"]).hex(),
                         "rs_masked_fraction": rs_metrics.get("rollout_rs_masked_fraction")},
        })
    return out


PINNED_MKL = f"MKL_CBWR={MKL_BATCH_INVARIANT['MKL_CBWR']}"


def require_pinned_mkl(parser: argparse.ArgumentParser) -> None:
    """The fixtures are made on the MKL code path the test process pins (tests/conftest.py): AVX-512's exp, log and
    matmul differ from it in the last bit."""
    if os.environ.get("MKL_CBWR") != MKL_BATCH_INVARIANT["MKL_CBWR"]:
        parser.error(f"run with {PINNED_MKL}: the tests compare on that MKL code path")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", type=Path, required=True, help="a checkout of github.com/volcengine/verl")
    args = parser.parse_args(argv)
    require_pinned_mkl(parser)
    core, corr = import_verl(args.verl.resolve())
    torch.set_num_threads(1)
    header = {"verl_commit": VERL_COMMIT, "made_by": f"{PINNED_MKL} python -m tests.verl_expected --verl <checkout>"}
    ADVANTAGES.write_text(json.dumps({**header, "cases": verl_advantages(core)}, indent=1) + "\n")
    LOSSES.write_text(json.dumps({**header, "cases": verl_losses(core, corr)}, indent=1) + "\n")
    print(f"wrote {ADVANTAGES} and {LOSSES}")


if __name__ == "__main__":
    main()
