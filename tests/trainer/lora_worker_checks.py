"""One trainer rank that runs the LoRA TrainerWorker checks of test_lora_worker.py (launched as a subprocess).

Usage: python tests/trainer/lora_worker_checks.py --rank 0 --world 1 --port P --hf DIR --work DIR
An actor TrainerWorker with LoRA (rank 4, alpha 8, every target) on the tiny model's HF weights: what its
optimizer holds, which parameters two updates move, what the weight export yields (against base + delta computed
here), its log-probs with the adapters off (share_backbone's reference), and for lora_ckpt_filter off and on: a checkpoint's model keys, log-probs after a resume, and 2 + save +
resume + 2 updates against 4 straight. Rank 0 writes `{work}/lora_worker.pt`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_checks import make_experience, make_rows
from trainer_helpers import rank_arguments

RANK, ALPHA = 4, 8.0


def main() -> int:
    a = rank_arguments().parse_args()
    torch.set_num_threads(1)
    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    parallel.init_model_parallel(1, 1, seed=1)
    results = run_checks(a)
    if a.rank == 0:
        torch.save(results, Path(a.work) / "lora_worker.pt")
    parallel.shutdown()
    return 0


def run_checks(a) -> dict:
    from services.trainer.checkpoint import holds_adapters_only
    from services.trainer.lora import LoraOptions, adapters, is_adapter_name
    from services.trainer.model import canonical_name
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.weights_export import exported_tensors
    from services.trainer.worker import TrainerWorker, WorkerOptions

    work = Path(a.work)
    out: dict = {}
    upd = UpdateOptions(micro_batch_size=4, mini_batch_rows=8, epochs=1, seed=3)
    # A large constant LR: the adapters must move visibly in two steps.
    optim = OptimizerOptions(lr=1e-2, lr_decay_style="constant", clip_grad=1.0, weight_decay=0.01)
    wopts = WorkerOptions(role="actor", hf_dir=a.hf, finetune=True, forward_micro_batch_size=4, update=upd,
                          optimizer=optim, lora=LoraOptions(rank=RANK, alpha=ALPHA, seed=1))

    w = TrainerWorker(wopts)
    rows = make_rows(w.spec.vocab_size, 1)
    logp0 = w.compute_log_probs(rows, temperature=1.0)[0]
    out["optimizer_names"] = sorted(canonical_name(s.name) for s in w.optimizer.slots)
    out["adapter_names"] = sorted(canonical_name(n) for n, _ in w.model.named_parameters() if is_adapter_name(n))
    out["adapted_layers"] = len(adapters(w.model))
    before = {canonical_name(n): p.detach().clone() for n, p in w.model.named_parameters()}

    def train(worker, steps):
        for step in steps:
            worker.update(make_experience(rows, logp0, seed=200 + step), temperature=1.0, kl_coef=0.01, step=step)
            torch.manual_seed(1000 + step)  # RNG consumed between steps must resume too

    train(w, range(1, 3))
    after = {canonical_name(n): p.detach().clone() for n, p in w.model.named_parameters()}
    out["moved"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
    out["log_probs_moved"] = (w.compute_log_probs(rows, temperature=1.0)[0] - logp0).abs().max().item()
    # share_backbone's reference: the trained actor with its adapters off is the base model, bitwise.
    out["adapters_off_is_base"] = torch.equal(w.compute_log_probs(rows, temperature=1.0, adapters_off=True)[0], logp0)

    # The export: base names only, adapted weights = W + (alpha / r) B A computed here, the others the base itself.
    exported = {canonical_name(n): t.detach().clone() for n, t in exported_tensors(w.model)}
    expected = {}
    for n, t in after.items():
        if is_adapter_name(n):
            continue
        layer = n.removesuffix(".weight")
        if f"{layer}.lora_A.weight" in after:
            t = t + (ALPHA / RANK) * (after[f"{layer}.lora_B.weight"] @ after[f"{layer}.lora_A.weight"])
        expected[n] = t
    out["export_names_equal"] = sorted(exported) == sorted(expected)
    out["export_max_diff"] = max((exported[n] - expected[n]).abs().max().item() for n in expected)
    out["export_adapted_differs_from_base"] = any(
        not torch.equal(exported[n], after[n]) for n in expected if f"{n.removesuffix('.weight')}.lora_A.weight" in after)

    for filtered in (False, True):
        opts = dataclasses.replace(wopts, lora_ckpt_filter=filtered)
        straight = TrainerWorker(opts)
        train(straight, range(1, 5))
        first = TrainerWorker(opts)
        train(first, range(1, 3))
        ckdir = work / f"ckpt_filter{int(filtered)}"
        iter_dir, _, _ = first.save(ckdir, iteration=2)
        payload = torch.load(next(iter_dir.glob("mp_rank_*/model_optim_rng.pt")), weights_only=False)
        saved = sorted(payload["model"])
        logp_saved = first.compute_log_probs(rows, temperature=1.0)[0]
        # Resume as MindSpeed-RL does: finetune false, optimizer and RNG loaded.
        resumed = TrainerWorker(dataclasses.replace(opts, load=str(ckdir), finetune=False))
        logp_resumed = resumed.compute_log_probs(rows, temperature=1.0)[0]
        it = resumed.iteration
        train(resumed, range(3, 5))
        diff = max((p - q).abs().max().item() for p, q in zip(
            straight.model.state_dict().values(), resumed.model.state_dict().values(), strict=True)
            if isinstance(p, torch.Tensor) and p.is_floating_point())
        out[f"filter{int(filtered)}"] = {
            "saved_keys": saved, "holds_adapters_only": holds_adapters_only(ckdir),
            "saved_bytes": sum(t.numel() * t.element_size() for t in payload["model"].values()
                               if isinstance(t, torch.Tensor)),
            "log_probs_equal": torch.equal(logp_saved, logp_resumed), "resumed_iteration": it,
            "resume_max_abs_diff": diff,
            "resumed_optimizer_names": sorted(canonical_name(s.name) for s in resumed.optimizer.slots),
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
