"""Megatron forward/backward over a list of micro-batches, plus the rows <-> tensors plumbing.

Owns: turning packed sequences (prompt + response tokens, no padding) into right-padded model
inputs with response-aligned indices, and running Megatron's own schedule
(`get_forward_backward_func`: no-pipelining at PP 1, 1F1B at PP > 1) over them. Which rows form a
micro-batch, and the packed layout (`use_remove_padding`), live in `packing.py`. Math on the logits
lives in `grpo_loss.py`; the callers (`logprobs.py`, `update.py`) give the per-micro-batch loss.

Every rank of the group holds the same rows; each data-parallel rank takes its contiguous share.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from services.trainer import megatron_compat, routing_replay
from services.trainer.model import causal_mask, unwrap


@dataclasses.dataclass
class SequenceRows:
    """B packed sequences: prompt then response tokens each, concatenated without padding."""

    token_ids: torch.Tensor  # int64 [sum(prompt_lengths + response_lengths)]
    prompt_lengths: torch.Tensor  # int64 [B]
    response_lengths: torch.Tensor  # int64 [B]
    # Routing replay (MoE): int64 [sum(prompt_lengths + response_lengths), moe_layers, top_k], the experts for
    # each token (-1 rows free); None: the routers choose (services/trainer/routing_replay.py).
    routed_experts: torch.Tensor | None = None
    # Multi-turn: bool [sum(response_lengths)], False on response tokens the policy did not generate (tool
    # responses): they stay in the input but leave the micro-batch's `response_mask` (loss, KL, entropy, counts).
    response_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.token_ids = torch.as_tensor(self.token_ids).long().reshape(-1)
        self.prompt_lengths = torch.as_tensor(self.prompt_lengths).long().reshape(-1)
        self.response_lengths = torch.as_tensor(self.response_lengths).long().reshape(-1)
        if self.routed_experts is not None:
            self.routed_experts = torch.as_tensor(self.routed_experts).long()
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != self.token_ids.numel():
                raise ValueError(f"routed_experts must be [{self.token_ids.numel()} tokens, moe_layers, top_k], "
                                 f"got shape {tuple(self.routed_experts.shape)}")
        if self.prompt_lengths.shape != self.response_lengths.shape:
            raise ValueError(
                f"prompt_lengths has {self.prompt_lengths.numel()} entries but response_lengths has "
                f"{self.response_lengths.numel()}"
            )
        total = int((self.prompt_lengths + self.response_lengths).sum())
        if total != self.token_ids.numel():
            raise ValueError(f"token_ids has {self.token_ids.numel()} tokens; the lengths add up to {total}")
        if bool((self.prompt_lengths < 1).any()):
            raise ValueError("every sequence needs at least one prompt token (prompt_lengths >= 1)")
        seq = self.prompt_lengths + self.response_lengths
        self.seq_offsets = torch.cat([torch.zeros(1, dtype=torch.long), seq.cumsum(0)])
        self.resp_offsets = torch.cat([torch.zeros(1, dtype=torch.long), self.response_lengths.cumsum(0)])

    def __len__(self) -> int:
        return int(self.prompt_lengths.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_lengths.sum())

    def max_len(self) -> int:
        return int((self.prompt_lengths + self.response_lengths).max()) if len(self) else 0


def response_slices(flat: torch.Tensor, rows: SequenceRows, idx: Sequence[int], width: int) -> torch.Tensor:
    """Per-response-token values (packed, [sum(r)]) of rows `idx` as a right-padded [b, width]."""
    # One gather for all rows: a Python loop per row cost ~40 torch calls per micro-batch row (W2: 64 rows).
    i = torch.as_tensor(list(idx), dtype=torch.long)
    cols = torch.arange(width)
    valid = cols[None, :] < rows.response_lengths[i][:, None]
    if flat.numel() == 0:
        return torch.zeros((len(i), width), dtype=flat.dtype)
    src = (rows.resp_offsets[i][:, None] + cols[None, :]).clamp_(max=flat.numel() - 1)
    return torch.where(valid, flat[src], torch.zeros((), dtype=flat.dtype))


def scatter_response_rows(out: torch.Tensor, rows: SequenceRows, idx: Sequence[int], values: torch.Tensor) -> None:
    """Writes right-padded per-row values [b, >= max r] of rows `idx` (-1: padding row) into packed `out`."""
    i = torch.as_tensor(list(idx), dtype=torch.long)
    keep = i >= 0
    i, values = i[keep], values[keep]
    cols = torch.arange(values.shape[1])
    valid = cols[None, :] < rows.response_lengths[i][:, None]
    dest = rows.resp_offsets[i][:, None] + cols[None, :]
    out[dest[valid]] = values[valid].to(out.dtype)


def make_micro_batch(rows: SequenceRows, idx: Sequence[int], *, pad_rows_to: int = 0, seq_len: int = 0) -> dict:
    """Model inputs of rows `idx`, right-padded to `seq_len` (0 = the longest row).

    Returns input_ids/position_ids [b, S], attention_mask, and response-aligned tensors [b, R]:
    `resp_pos` (position of the logit that predicts each response token), `resp_tokens`,
    `response_mask`, plus `rows` (the row indices; padding rows, added up to `pad_rows_to`, are -1).
    Padding is only to the micro-batch's own longest row (never to `seq_length`) unless `seq_len` asks.
    """
    idx = list(idx)
    k = len(idx)
    b = max(k, pad_rows_to)
    i = torch.as_tensor(idx, dtype=torch.long)
    p, n = rows.prompt_lengths[i], rows.response_lengths[i]
    s = max(seq_len, int((p + n).max()))
    r = max(1, int(n.max()))
    # Vectorised over rows (a per-row loop was ~10 torch calls per row on every call).
    cols = torch.arange(s)
    in_seq = cols[None, :] < (p + n)[:, None]
    src = (rows.seq_offsets[i][:, None] + cols[None, :]).clamp_(max=max(rows.token_ids.numel() - 1, 0))
    input_ids = torch.zeros((b, s), dtype=torch.long)
    input_ids[:k] = torch.where(in_seq, rows.token_ids[src], 0)
    rcols = torch.arange(r)
    in_resp = rcols[None, :] < n[:, None]
    pos = p[:, None] - 1 + rcols[None, :]
    resp_pos = torch.zeros((b, r), dtype=torch.long)
    resp_pos[:k] = torch.where(in_resp, pos, 0)
    resp_tokens = torch.zeros((b, r), dtype=torch.long)
    resp_tokens[:k] = torch.where(in_resp, input_ids[:k].gather(1, (pos + 1).clamp_(max=s - 1)), 0)
    mask = torch.zeros((b, r), dtype=torch.float32)
    mask[:k] = response_token_mask(rows, i, in_resp).float()
    mb = {
        "input_ids": input_ids,
        "position_ids": cols.unsqueeze(0).expand(b, s).contiguous(),
        "attention_mask": causal_mask(s),
        "resp_pos": resp_pos,
        "resp_tokens": resp_tokens,
        "response_mask": mask,
        "rows": idx + [-1] * (b - k),
    }
    if rows.routed_experts is not None:  # [b, S, layers, k] beside input_ids; padding free (-1)
        routed = rows.routed_experts
        mb["routed_experts"] = torch.full((b, s, *routed.shape[1:]), -1, dtype=torch.long)
        mb["routed_experts"][:k] = torch.where(in_seq[:, :, None, None], routed[src], -1)
    return mb


def response_token_mask(rows: SequenceRows, i: torch.Tensor, in_resp: torch.Tensor) -> torch.Tensor:
    """[k, R] bools: response columns inside each row's response that the policy generated (rows `i`)."""
    if rows.response_mask is None:
        return in_resp
    src = (rows.resp_offsets[i][:, None] + torch.arange(in_resp.shape[1])[None, :]).clamp_(
        max=max(rows.response_mask.numel() - 1, 0))
    return in_resp & rows.response_mask[src]


