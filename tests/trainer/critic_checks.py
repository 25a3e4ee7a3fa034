"""Ranks of a critic trainer group that run the checks of test_critic.py (launched as subprocesses).

Usage: python tests/trainer/critic_checks.py --rank R --world W --port P --hf DIR --work DIR
       [--untied DIR] --layout NAME [--layout NAME ...]
Layouts: `tp1` (world 1: every check), `tp2`, `tp2sp` (sequence parallelism), `dp2` (world 2: values and one update,
compared with tp1's by the test). Rank 0 writes `{work}/critic_{layout}.pt`. The same rows (rank_checks.make_rows) and
the same returns / old values feed every layout, so their numbers are comparable.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_checks import make_rows
from trainer_helpers import rank_arguments

LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "tp2sp": (2, True), "dp2": (1, False)}
STD = 0.02


def main() -> int:
    ap = rank_arguments()
    ap.add_argument("--layout", action="append", required=True, choices=sorted(LAYOUTS))
    ap.add_argument("--untied", default=None, help="an HF folder with untied embeddings (tp1: the frozen output layer)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    for name in a.layout:
        tp, _ = LAYOUTS[name]
        parallel.init_model_parallel(tp, 1, seed=1)
        results = run_all(a) if name == "tp1" else run_layout(a, name)
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"critic_{name}.pt")
        ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


def options(hf: str, *, sp: bool = False, **changes):
    from services.trainer.activation_memory import ActivationMemory
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import WorkerOptions

    # One optimizer step per update (the whole batch), a constant LR large enough to move a tiny model visibly.
    upd = UpdateOptions(micro_batch_size=4, mini_batch_rows=0, epochs=1, seed=3, cliprange_value=0.5)
    optim = OptimizerOptions(lr=2e-4, lr_decay_style="constant", clip_grad=1.0, weight_decay=0.01)
    opts = WorkerOptions(role="critic", hf_dir=hf, finetune=True, forward_micro_batch_size=3, update=upd,
                         optimizer=optim, init_method_std=STD, activation_memory=ActivationMemory(sequence_parallel=sp))
    return dataclasses.replace(opts, **changes)


def experience(rows, seed: int):
    """Fixed returns and old values for `rows` (the same in every layout)."""
    from services.trainer.critic import CriticExperience

    g = torch.Generator().manual_seed(seed)
    returns = torch.randn(rows.num_response_tokens, generator=g)
    old = 0.1 * torch.randn(rows.num_response_tokens, generator=g)
    return CriticExperience(rows, returns, old)


def head_of(worker) -> dict:
    from services.trainer.value_head import value_head

    head = value_head(worker.model)
    return {"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()}


def run_layout(a, name: str) -> dict:
    """Values, then one update on experience(rows, 7), then values again: compared with tp1's by the test."""
    from services.trainer.worker import TrainerWorker

    w = TrainerWorker(options(a.hf, sp=LAYOUTS[name][1]))
    rows = make_rows(w.spec.vocab_size, 1)
    out = {"values": w.compute_values(rows), "head": head_of(w)}
    out["metrics"] = w.update(experience(rows, 7), step=1)
    out["values_after"] = w.compute_values(rows)
    return out


def run_all(a) -> dict:
    out = {"layout": run_layout(a, "tp1")}
    out.update(model_checks(a))
    out.update(training_checks(a))
    out.update(checkpoint_checks(a))
    if a.untied:
        out.update(untied_checks(a))
    return out


def model_checks(a) -> dict:
    """The head in the state dict and the optimizer, the fresh init, values in every micro-batch layout."""
    from services.trainer.critic import compute_values_rows
    from services.trainer.model import canonical_state_dict
    from services.trainer.packing import Packing
    from services.trainer.worker import TrainerWorker

    w = TrainerWorker(options(a.hf))
    rows = make_rows(w.spec.vocab_size, 1)
    out = {"state_keys": sorted(k for k in canonical_state_dict(w.model) if "value_head" in k),
           "optimizer_names": sorted(s.name for s in w.optimizer.slots),
           "head": head_of(w), "head_again": head_of(TrainerWorker(options(a.hf))),
           "rows": (rows.token_ids, rows.prompt_lengths, rows.response_lengths),
           "values": w.compute_values(rows)}
    out["values_packed"] = compute_values_rows(w.model, rows, 3, Packing(remove_padding=True))
    out["values_dynamic"] = compute_values_rows(w.model, rows, 3, Packing(max_tokens=24, key_prefix="critic"))
    with torch.no_grad():  # the model's raw output at one row: [1, S, 1]
        from services.trainer.model import model_forward

        ids = rows.token_ids[: int(rows.prompt_lengths[0] + rows.response_lengths[0])][None]
        out["raw_output_shape"] = tuple(model_forward(w.model.eval(), ids).shape)
    return out


def value_loss_on(worker, exp) -> float:
    from services.trainer.value_loss import value_loss

    v = worker.compute_values(exp.rows)
    return value_loss(v[None], exp.returns[None], exp.values[None], torch.ones(1, v.numel()), 0.5)[0].item()


