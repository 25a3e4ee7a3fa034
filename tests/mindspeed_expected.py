"""Writes the MindSpeed-RL PPO parity fixtures: MindSpeed-RL's own functions run on fixed float64 inputs, the inputs
and the outputs stored exactly (float.hex) for tests/coordinator/test_gae.py and tests/trainer/test_value_loss.py.

    git -C <MindSpeed-RL clone> archive <commit> mindspeed_rl | tar -x -C /tmp/msrl
    MKL_CBWR=AVX2,STRICT python -m tests.mindspeed_expected --mindspeed /tmp/msrl --verl /path/to/verl-checkout

The fixtures were made from MindSpeed-RL commit 05a90d77cb6cfad8999e2aee21068284db959579 (MINDSPEED_COMMIT) and verl
commit b178a3cd56f58b2d502255daba591e92833930a7 (tests/verl_expected.VERL_COMMIT). MindSpeed-RL is imported from the
exported source without installing it, its heavy imports (ray, torch_npu, tensordict, megatron, ...) replaced by
empty modules. The PPO advantage stage runs end to end as MindSpeed-RL's driver runs it: `apply_kl_penalty` and
`compute_advantage` (both ray tasks, called here as plain functions) read their columns from a stand-in for the
transfer dock and write their results back to it, so the fixture holds what upstream's padding, rule-reward placement,
KL penalty, GAE, whitening and truncation produce together. The critic loss is
`CriticLossFunc._compute_value_loss` with the int64 response mask upstream's `generate_mask` builds. verl's
`compute_gae_advantage_return` and `compute_value_loss` run on the same inputs as a second, recorded reference
(rlfabric follows MindSpeed-RL where the two differ). Nothing of either project is copied: the functions run from
the checkouts and only their outputs are stored.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch

from tests.verl_expected import PINNED_MKL, VERL_COMMIT, _StubFinder, hexes, import_verl, require_pinned_mkl

MINDSPEED_COMMIT = "05a90d77cb6cfad8999e2aee21068284db959579"
HERE = Path(__file__).resolve().parent
PPO = HERE / "coordinator" / "mindspeed_ppo.json"
VALUE_LOSS = HERE / "trainer" / "mindspeed_value_loss.json"
_MS_STUB_ROOTS = ("ray", "torch_npu", "omegaconf", "tensordict", "megatron", "mindspeed", "transformers", "vllm",
                  "hydra", "codetiming", "wandb", "swanlab", "datasets", "acl")


class _MindSpeedStubs(_StubFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _MS_STUB_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None


def import_mindspeed(export: Path):
    """(compute_utils, critic_loss_func, compute, utils) of the exported source, without running any package's
    __init__.py (they import every trainer and worker)."""
    root = export / "mindspeed_rl"
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        name = ".".join(("mindspeed_rl", *folder.relative_to(root).parts))
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    sys.meta_path.insert(0, _MindSpeedStubs())
    importlib.import_module("ray").get = lambda ref: ref  # the stand-in dock answers directly: ray.get is identity
    names = ("trainer.utils.compute_utils", "models.loss.critic_loss_func", "utils.compute", "utils.utils")
    modules = [importlib.import_module(f"mindspeed_rl.{name}") for name in names]
    modules[0].padding_dict_to_tensor_dict = lambda columns: columns  # keep the rows rather than a stubbed TensorDict
    return modules


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class StandInDock:
    """Holds one batch of experience the way the transfer dock hands it out: one tensor per sample per column."""

    def __init__(self, columns: dict[str, list[torch.Tensor]]):
        self.columns = dict(columns)
        self.consumed: set[str] = set()
        self.all_consumed = _Remote(lambda stage: stage in self.consumed)
        self.get_experience = _Remote(self._get)
        self.put_experience = _Remote(self._put)

    def _get(self, stage, names, count, indexes=None):
        self.consumed.add(stage)
        return {name: list(self.columns[name]) for name in names}, list(range(len(self.columns["responses"])))

    def _put(self, data_dict, indexes):
        for name, rows in data_dict.items():
            self.columns[name] = list(rows)


class Tokenizer:
    pad = 0
    eod = 0


# ----------------------------------------------------------------------------- inputs


def ppo_case(seed: int, batch: int, width: int, holes: bool) -> dict[str, np.ndarray]:
    """Ragged responses (row 0 full width), float32-representable rule scores (upstream places each score in a
    float32 tensor), float64 values and log-probs, and for multi-turn cases a response mask with holes (tool tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    lengths[0] = width
    scores = torch.randint(-4, 9, (batch,), generator=g).to(torch.float64) / 8.0
    values = torch.randn(batch, width, generator=g, dtype=torch.float64)
    old = torch.rand(batch, width, generator=g, dtype=torch.float64).mul(-3.0)
    ref = old + 0.3 * torch.randn(batch, width, generator=g, dtype=torch.float64)
    positions = torch.arange(width).unsqueeze(0)
    mask = (positions < lengths.unsqueeze(1)).to(torch.int64)
    if holes:
        tool = torch.rand(batch, width, generator=g) < 0.3
        tool[:, 0] = False
        tool[torch.arange(batch), lengths - 1] = False  # a response ends on a token of the model's own
        mask = mask * (~tool).to(torch.int64)
    outside = positions >= lengths.unsqueeze(1)
    values[outside], old[outside], ref[outside] = 0.0, 0.0, 0.0  # upstream pads float columns with 0.0
    return {"lengths": lengths.numpy(), "scores": scores.numpy(), "values": values.numpy(),
            "old_log_probs": old.numpy(), "ref_log_probs": ref.numpy(), "mask": mask.numpy()}


PPO_CASES = [  # (name, seed, batch, width, holes, gamma, lam, kl_penalty or None (use_kl_in_reward false), kl coef)
    ("ppo_yaml_gamma1_lam1_no_kl", 1, 6, 9, False, 1.0, 1.0, None, 0.0),
    ("gamma_lam_below_1_no_kl", 2, 5, 12, False, 0.99, 0.95, None, 0.0),
    ("kl_in_reward_k1", 3, 7, 8, False, 0.97, 0.9, "kl", 0.05),
    ("kl_in_reward_low_var_kl", 4, 4, 16, False, 1.0, 0.95, "low_var_kl", 0.2),
    ("one_token_responses", 5, 4, 1, False, 0.9, 0.8, None, 0.0),
    ("multi_turn_mask_with_holes", 6, 5, 10, True, 0.95, 0.9, None, 0.0),
    ("multi_turn_holes_kl_in_reward", 7, 6, 11, True, 1.0, 1.0, "mse", 0.1),
]


def _rows(matrix: np.ndarray, lengths: np.ndarray, dtype=torch.float64) -> list[torch.Tensor]:
    return [torch.tensor(matrix[i, :n], dtype=dtype) for i, n in enumerate(lengths)]


def _padded(rows: list[torch.Tensor], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.float64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row.to(torch.float64).numpy()
    return out


def mindspeed_ppo(compute_utils, compute, verl_core) -> list[dict]:
    out = []
    for name, seed, batch, width, holes, gamma, lam, kl_kind, kl_coef in PPO_CASES:
        x = ppo_case(seed, batch, width, holes)
        lengths = x["lengths"]
        columns = {"responses": [torch.ones(int(n), dtype=torch.int64) for n in lengths],
                   "response_length": [torch.tensor([int(n)]) for n in lengths],
                   "rm_scores": [torch.tensor([s], dtype=torch.float64) for s in x["scores"]],
                   "values": _rows(x["values"], lengths),
                   "old_log_prob": _rows(x["old_log_probs"], lengths),
                   "ref_log_prob": _rows(x["ref_log_probs"], lengths)}
        if holes:
            columns["response_mask"] = _rows(x["mask"], lengths, torch.int64)
        dock = StandInDock(columns)
        expected: dict = {}
        if kl_kind is not None:
            controller = _recording_controller(compute_utils, kl_coef)
            compute_utils.apply_kl_penalty(dock, batch, batch, False, Tokenizer(), controller, penalty=kl_kind)
            kld = compute.compute_kl_penalty(torch.tensor(x["old_log_probs"]), torch.tensor(x["ref_log_probs"]),
                                             kl_penalty=kl_kind)
            expected["kld"] = hexes(kld)
            expected["token_level_rewards"] = hexes(_padded(dock.columns["token_level_rewards"], width))
            # the KL measure apply_kl_penalty hands its controller, and the batch size it counts
            assert controller.updates == [(controller.updates[0][0], batch)]
            expected["current_kl"] = float(controller.updates[0][0]).hex()
        compute_utils.compute_advantage(dock, gamma, lam, "gae", batch, Tokenizer(), batch, False, 1,
                                        use_kl_in_reward=kl_kind is not None, multi_turn_enable=holes)
        expected["advantages"] = hexes(_padded(dock.columns["advantages"], width))
        expected["returns"] = hexes(_padded(dock.columns["returns"], width))
        rewards = (torch.tensor(_padded(dock.columns["token_level_rewards"], width)) if kl_kind is not None
                   else _score_matrix(x["scores"], lengths, width))
        v_adv, v_ret = verl_core.compute_gae_advantage_return(rewards, torch.tensor(x["values"]),
                                                              torch.tensor(x["mask"]), gamma, lam)
        out.append({"name": name, "gamma": gamma, "lam": lam, "kl_penalty": kl_kind, "kl_coef": kl_coef,
                    "inputs": {"lengths": lengths.tolist(), "scores": hexes(x["scores"]), "values": hexes(x["values"]),
                               "old_log_probs": hexes(x["old_log_probs"]), "ref_log_probs": hexes(x["ref_log_probs"]),
                               "mask": x["mask"].tolist()},
                    "expected": expected,
                    "verl": {"advantages": hexes(v_adv), "returns": hexes(v_ret)}})
    return out


def _recording_controller(compute_utils, kl_coef: float):
    """Upstream's fixed KL controller, remembering what each update was given."""
    class Recording(compute_utils.FixedKLController):
        def update(self, current_kl, n_steps):
            self.updates.append((current_kl, n_steps))
            super().update(current_kl, n_steps)
    controller = Recording(kl_coef)
    controller.updates = []
    return controller


def _score_matrix(scores: np.ndarray, lengths: np.ndarray, width: int) -> torch.Tensor:
    rewards = torch.zeros(len(scores), width, dtype=torch.float64)
    rewards[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores)
    return rewards


VALUE_CASES = [  # (name, seed, batch, width, holes, cliprange_value)
    ("ppo_yaml_cliprange_0_5", 11, 6, 9, False, 0.5),
    ("cliprange_0_2", 12, 8, 13, False, 0.2),
    ("cliprange_0_05_mostly_clipped", 13, 5, 7, False, 0.05),
    ("one_row", 14, 1, 6, False, 0.3),
    ("one_token_responses", 15, 4, 1, False, 0.2),
    ("multi_turn_mask_with_holes", 16, 5, 10, True, 0.25),
]


def value_case(seed: int, batch: int, width: int, holes: bool) -> dict[str, np.ndarray]:
    x = ppo_case(seed, batch, width, holes)
    g = torch.Generator().manual_seed(seed + 1000)
    returns = torch.tensor(x["values"]) + 0.8 * torch.randn(batch, width, generator=g, dtype=torch.float64)
    vpreds = torch.tensor(x["values"]) + 0.4 * torch.randn(batch, width, generator=g, dtype=torch.float64)
    return {"vpreds": vpreds.numpy(), "returns": returns.numpy(), "values": x["values"], "mask": x["mask"]}


def mindspeed_value_loss(critic, utils, verl_core) -> list[dict]:
    out = []
    for name, seed, batch, width, holes, clip in VALUE_CASES:
        x = value_case(seed, batch, width, holes)
        lengths = torch.tensor(x["mask"]).cumsum(-1).argmax(-1) + 1
        mask = torch.tensor(x["mask"]) if holes else utils.generate_mask(torch.ones(batch, width), lengths)
        assert np.array_equal(mask.numpy(), x["mask"])
        results = {}
        for who, fn in (("expected", critic.CriticLossFunc._compute_value_loss),
                        ("verl", verl_core.compute_value_loss)):
            vpreds = torch.tensor(x["vpreds"], requires_grad=True)
            loss, clipfrac = fn(vpreds, torch.tensor(x["returns"]), torch.tensor(x["values"]), mask, clip)
            loss.backward()
            results[who] = {"loss": loss.item().hex(), "clipfrac": clipfrac.item().hex(),
                            "clipfrac_dtype": str(clipfrac.dtype), "grad": hexes(vpreds.grad)}
        out.append({"name": name, "cliprange_value": clip,
                    "inputs": {k: (v.tolist() if k == "mask" else hexes(v)) for k, v in x.items()}, **results})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mindspeed", type=Path, required=True, help="an export of MindSpeed-RL's mindspeed_rl/")
    parser.add_argument("--verl", type=Path, required=True, help="a checkout of github.com/volcengine/verl")
    args = parser.parse_args(argv)
    require_pinned_mkl(parser)
    torch.set_num_threads(1)
    verl_core, _ = import_verl(args.verl.resolve())
    compute_utils, critic, compute, utils = import_mindspeed(args.mindspeed.resolve())
    header = {"mindspeed_rl_commit": MINDSPEED_COMMIT, "verl_commit": VERL_COMMIT,
              "made_by": f"{PINNED_MKL} python -m tests.mindspeed_expected --mindspeed <export> --verl <checkout>"}
    PPO.write_text(json.dumps({**header, "cases": mindspeed_ppo(compute_utils, compute, verl_core)}, indent=1) + "\n")
    VALUE_LOSS.write_text(json.dumps({**header, "cases": mindspeed_value_loss(critic, utils, verl_core)}, indent=1)
                          + "\n")
    print(f"wrote {PPO} and {VALUE_LOSS}")


if __name__ == "__main__":
    main()
