"""How a `[batch, seq]` per-token loss becomes one micro-batch's loss: `masked_mean` and the aggregation modes
(`LOSS_AGG_MODES`, verl's `loss_agg_mode` names; services/trainer/grpo_loss.py says which YAML key picks which).

The formulas are verl's `agg_loss` for one micro-batch (tests/trainer/test_loss_verl.py: float64, max difference
0); "token-mean" and "seq-mean-token-mean" are also MindSpeed-RL's `token_level_loss` true / false.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` over positions where `mask` is 1.

    Args:
        values: `[batch, seq]`.
        mask: `[batch, seq]`, bool or 0/1 numbers.
        dim: None for the mean over all masked tokens, -1 for one mean per row.

    Returns:
        A 0-dim tensor (dim None) or `[batch]`. A row or batch without any masked token gives 0
        rather than NaN (its count is clamped to 1).
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim=dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1.0)


def _token_mean(per_token: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    return masked_mean(per_token, mask)


def _seq_sums(per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(each row's masked token sum, each row's token count), in per_token's dtype."""
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum(dim=-1), mask.sum(dim=-1)


def _mean_over_rows_with_tokens(row_values: Tensor, counts: Tensor) -> Tensor:
    # A row without tokens (every token rejected by the rollout correction) is not a sample of the mean.
    has_tokens = (counts > 0).to(row_values.dtype)
    return (row_values * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def _seq_mean_token_mean(per_token: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    sums, counts = _seq_sums(per_token, mask)
    # + 1e-8 as verl; in float32 count + 1e-8 == count for any count >= 1, so this is MindSpeed-RL's sum / count.
    return _mean_over_rows_with_tokens(sums / (counts + 1e-8), counts)


def _seq_mean_token_sum(per_token: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    sums, counts = _seq_sums(per_token, mask)
    return _mean_over_rows_with_tokens(sums, counts)


def _seq_mean_token_sum_norm(per_token: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    sums, _ = _seq_sums(per_token, mask)
    return sums.sum() / (per_token.shape[-1] if scale is None else scale)


# Aggregation of a `[batch, seq]` per-token loss into the micro-batch loss (verl's `loss_agg_mode` names).
LOSS_AGG_MODES: dict[str, Callable[[Tensor, Tensor, float | None], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate_loss(per_token: Tensor, mask: Tensor, mode: str = "token-mean", scale: float | None = None) -> Tensor:
    """Reduce a `[batch, seq]` per-token loss to a scalar over the masked tokens.

    "token-mean": sum over all masked tokens / their count (every token weighs the same, DAPO).
    "seq-mean-token-mean": mean over each row's masked tokens, then the mean over rows (every
    sample weighs the same, the original GRPO). "seq-mean-token-sum": each row's sum, mean over rows.
    "seq-mean-token-sum-norm": the sum over all masked tokens / `scale` (None: the padded width), Dr.GRPO's
    constant normaliser. Rows without a masked token do not count as rows.
    """
    try:
        fn = LOSS_AGG_MODES[mode]
    except KeyError:
        raise ValueError(
            f"unsupported loss aggregation mode {mode!r}; supported: {sorted(LOSS_AGG_MODES)}"
        ) from None
    return fn(per_token, mask, scale)