def training_checks(a) -> dict:
    """Five updates on one fixed batch lower its value loss; what moved."""
    from services.trainer.model import canonical_state_dict
    from services.trainer.worker import TrainerWorker

    w = TrainerWorker(options(a.hf))
    rows = make_rows(w.spec.vocab_size, 1)
    exp = experience(rows, 7)
    before_state = {k: v.clone() for k, v in canonical_state_dict(w.model).items()}
    losses, metrics = [value_loss_on(w, exp)], []
    for step in range(1, 6):
        metrics.append(w.update(exp, step=step))
        losses.append(value_loss_on(w, exp))
    after = canonical_state_dict(w.model)
    return {"losses": losses, "update_metrics": metrics, "weights_version": w.weights_version,
            "moved": sorted(k for k, v in before_state.items() if not torch.equal(v, after[k]))}


def checkpoint_checks(a) -> dict:
    """4 updates straight == 2 + save + resume + 2; an actor's checkpoint and the HF weights give a fresh head."""
    from services.trainer.model import canonical_state_dict
    from services.trainer.value_head import reset_value_head
    from services.trainer.worker import TrainerWorker

    work = Path(a.work)
    opts = options(a.hf)

    def train(worker, steps):
        rows = make_rows(worker.spec.vocab_size, 1)
        for step in steps:
            worker.update(experience(rows, 200 + step), step=step)
            torch.manual_seed(1000 + step)  # RNG consumed between steps must resume too

    straight, first = TrainerWorker(opts), TrainerWorker(opts)
    train(straight, range(1, 5))
    train(first, range(1, 3))
    ckdir = work / "critic_ckpt"
    iter_dir, _, _ = first.save(ckdir, iteration=2)
    saved = torch.load(next(iter_dir.glob("mp_rank_*/model_optim_rng.pt")), weights_only=False)
    rows = make_rows(first.spec.vocab_size, 1)
    resumed = TrainerWorker(dataclasses.replace(opts, load=str(ckdir), finetune=False))
    out = {"saved_head_keys": sorted(k for k in saved["model"] if "value_head" in k),
           "saved_optimizer_has_head": "value_head.weight" in saved["optimizer"]["params"],
           "resumed_iteration": resumed.iteration,
           "resumed_values_equal": torch.equal(first.compute_values(rows), resumed.compute_values(rows))}
    train(resumed, range(3, 5))
    out["resume_max_abs_diff"] = max((p - q).abs().max().item() for p, q in zip(
        straight.model.state_dict().values(), resumed.model.state_dict().values(), strict=True)
        if isinstance(p, torch.Tensor) and p.is_floating_point())

    # The actor's checkpoint (no head) into a critic: the backbone loads, the head starts afresh.
    actor = TrainerWorker(dataclasses.replace(opts, role="actor"))
    actor_dir = work / "actor_ckpt"
    actor.save(actor_dir, iteration=1)
    fresh = head_of(TrainerWorker(opts))
    from_actor = TrainerWorker(dataclasses.replace(opts, load=str(actor_dir), finetune=True))
    actor_state, critic_state = canonical_state_dict(actor.model), canonical_state_dict(from_actor.model)
    out["from_actor_backbone_equal"] = sorted(actor_state) == sorted(k for k in critic_state if "value_head" not in k) \
        and all(torch.equal(v, critic_state[k]) for k, v in actor_state.items())
    out["from_actor_head_fresh"] = all(torch.equal(fresh[k], v) for k, v in head_of(from_actor).items())
    # LoadCheckpoint of the actor's weights into a trained critic draws the head again too.
    out["trained_head_moved"] = not torch.equal(head_of(straight)["weight"], fresh["weight"])
    straight.load(actor_dir, finetune=True)
    out["reloaded_head_fresh"] = all(torch.equal(fresh[k], v) for k, v in head_of(straight).items())
    try:  # resuming the actor's optimizer state into the critic is refused by name
        TrainerWorker(dataclasses.replace(opts, load=str(actor_dir), finetune=False))
        out["actor_optimizer_refusal"] = None
    except ValueError as e:
        out["actor_optimizer_refusal"] = str(e)
    out["no_load_optim_ok"] = TrainerWorker(dataclasses.replace(
        opts, load=str(actor_dir), finetune=False, no_load_optim=True, no_load_rng=True)).iteration == 1
    reset_value_head(resumed.model)
    out["reset_is_fresh"] = all(torch.equal(fresh[k], v) for k, v in head_of(resumed).items())
    return out


def untied_checks(a) -> dict:
    """With untied embeddings the output layer holds weights: frozen, out of the optimizer, unchanged by updates."""
    from services.trainer.worker import TrainerWorker

    w = TrainerWorker(options(a.untied))
    layer = w.model.output_layer.weight
    before = layer.detach().clone()
    rows = make_rows(w.spec.vocab_size, 1)
    metrics = w.update(experience(rows, 7), step=1)
    return {"untied_output_layer_trainable": layer.requires_grad,
            "untied_output_layer_in_optimizer": any(s.name.startswith("output_layer") for s in w.optimizer.slots),
            "untied_output_layer_unchanged": torch.equal(before, layer.detach()),
            "untied_grad_norm": metrics["critic/grad_norm"]}


if __name__ == "__main__":
    sys.exit(main())
