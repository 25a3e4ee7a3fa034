"""PPO's critic: values of response tokens (ComputeValues) and the clipped value-loss update (Update on a critic).

The model is a GPTModel with a value head (services/trainer/value_head.py), whose output is [b, S, 1] where an actor's
is [b, S, V]; everything around it is the actor's machinery:

- `compute_values_rows`, as services/trainer/logprobs.py: every rank calls it with the same rows; each data-parallel
  rank runs its share forward-only in micro-batches (critic_config.micro_batch_size rows, or the token budget under
  use_dynamic_bsz; padded or packed), and the packed float32 values ([sum(response_lengths)], rows in order) are
  assembled on global rank 0. The value of response token t is the head's output at the position whose logits
  would predict t (prompt_length - 1 + t), MindSpeed-RL's `CriticLossFunc._get_compute_vpreds`, which are the
  positions the log-probs read (`step.make_micro_batch`'s `resp_pos`).
- `critic_update`, as the actor's (services/trainer/update.py `optimize`: mini-batches x epochs, one optimizer step
  each, micro-batches through Megatron's schedule, gradient clipping, LR schedule) with the loss of
  services/trainer/value_loss.py (`rl_config.cliprange_value`) per micro-batch, weighted as the actor's under
  use_dynamic_bsz. Metrics: `critic/vf_loss` and `critic/vf_clipfrac` (means over the micro-batches of every rank),
  `critic/grad_norm` and `critic/lr` (means over the optimizer steps; the lr each step used), as upstream logs them.
"""

from __future__ import annotations

import dataclasses

import torch

from services.trainer import packing
from services.trainer.logprobs import forward_rows
from services.trainer.step import (
    SequenceRows,
    gather_response_logits,
    response_slices,
    scatter_response_rows,
)
from services.trainer.update import UpdateOptions, optimize, per_token, reduce_mean_metrics, step_means
from services.trainer.value_loss import VALUE_LOSS_METRICS, value_loss, value_loss_metrics


@dataclasses.dataclass
class CriticExperience:
    """One global batch for the critic's Update: rows, their GAE returns (the targets) and the values the critic
    gave them before this update (the clip's centre), both float32 [sum(response_lengths)] like the log-probs."""

    rows: SequenceRows
    returns: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("returns", "values"):
            v = per_token(name, getattr(self, name), self.rows)
            if v is None and self.rows.num_response_tokens:
                raise ValueError(f"a critic update needs {name} (one per response token)")
            setattr(self, name, v)


def head_values(output: torch.Tensor, mb: dict) -> torch.Tensor:
    """The critic's output ([b, S, 1], [b, R, 1], or packed [1, sum r, 1]) -> values [b, R] at the response
    positions, rows as the micro-batch's (0 on padding)."""
    return packing.unpack_response(gather_response_logits(output, mb).squeeze(-1), mb)


def compute_values_rows(model, rows: SequenceRows, micro_batch_size: int,
                        packing_opts: packing.Packing = packing.Packing()) -> torch.Tensor | None:
    """Values of `rows`' response tokens: packed float32 [sum(response_lengths)] on rank 0, else None."""

    def loss_fn(output: torch.Tensor, mb: dict):
        info = {"rows": mb["rows"], "values": head_values(output, mb).float().cpu()}
        return torch.zeros((), device=output.device), info

    gathered = forward_rows(model, rows, micro_batch_size, packing_opts, loss_fn, what="the critic's forward")
    if gathered is None:
        return None
    values = torch.zeros(rows.num_response_tokens, dtype=torch.float32)
    for info in gathered:
        scatter_response_rows(values, rows, info["rows"], info["values"])
    return values


def critic_update(model, optimizer, scheduler, exp: CriticExperience, opts: UpdateOptions, clip_grad: float,
                  step: int = 0) -> dict[str, float]:
    """One iteration's critic update; returns the averaged metrics (identical on every rank)."""
    trained = optimize(model, optimizer, scheduler, exp.rows, opts, _micro_batch_value_loss(exp, opts), clip_grad,
                       step)
    metrics = reduce_mean_metrics(trained.mb_metrics, VALUE_LOSS_METRICS)
    metrics.update(step_means(trained.step_metrics, "critic/grad_norm", "critic/lr"))
    metrics.update(trained.tail_metrics(model, exp.rows))
    return metrics


def _micro_batch_value_loss(exp: CriticExperience, opts: UpdateOptions):
    """The loss function Megatron's schedule calls per micro-batch: (values output, micro-batch) -> (loss, metrics)."""

    def loss_fn(output: torch.Tensor, mb: dict):
        if mb.get("padding"):  # zero, but through the graph: its backward is a collective of the expert group
            return output.sum() * 0.0, {}
        vpreds = head_values(output, mb)
        dev = vpreds.device
        rows_idx = [i for i in mb["rows"] if i >= 0]
        width = vpreds.shape[1]
        vpreds = vpreds[: len(rows_idx)]
        mask = mb["response_mask"].to(dev)[: len(rows_idx)]
        returns = response_slices(exp.returns, exp.rows, rows_idx, width).to(dev)
        values = response_slices(exp.values, exp.rows, rows_idx, width).to(dev)
        loss, clipfrac = value_loss(vpreds, returns, values, mask, opts.cliprange_value)
        # use_dynamic_bsz: the micro-batch's weight in the mini-batch (packing.loss_scales); metrics stay unscaled.
        return loss * mb.get("loss_scale", 1.0), value_loss_metrics(loss, clipfrac)

    return loss_fn