def gather_response_logits(logits: torch.Tensor, mb: dict) -> torch.Tensor:
    """[b, S, V] logits -> [b, R, V] at the positions that predict the response tokens.

    Packed micro-batches (services/trainer/packing.py) give [1, sum r, V], at (`resp_rows`, `resp_pos`).
    Logits that `response_logits_only` already computed at those positions only are returned as they are.
    """
    if mb.get("logits_at_response"):
        return logits
    pos = mb["resp_pos"].to(logits.device)
    if mb.get("resp_rows") is not None:
        return logits[mb["resp_rows"].to(logits.device), pos[0]].unsqueeze(0)
    return logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


@contextlib.contextmanager
def response_logits_only(model, resp_pos: torch.Tensor, resp_rows: torch.Tensor | None = None) -> Iterator[bool]:
    """While the model runs, its output layer sees only the hidden states at `resp_pos` ([b, R]).

    With `resp_rows` ([sum r], packed micro-batches) the positions are `resp_pos[0]` in rows `resp_rows` and
    the model returns [1, sum r, V].

    The loss needs logits at the R response positions of each row, not at all S: computing the vocabulary
    projection ([S, b, h] x [h, V]) everywhere and gathering afterwards cost the prompt positions' share of
    the largest matmul at W1 (V 4096), a [b, S, V] gather and, in backward, its scatter into a zeroed
    [b, S, V] gradient. A forward pre-hook on the last stage's `output_layer` gathers the [S, b, h] input
    down to [R, b, h] first, so the model returns [b, R, V]. Yields whether the hook was placed (False on
    stages without an output layer, which return hidden states).
    """
    layer = getattr(unwrap(model), "output_layer", None)
    if layer is None or not getattr(unwrap(model), "post_process", True):
        yield False
        return
    idx = resp_pos.t()  # [R, b], Megatron's sequence-first layout

    def pre_hook(_module, args, kwargs):
        # GPTModel passes the hidden states positionally; `input_` is the layer's own name for them.
        hidden = args[0] if args else kwargs["input_"]
        if resp_rows is not None:
            picked = hidden[resp_pos[0].to(hidden.device), resp_rows.to(hidden.device)].unsqueeze(1)
        else:
            picked = hidden.gather(0, idx.to(hidden.device).unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        if args:
            return (picked, *args[1:]), kwargs
        return args, {**kwargs, "input_": picked}

    handle = layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield True
    finally:
        handle.remove()


def dp_share(n: int, dp: int, dp_rank: int) -> range:
    """Contiguous share of n items for one data-parallel rank (sizes differ by at most one)."""
    base, extra = divmod(n, dp)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (1 if dp_rank < extra else 0))


