"""One rank of a trainer group that runs the LoRA checks of test_lora.py (launched by tests as a subprocess).

Usage: python tests/trainer/lora_checks.py --rank R --world W --port P --hf DIR --work DIR
For each case of CASES in turn (TP size and activation memory; Megatron's groups are rebuilt between cases, as in
rank_checks.py), every rank loads the HF weights into a reference-role TrainerWorker (no optimizer), applies
LoRA and records: logits before and after, with random adapters, with them disabled; the gradients of one
backward (whole tensors, gathered over TP); the merged export (converted to HF names); the adapter state round
trip; refusals; sizes; one optimizer step. Rank 0 writes `{work}/lora_{case}.pt`.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_helpers import rank_arguments

RANK, ALPHA = 4, 8.0
# (name, TP size, ActivationMemory keywords)
CASES: list[tuple[str, int, dict]] = [
    ("tp1", 1, {}),
    ("tp1_recompute", 1, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    ("tp2", 2, {}),
    ("tp2_sp", 2, dict(sequence_parallel=True)),
]


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [2, 19] and the weights of the test loss sum(weights * logits)."""
    ids = torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 19, vocab, generator=torch.Generator().manual_seed(1)) / 400
    return ids, weights


def random_adapters(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Whole (TP 1) adapter matrices of the given shapes, drawn per name (the same on every rank and layout)."""
    return {n: 0.05 * torch.randn(s, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())))
            for n, s in shapes.items()}


def gather_grads(model) -> tuple[dict[str, torch.Tensor], float]:
    """Whole adapter gradients (TP 1 layout) and the largest difference between the TP ranks' copies of the
    matrices every rank holds whole."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from services.trainer.lora import adapter_parameters, gather_adapter_state_dict

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    spread = 0.0
    for _, p in adapter_parameters(model):
        if not p.tensor_model_parallel:
            parts = [torch.empty_like(p.grad) for _ in range(tp)]
            dist.all_gather(parts, p.grad.contiguous(), group=group)
            spread = max([spread] + [(q - parts[0]).abs().max().item() for q in parts])
    return gather_adapter_state_dict(model, grads=True), spread


def refusal(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def run_case(hf: str, tp: int, memory: dict) -> dict:
    from megatron.core import parallel_state as ps

    from services.trainer import lora
    from services.trainer.activation_memory import ActivationMemory
    from services.trainer.convert import mcore_to_hf
    from services.trainer.model import canonical_name, model_forward
    from services.trainer.optimizer import OptimizerOptions, build_optimizer
    from services.trainer.worker import TrainerWorker, WorkerOptions, gather_objects

    w = TrainerWorker(WorkerOptions(role="reference", hf_dir=hf, activation_memory=ActivationMemory(**memory)))
    model, vocab = w.model, w.spec.vocab_size
    ids, loss_weights = batch(vocab)

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return model_forward(model.eval(), ids)[..., :vocab].clone()

    def backward() -> None:
        (model_forward(model.train(), ids)[..., :vocab] * loss_weights).sum().backward()

    out: dict = {"sequence_parallel": bool(model.config.sequence_parallel), "base_logits": logits()}
    base = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    opts = lora.LoraOptions(rank=RANK, alpha=ALPHA)
    out["adapted_layers"] = lora.apply_lora(model, opts)
    out["trainable"] = sorted(canonical_name(n) for n, p in model.named_parameters() if p.requires_grad)
    out["adapter_names"] = sorted(n for n, _ in lora.adapter_parameters(model))
    out["zero_adapter_logits"] = logits()
    out["zero_merged_equal"] = all(torch.equal(t, base[canonical_name(n)]) for n, t in lora.merged_parameters(model))
    out["initial_adapters"] = lora.gather_adapter_state_dict(model)

    whole = random_adapters({n: tuple(t.shape) for n, t in lora.gather_adapter_state_dict(model).items()})
    lora.load_adapter_state_dict(model, whole, whole=True)
    out["adapters"] = whole
    out["adapters_gathered_back"] = lora.gather_adapter_state_dict(model)
    out["lora_logits"] = logits()
    with lora.adapters_disabled(model):
        out["disabled_logits"] = logits()
    out["enabled_again_logits"] = logits()

    model.zero_grad(set_to_none=True)
    backward()
    out["with_grad"] = sorted(canonical_name(n) for n, p in model.named_parameters() if p.grad is not None)
    out["grads"], out["replica_grad_spread"] = gather_grads(model)

    merged = {canonical_name(n): t.clone() for n, t in lora.merged_parameters(model)}
    out["merged_names"] = list(merged)
    out["base_names"] = list(base)
    params = dict(model.named_parameters())
    out["merged_partition_dims"] = {canonical_name(n): (getattr(t, "partition_dim", None), params[n].partition_dim)
                                    for n, t in lora.merged_parameters(model)
                                    if n.endswith(".weight") and hasattr(params[n], "partition_dim")}
    shards = gather_objects(((ps.get_tensor_model_parallel_rank(), 0), merged))
    if shards is not None:
        out["merged_hf"] = mcore_to_hf(dict(shards), w.spec, tp, 1)
    if tp == 1:
        out["base"], out["merged"] = base, merged

    saved = lora.adapter_state_dict(model)
    lora.load_adapter_state_dict(model, {n: torch.zeros_like(t) for n, t in saved.items()})
    out["zeroed_logits"] = logits()
    lora.load_adapter_state_dict(model, saved)
    out["restored_logits"] = logits()
    first = next(iter(saved))
    out["refusals"] = {
        "missing": refusal(lambda: lora.load_adapter_state_dict(model, {n: saved[n] for n in list(saved)[1:]})),
        "shape": refusal(lambda: lora.load_adapter_state_dict(model, {**saved, first: saved[first][:, :1]})),
        "again": refusal(lambda: lora.apply_lora(model, opts)),
    }
    out["adapter_numel"], out["adapter_bytes"] = lora.adapter_numel(model), lora.adapter_bytes(model)
    out["planned_numel"] = lora.planned_adapter_numel(w.spec, opts, tp=tp)

    # The trainer's optimizer over the LoRA model: state for the adapters only, only they move.
    optimizer, _ = build_optimizer(model, OptimizerOptions(lr=1e-2, lr_decay_style="constant"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.zero_grad()
    backward()
    out["grad_norm"] = optimizer.step(clip_grad=1.0)
    out["slots"] = sorted(s.name for s in optimizer.slots)
    out["grad_buffer_numel"] = optimizer.grad_buffer.numel()
    out["optimizer_memory"] = optimizer.memory_bytes()
    out["adam_state_numel"] = sum(v.numel() for st in optimizer.optimizer.state.values()
                                  for k, v in st.items() if k != "step")
    out["moved"] = sorted(canonical_name(n) for n, p in model.named_parameters() if not torch.equal(p, before[n]))
    return out


def main() -> int:
    ap = rank_arguments()
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps

    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    for name, tp, memory in CASES:
        parallel.init_model_parallel(tp, 1, seed=1)
        results = run_case(a.hf, tp, memory)
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"lora_{name}.pt")
        ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
