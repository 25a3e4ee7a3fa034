"""Log-probs of response tokens (actor "old" log-probs and the reference's), micro-batched.

Owns `compute_log_probs_rows`: every rank of the group calls it with the same rows; each
data-parallel rank runs its share through Megatron's forward-only schedule in micro-batches of
`actor_forward_micro_batch_size` / `ref_forward_micro_batch_size` rows, or of a token budget under
`use_dynamic_bsz`, padded or packed (`use_remove_padding`; services/trainer/packing.py); logits are
divided by the sampling temperature (`grpo_loss.compute_log_probs`); only the response slice is kept.
The packed float32 result (`[sum(response_lengths)]`, rows in order) is assembled on global rank 0. A MoE
model whose expert collectives span data-parallel ranks runs as many micro-batches on each (padding ones, whose
rows are -1 and are not written: services/trainer/moe.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from services.trainer import grpo_loss, moe, packing
from services.trainer.step import (
    SequenceRows,
    gather_response_logits,
    run_micro_batches,
    scatter_response_rows,
)


def compute_log_probs_rows(
    model,
    rows: SequenceRows,
    *,
    temperature: float,
    micro_batch_size: int,
    with_entropy: bool = False,
    packing_opts: packing.Packing = packing.Packing(),
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Response log-probs (and entropy) of `rows`; returns packed float32 tensors on rank 0, else None."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    def loss_fn(logits: torch.Tensor, mb: dict):
        logits = gather_response_logits(logits, mb)
        logp, ent = grpo_loss.compute_log_probs(
            logits, mb["resp_tokens"].to(logits.device), temperature, with_entropy=with_entropy
        )
        logp = packing.unpack_response(logp, mb)
        ent = None if ent is None else packing.unpack_response(ent, mb)
        info = {"rows": mb["rows"], "log_probs": logp.float().cpu(), "entropy": None if ent is None else ent.float().cpu()}
        return torch.zeros((), device=logits.device), info

    gathered = forward_rows(model, rows, micro_batch_size, packing_opts, loss_fn, what="forward")
    if gathered is None:
        return None, None
    logp_flat = torch.zeros(rows.num_response_tokens, dtype=torch.float32)
    ent_flat = torch.zeros(rows.num_response_tokens, dtype=torch.float32) if with_entropy else None
    for info in gathered:
        scatter_response_rows(logp_flat, rows, info["rows"], info["log_probs"])
        if ent_flat is not None:
            scatter_response_rows(ent_flat, rows, info["rows"], info["entropy"])
    return logp_flat, ent_flat


def forward_rows(model, rows: SequenceRows, micro_batch_size: int, packing_opts: packing.Packing, loss_fn,
                 *, what: str) -> list[dict] | None:
    """The forward-only pass every per-token read shares (the log-probs here, the critic's values in critic.py):
    each data-parallel rank runs its share of `rows` in micro-batches (`micro_batch_size` rows, or the token budget
    under use_dynamic_bsz; padded or packed) through Megatron's schedule and `loss_fn` ((output, micro-batch) ->
    (zero, info dict with "rows")). Returns every micro-batch's info on global rank 0, None on the other ranks.
    `what` names the micro-batch size in the error for one below 1."""
    from megatron.core import parallel_state as ps

    if micro_batch_size < 1:
        raise ValueError(f"{what} micro batch size must be >= 1, got {micro_batch_size}")
    groups = packing.dp_groups(rows, range(len(rows)), micro_batch_size, packing_opts,
                               dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                               same_count=moe.lockstep_data_parallel(model))
    mbs = packing.build_micro_batches(rows, groups, packing_opts, pp=ps.get_pipeline_model_parallel_world_size(),
                                      tp=ps.get_tensor_model_parallel_world_size(),
                                      pad_rows_to=0 if packing_opts.dynamic else micro_batch_size)
    model.eval()
    with torch.no_grad(), moe.inert_padding(model, mbs):
        outputs = run_micro_batches(model, mbs, loss_fn, forward_only=True)
    # The last pipeline stage of TP rank 0 in each DP replica holds results; collect them on rank 0.
    mine = outputs if (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0) else []
    gathered = gather_to_rank0(mine)
    return gathered if dist.get_rank() == 0 else None


def gather_to_rank0(items: list) -> list:
    if dist.get_world_size() == 1:
        return list(items)
    out: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(items, out, dst=0)
    return [x for part in (out or []) for x in part]