def _to_device(mb: dict, device: torch.device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}


def run_micro_batches(
    model,
    micro_batches: list[dict] | Iterator[dict],
    loss_fn: Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict[str, Any]]],
    *,
    forward_only: bool,
    count: int | None = None,
) -> list[dict[str, Any]]:
    """Megatron's forward(/backward) over `micro_batches`; returns loss_fn's dicts (last PP stage).

    `count`: `micro_batches` is an iterator of that many micro-batches, each built when the schedule asks for it
    (a streaming update: streamed_update.grpo_update_streamed; pipeline parallel size 1 only, where the schedule needs no
    shapes up front).

    `loss_fn(logits, micro_batch) -> (loss, info)`, logits [b, R, V] at the response positions (or [b, S, V]
    where `micro_batch["logits_at_response"]` is False; `gather_response_logits` handles both); Megatron divides the loss by the number
    of micro-batches before backward, so gradients are the mean over micro-batches.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if count is not None:
        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("micro-batches built on demand need pipeline parallel size 1")
        seq_len = mbs = 0  # unused by the no-pipelining schedule
    elif not micro_batches:
        return []
    else:
        seq_len = max(mb["input_ids"].shape[1] for mb in micro_batches)
        mbs = max(mb["input_ids"].shape[0] for mb in micro_batches)
    device = next(model.parameters()).device
    if count is None and ps.get_pipeline_model_parallel_world_size() > 1:
        # 1F1B exchanges fixed-shape activations between stages.
        for mb in micro_batches:
            if tuple(mb["input_ids"].shape) != (mbs, seq_len):
                raise ValueError("pipeline parallel micro-batches must share one shape; pad them first")

    from services.trainer import packing  # packing builds on this module's row plumbing

    def forward_step(data_iterator, m):
        mb = _to_device(next(data_iterator), device)
        routing_replay.set_targets(m, mb)
        with (megatron_compat.outside_cpu_device_mode(), packing.rope_at_positions(m, mb),
              response_logits_only(m, mb["resp_pos"], mb.get("resp_rows")) as at_response):
            out = m(input_ids=mb["input_ids"], position_ids=mb["position_ids"], attention_mask=mb["attention_mask"],
                    **packing.forward_kwargs(mb))
        mb["logits_at_response"] = at_response
        return out, partial(_call_loss, loss_fn, mb)

    # Megatron's schedules allocate a token counter on "cuda" by name (see megatron_compat).
    try:
        with megatron_compat.cpu_device_mode():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[model],
                num_microbatches=len(micro_batches) if count is None else count,
                seq_length=seq_len,
                micro_batch_size=mbs,
                forward_only=forward_only,
            )
    finally:
        routing_replay.clear(model)


def _call_loss(loss_fn, mb: dict, output_tensor: torch.Tensor):
    with megatron_compat.outside_cpu_device_mode():
        return loss_fn(output_tensor, mb)
