"""One rank of a MoE trainer group for test_moe_checkpoint.py: checkpoints saved at one expert-parallel size load at
another (same processes, Megatron's groups rebuilt in between; TP 1, PP 1, two ranks).

The steps, each asserted on every rank (a failed assertion exits non-zero: run_ranks reports it):
1. EP 2: the tiny Qwen3-MoE with the HF weights (this rank's experts), saved to {work}/ep2 with an optimizer stand-in
   whose state is a function of each parameter (exp_avg = 2 * weight), so where every entry lands is checkable.
2. EP 2 again: a fresh model loads it; weights and optimizer entries are this rank's own.
3. EP 1 (DP 2): a fresh model loads the EP 2 checkpoint; rank 0's weights, converted to HF, are the HF weights
   bitwise, and every optimizer entry sits with its parameter (experts renumbered); saved to {work}/ep1.
4. EP 2: the EP 1 checkpoint loads; the weights are this rank's experts of the HF model.
5. EP 2: an optimizer that gives a writing rank no state fails the save on every rank, naming the cause.
6. EP 2 with the trainer's own optimizer after one Adam step (each DP rank its own tokens), saved to {work}/adam;
   EP 1 loads it into a fresh optimizer, whose state_dict rank 0 writes to {work}/adam_ep1.pt for the test to
   compare with the EP 2 files.

Usage: python tests/trainer/moe_checkpoint_checks.py --rank R --world 2 --port P --hf DIR --work DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from trainer_helpers import rank_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class StateStandIn:
    """What checkpoint.py asks of an optimizer: state_dict on every writing rank, load_state_dict, reload."""

    def __init__(self, model, *, give_state: bool = True) -> None:
        self.model, self.give_state, self.loaded = model, give_state, None

    def state_dict(self) -> dict | None:
        from services.trainer.model import canonical_state_dict

        if not self.give_state:
            return None
        params = {n: {"exp_avg": 2 * t.detach().clone()} for n, t in canonical_state_dict(self.model).items()}
        return {"format": "stand-in", "step": 1, "param_groups": [], "params": params}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state

    def reload_model_params(self) -> None:
        pass


def fresh_model(spec):
    """A model in the current groups, zeroed (a load must set every weight)."""
    from services.trainer.model import build_gpt_model

    model = build_gpt_model(spec, tp=1, pp=1)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def build(spec, ep: int):
    from services.trainer import parallel

    return parallel.init_model_parallel(1, 1, seed=1, ep=ep), fresh_model(spec)


def own_hf_weights(model, spec, hf: dict, layout) -> None:
    from services.trainer import checkpoint, convert

    key = (0, 0, layout.ep_rank)
    shards = convert.hf_to_mcore(hf, spec, 1, 1, only=key, ep=layout.ep)
    checkpoint._load_model_state(model, shards[key], Path("hf"))


def check_same(model, expected: dict[str, torch.Tensor], what: str) -> None:
    from services.trainer.model import canonical_state_dict

    got = canonical_state_dict(model)
    assert set(got) == set(expected), f"{what}: names differ"
    bad = [n for n in got if not torch.equal(got[n], expected[n])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def check_optimizer_follows(model, opt: StateStandIn, what: str) -> None:
    from services.trainer.model import canonical_state_dict

    assert opt.loaded is not None and opt.loaded["step"] == 1, f"{what}: no optimizer state loaded"
    params = opt.loaded["params"]
    own = canonical_state_dict(model)
    assert set(params) == set(own), f"{what}: optimizer names {sorted(set(params) ^ set(own))[:4]} differ"
    bad = [n for n, t in own.items() if not torch.equal(params[n]["exp_avg"], 2 * t)]
    assert not bad, f"{what}: optimizer entries of {bad[:3]} belong to other parameters"


def main() -> int:
    ap = rank_arguments()
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps

    from services.common.model_spec import read_hf_config
    from services.trainer import checkpoint, convert, parallel
    from services.trainer.model import canonical_state_dict

    spec, raw = read_hf_config(a.hf)
    hf = convert.load_hf_state(a.hf)
    work = Path(a.work)
    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)

    # 1. EP 2: save.
    layout, model = build(spec, 2)
    own_hf_weights(model, spec, hf, layout)
    ep2_weights = {n: t.clone() for n, t in canonical_state_dict(model).items()}
    checkpoint.save_checkpoint(work / "ep2", 3, model=model, optimizer=StateStandIn(model), consumed_samples=12,
                               hf_config=raw)
    # 2. EP 2: load.
    model = fresh_model(spec)
    opt = StateStandIn(model)
    res = checkpoint.load_checkpoint(work / "ep2", model=model, optimizer=opt)
    assert (res.iteration, res.consumed_samples, res.loaded_optimizer) == (3, 12, True), res
    check_same(model, ep2_weights, "EP 2 -> EP 2")
    check_optimizer_follows(model, opt, "EP 2 -> EP 2")
    ps.destroy_model_parallel()

    # 3. EP 1: load the EP 2 checkpoint, save.
    layout, model = build(spec, 1)
    opt = StateStandIn(model)
    res = checkpoint.load_checkpoint(work / "ep2", model=model, optimizer=opt)
    assert (res.iteration, res.consumed_samples) == (3, 12), res
    back = convert.mcore_to_hf({(0, 0, 0): canonical_state_dict(model)}, spec, 1, 1)
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf), "EP 2 -> EP 1: not the HF weights"
    check_optimizer_follows(model, opt, "EP 2 -> EP 1")
    checkpoint.save_checkpoint(work / "ep1", 5, model=model, optimizer=StateStandIn(model), hf_config=raw)
    ps.destroy_model_parallel()

    # 4. EP 2: load the EP 1 checkpoint.
    layout, model = build(spec, 2)
    opt = StateStandIn(model)
    checkpoint.load_checkpoint(work / "ep1", model=model, optimizer=opt)
    check_same(model, ep2_weights, "EP 1 -> EP 2")
    check_optimizer_follows(model, opt, "EP 1 -> EP 2")

    # 5. EP 2: an optimizer without state on a writing rank fails the save everywhere.
    try:
        checkpoint.save_checkpoint(work / "refused", 7, model=model, optimizer=StateStandIn(model, give_state=a.rank == 0))
    except ValueError as e:
        assert "no state on the rank writing expert-parallel rank 1's checkpoint file" in str(e), e
    else:
        raise AssertionError("a save without the experts' optimizer state went through")
    ps.destroy_model_parallel()

    # 6. The trainer's optimizer: one step at EP 2, resumed at EP 1.
    from services.trainer.model import model_forward
    from services.trainer.optimizer import OptimizerOptions, build_optimizer

    layout, model = build(spec, 2)
    own_hf_weights(model, spec, hf, layout)
    opt, scheduler = build_optimizer(model, OptimizerOptions(lr=1e-2))
    opt.zero_grad()
    ids = (torch.arange(8) * 37 + 11 * (a.rank + 1)).reshape(1, -1) % spec.vocab_size
    model_forward(model, ids).float().pow(2).mean().backward()
    opt.step(clip_grad=1.0)
    checkpoint.save_checkpoint(work / "adam", 1, model=model, optimizer=opt, scheduler=scheduler, hf_config=raw)
    ps.destroy_model_parallel()
    layout, model = build(spec, 1)
    opt, scheduler = build_optimizer(model, OptimizerOptions(lr=1e-2))
    res = checkpoint.load_checkpoint(work / "adam", model=model, optimizer=opt, scheduler=scheduler)
    assert res.loaded_optimizer, res
    state = opt.state_dict()
    if a.rank == 0:
        torch.save({"optimizer": state, "model": canonical_state_dict(model)}, work / "adam_ep1.pt")
    ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
