"""Micro-batch formation: fixed rows or a token budget (use_dynamic_bsz), padded rows or packed (use_remove_padding).

Owns how one rank's rows become the micro-batches that `step.run_micro_batches` runs, for the old-log-prob,
reference and update passes alike:

- Grouping. Without `use_dynamic_bsz`, consecutive chunks of `micro_batch_size` (update) or
  `*_forward_micro_batch_size` (forward passes) rows. With it, `token_budget_groups` cuts the rows into the
  fewest groups whose prompt + response tokens fit `*_max_packing_token_size` and whose row count fits
  `*_dynamic_max_batch_size`, balanced by tokens (longest row first into the lightest group that still has
  room). As in MindSpeed-RL, the group count is the largest any data-parallel rank needs, so every rank runs
  as many micro-batches; unlike its Karmarkar-Karp split, which can overshoot a budget, every group here
  respects both budgets (the count grows until they do).
- Layout. Padded: `step.make_micro_batch`, [b, S] rows right-padded to the group's longest. Packed
  (`make_packed_micro_batch`): no padding between sequences, each attending only to itself from position 0,
  so the numbers are those of the padded layout. On an accelerator with TransformerEngine that is Megatron's
  THD path: one row [1, T], `PackedSeqParams` with cu_seqlens (flash attention skips the other sequences).
  Megatron's local attention (CPU) rejects PackedSeqParams and would compute a masked [T, T] score matrix for
  one row, so there the sequences are packed first-fit into rows as long as the group's longest, each row with
  a block-diagonal causal mask, and RoPE is taken at each token's own position (`rope_at_positions`; GPTModel
  otherwise rotates by the position in the row).
- Pipeline parallel: 1F1B sends fixed-shape activations between stages, so every micro-batch of a pass is
  padded to one shape (packed: the most rows at the widest; padded: the most rows at the batch's longest),
  its length a multiple of the TP size for sequence parallelism. The stages of one pipeline hold the same rows
  and form the same groups.

The loss of a micro-batch stays a token mean over its own response tokens; see `loss_scales` for how the
micro-batches of a mini-batch are weighted (docs/config.md, "Packing and dynamic batch size").
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import importlib.util
import itertools
import math
from collections.abc import Iterator, Sequence

import torch

from services.common.config.rl import RLConfig
from services.trainer import megatron_compat
from services.trainer.model import unwrap
from services.trainer.step import SequenceRows, dp_share, make_micro_batch, response_token_mask

# MindSpeed-RL's per-pass budget when the YAML leaves it unset (RLConfig copies max_packing_token_size's
# default, not its value, into it before reading the file).
DEFAULT_MAX_PACKING_TOKENS = RLConfig().max_packing_token_size


@dataclasses.dataclass(frozen=True)
class Packing:
    """How one pass (actor / ref forward, update) forms micro-batches beyond its fixed row count."""

    remove_padding: bool = False  # rl_config.use_remove_padding
    max_tokens: int | None = None  # rl_config.<pass>_max_packing_token_size under use_dynamic_bsz; None: fixed rows
    max_rows: int | None = None  # rl_config.<pass>_dynamic_max_batch_size; None: no limit
    # "actor" / "ref" / "update": names the keys in error messages; "" the unprefixed ones (the critic's)
    key_prefix: str = ""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"rl_config.{self.key('max_packing_token_size')} must be >= 1, got {self.max_tokens}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"rl_config.{self.key('dynamic_max_batch_size')} must be >= 1, got {self.max_rows}")

    def key(self, name: str) -> str:
        """The rl_config key of this pass's `name` budget."""
        return f"{self.key_prefix}_{name}" if self.key_prefix else name

    @property
    def dynamic(self) -> bool:
        return self.max_tokens is not None


def token_budget_groups(lengths: Sequence[int], max_tokens: int, max_rows: int | None = None, *,
                        min_groups: int = 1, key: str = "max_packing_token_size") -> list[list[int]]:
    """Indices of `lengths` cut into groups of at most `max_tokens` tokens and `max_rows` rows.

    Uses the fewest groups (at least `min_groups`, at most one per row) for which the balanced assignment
    (longest first, into the lightest group with room; ties to the lower index) fits both budgets. Each index
    appears once; indices ascend within a group and groups are ordered by their first index.
    """
    n = len(lengths)
    if n == 0:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens (prompt + response) exceeds rl_config.{key}={max_tokens}; "
                         "every sequence must fit one micro-batch: raise the budget to at least "
                         "max_prompt_length + generate_config.sampling_config.max_tokens")
    k = max(min_groups, math.ceil(sum(lengths) / max_tokens), math.ceil(n / max_rows) if max_rows else 1)
    k = min(k, n)
    while (groups := _balanced(lengths, k, max_tokens, max_rows)) is None:
        k += 1  # k == n always fits: one row per group
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def _balanced(lengths: Sequence[int], k: int, max_tokens: int, max_rows: int | None) -> list[list[int]] | None:
    groups: list[list[int]] = [[] for _ in range(k)]
    open_groups = [(0, g) for g in range(k)]  # (tokens, group) of the groups with a row to spare: a heap
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        if not open_groups:
            return None
        tokens, g = heapq.heappop(open_groups)
        if tokens + lengths[i] > max_tokens:  # the lightest open group has the most room: none fits
            return None
        groups[g].append(i)
        if max_rows is None or len(groups[g]) < max_rows:
            heapq.heappush(open_groups, (tokens + lengths[i], g))
    return [g for g in groups if g]


def group_rows(rows: SequenceRows, share: Sequence[int], rows_per_micro_batch: int, packing: Packing, *,
               min_groups: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch of `share` (fixed chunks, or token-budget groups under use_dynamic_bsz)."""
    share = list(share)
    if not packing.dynamic:
        if rows_per_micro_batch < 1:
            raise ValueError(f"micro batch size must be >= 1, got {rows_per_micro_batch}")
        return [share[i : i + rows_per_micro_batch] for i in range(0, len(share), rows_per_micro_batch)]
    lengths = (rows.prompt_lengths + rows.response_lengths)[share].tolist() if share else []
    groups = token_budget_groups(lengths, packing.max_tokens, packing.max_rows, min_groups=min_groups,
                                 key=packing.key("max_packing_token_size"))
    return [[share[j] for j in g] for g in groups]


def dp_groups(rows: SequenceRows, rows_idx: Sequence[int], rows_per_micro_batch: int, packing: Packing, *,
              dp: int, dp_rank: int, same_count: bool = False) -> list[list[int]]:
    """This data-parallel rank's micro-batches of `rows_idx` (its contiguous share).

    Under use_dynamic_bsz every rank uses the group count of the rank that needs the most (MindSpeed-RL
    all-reduces it); every rank holds all rows, so each computes all shares' counts itself. `same_count`
    (a MoE model whose expert collectives span data-parallel ranks: moe.lockstep_data_parallel): a rank with
    fewer groups than another gets empty ones, which `build_micro_batches` makes padding micro-batches.
    """
    rows_idx = list(rows_idx)

    def share(r: int) -> list[int]:
        return [rows_idx[i] for i in dp_share(len(rows_idx), dp, r)]

    most = 1
    if packing.dynamic and dp > 1:
        most = max(len(group_rows(rows, share(r), 0, packing)) for r in range(dp))
    groups = group_rows(rows, share(dp_rank), rows_per_micro_batch, packing, min_groups=most)
    if same_count and dp > 1:
        count = max(len(group_rows(rows, share(r), rows_per_micro_batch, packing, min_groups=most)) for r in range(dp))
        groups += [[] for _ in range(count - len(groups))]
    return groups


def loss_scales(groups: Sequence[Sequence[int]], packing: Packing) -> list[float]:
    """Factor on each micro-batch's token-mean loss before Megatron's schedule divides by their count.

    MindSpeed-RL, with use_dynamic_bsz, multiplies a micro-batch's loss by its rows / (mini-batch rows on this
    rank / micro-batches), so the mini-batch loss is sum_m (rows_m / rows) * token_mean_m: micro-batches
    weighted by their share of the rows. Fixed micro-batches are weighted equally (factor 1), as upstream.
    Padding micro-batches (empty groups) weigh 0, and the others (micro-batches / real ones) more, so that
    Megatron's division by the count of all of them leaves the loss as without padding.
    """
    real = [g for g in groups if g]
    if not packing.dynamic:
        weights = [1.0] * len(real)
    else:
        total = sum(len(g) for g in real)
        weights = [len(g) * len(real) / total for g in real]
    if len(real) == len(groups):
        return weights
    pad = len(groups) / max(len(real), 1)
    it = iter(weights)
    return [next(it) * pad if g else 0.0 for g in groups]


def build_micro_batches(rows: SequenceRows, groups: Sequence[Sequence[int]], packing: Packing, *, pp: int,
                        tp: int = 1, pad_rows_to: int = 0) -> list[dict]:
    """Model inputs of each group; shapes made equal across the pass when pipeline parallel needs it.

    An empty group (dp_groups' `same_count`) becomes a padding micro-batch: the shape of one real row of the
    batch, marked `padding`, no row (-1) and an all-zero response mask; its loss must be zero (moe.inert_padding).
    """
    if not groups:
        return []
    if not all(groups):
        filler = next((g[0] for g in groups if g), 0)  # any row: the padding only needs a shape
        mbs = build_micro_batches(rows, [list(g) or [filler] for g in groups], packing, pp=pp, tp=tp,
                                  pad_rows_to=pad_rows_to)
        for g, mb in zip(groups, mbs, strict=True):
            if not g:
                mb.update(padding=True, rows=[-1] * len(mb["rows"]), response_mask=torch.zeros_like(mb["response_mask"]))
        return mbs
    if packing.remove_padding:
        one_row = thd_available()
        width = packs = 0
        if pp > 1:  # one [packs, width] for all: the widest any group needs, then the most rows at that width
            width = max(_pack_width(_lengths(rows, g), tp, one_row) for g in groups)
            packs = max(len(_place(_lengths(rows, g), width, one_row)[1]) for g in groups)
        return [make_packed_micro_batch(rows, g, width=width, pack_rows=packs, multiple=tp, one_row=one_row)
                for g in groups]
    if pp > 1:  # the longest row of all, rounded up to the TP size (sequence parallelism splits the rows)
        most = max(pad_rows_to, max(len(g) for g in groups))
        seq_len = _round_up(max(rows.max_len(), 1), tp)
        return [make_micro_batch(rows, g, pad_rows_to=most, seq_len=seq_len) for g in groups]
    return [make_micro_batch(rows, g) for g in groups]


def _lengths(rows: SequenceRows, idx: Sequence[int]) -> list[int]:
    i = torch.as_tensor(list(idx), dtype=torch.long)
    return (rows.prompt_lengths[i] + rows.response_lengths[i]).tolist()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pack_width(lengths: Sequence[int], multiple: int, one_row: bool) -> int:
    """Tokens per packed row: all of them (THD), else the longest sequence's; a multiple of `multiple`."""
    return _round_up(max(sum(lengths) if one_row else max(lengths), 1), multiple)


def _place(lengths: Sequence[int], width: int, one_row: bool) -> tuple[list[tuple[int, int]], list[int]]:
    """(row, offset) of each sequence and the tokens used in each row.

    One row: back to back in order. Otherwise first-fit decreasing into rows of `width` tokens (ties in order).
    """
    if one_row:
        offsets = itertools.accumulate(lengths, initial=0)
        return [(0, o) for o, _ in zip(offsets, lengths, strict=False)], [sum(lengths)]
    place: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    used: list[int] = []
    for j in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, u in enumerate(used) if u + lengths[j] <= width), len(used))
        if r == len(used):
            used.append(0)
        place[j] = (r, used[r])
        used[r] += lengths[j]
    return place, used


def make_packed_micro_batch(rows: SequenceRows, idx: Sequence[int], *, width: int = 0, pack_rows: int = 0,
                            multiple: int = 1, one_row: bool | None = None) -> dict:
    """Rows `idx` packed without padding between them: input_ids/position_ids [k, W].

    THD (`one_row`, default: `thd_available()`): one row, the sequences back to back (W = their token total),
    with cu_seqlens for PackedSeqParams. Mask path (CPU): rows of W = the longest sequence's tokens, each
    holding as many sequences as fit (first-fit decreasing), with a block-diagonal causal mask [k, 1, W, W]:
    attention costs what the padded layout's does per row, over fewer rows, where one row of all T tokens
    would cost T x T. W is rounded up to `multiple` (sequence parallelism splits the rows over TP ranks);
    `width` / `pack_rows` ask for at least that shape (pipeline parallel). The unused tail of a row is a
    sequence of its own (it attends to itself), never read.

    Response tensors are in packed order, one entry per response token of the rows in `idx` order:
    `resp_pos` [1, sum r] (position in its packed row of the logit that predicts it), `resp_rows` [sum r] (that
    row), `resp_tokens` [1, sum r]; `response_mask` is per row, [b, R], the layout the loss takes after
    `unpack_response`.
    """
    one_row = thd_available() if one_row is None else one_row
    idx = list(idx)
    b = len(idx)
    i = torch.as_tensor(idx, dtype=torch.long)
    p, n = rows.prompt_lengths[i], rows.response_lengths[i]
    lengths = (p + n).tolist()
    w = max(width, _pack_width(lengths, multiple, one_row))
    place, used = _place(lengths, w, one_row)
    k = max(pack_rows, len(used))
    used += [0] * (k - len(used))
    input_ids = torch.zeros((k, w), dtype=torch.long)
    position_ids = torch.zeros((k, w), dtype=torch.long)
    segment = torch.zeros((k, w), dtype=torch.long)
    routed = rows.routed_experts
    routed_mb = None if routed is None else torch.full((k, w, *routed.shape[1:]), -1, dtype=torch.long)
    resp_pos, resp_rows = [], []
    for j, ((r, o), length) in enumerate(zip(place, lengths, strict=True)):
        start = int(rows.seq_offsets[idx[j]])
        input_ids[r, o : o + length] = rows.token_ids[start : start + length]
        if routed_mb is not None:
            routed_mb[r, o : o + length] = routed[start : start + length]
        position_ids[r, o : o + length] = torch.arange(length)
        segment[r, o : o + length] = j
        # The logit at position t predicts the token at t + 1: response token c comes from prompt - 1 + c.
        resp_pos.append(o + int(p[j]) - 1 + torch.arange(int(n[j])))
        resp_rows.append(torch.full((int(n[j]),), r))
    for r in range(k):
        position_ids[r, used[r] :] = torch.arange(w - used[r])
        segment[r, used[r] :] = b + r
    pos, prow = torch.cat(resp_pos), torch.cat(resp_rows)
    if pos.numel() == 0:  # no response token at all: one dummy position keeps the shapes non-empty
        pos, prow = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    width_r = max(1, int(n.max()) if b else 1)
    cols = torch.arange(width_r)
    resp_mask = cols[None, :] < n[:, None]
    generated = response_token_mask(rows, i, resp_mask)  # loss mask; resp_mask stays the unpacking layout
    mb = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "resp_pos": pos.unsqueeze(0),
        "resp_rows": prow,
        "resp_tokens": input_ids[prow, (pos + 1).clamp(max=w - 1)].unsqueeze(0),
        "response_mask": generated.float(),
        "rows": idx,
        "packed": True,
        # flat index of each packed response token in the [b, R] per-row layout
        "unpack_index": resp_mask.flatten().nonzero().squeeze(1),
    }
    if routed_mb is not None:  # routing replay, [k, W, layers, k] beside input_ids (services/trainer/routing_replay.py)
        mb["routed_experts"] = routed_mb
    if one_row:
        seg_lens = torch.tensor(lengths + ([w - used[0]] if w > used[0] else []))
        mb["attention_mask"] = None
        mb["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), seg_lens.cumsum(0)]).int()
        mb["max_seqlen"] = int(seg_lens.max())
    else:
        causal = torch.ones((w, w), dtype=torch.bool).tril()
        allowed = (segment[:, :, None] == segment[:, None, :]) & causal
        mb["attention_mask"] = (~allowed).unsqueeze(1)  # Megatron's convention: True = not allowed
    return mb


def unpack_response(values: torch.Tensor, mb: dict) -> torch.Tensor:
    """Packed per-response-token values [1, sum r] -> per row [b, R] (0 on padding); keeps the autograd graph."""
    if not mb.get("packed"):
        return values
    b, width = mb["response_mask"].shape
    index = mb["unpack_index"].to(values.device)
    flat = values.new_zeros(b * width)
    return flat.index_copy(0, index, values[0, : index.numel()]).view(b, width)


def thd_available() -> bool:
    """Megatron's THD path needs TransformerEngine's attention on an accelerator (model.layer_spec uses it then)."""
    return megatron_compat.accelerator_present() and importlib.util.find_spec("transformer_engine") is not None


def forward_kwargs(mb: dict) -> dict:
    """Extra GPTModel arguments of a micro-batch: PackedSeqParams on the THD path."""
    if not mb.get("packed") or mb.get("attention_mask") is not None:
        return {}
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb["cu_seqlens"]
    return {"packed_seq_params": PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mb["max_seqlen"],
        max_seqlen_kv=mb["max_seqlen"])}


@contextlib.contextmanager
def rope_at_positions(model, mb: dict) -> Iterator[None]:
    """While the model runs a packed row with a mask (no THD), RoPE uses each token's own position.

    GPTModel builds the rotary table for positions 0..W-1 of a row and ignores `position_ids`; a forward
    hook on its `rotary_pos_emb` picks the table's entries at the micro-batch's per-sequence positions, which
    are exactly the angles the padded layout uses.
    """
    rope = getattr(unwrap(model), "rotary_pos_emb", None)
    if not mb.get("packed") or mb.get("attention_mask") is None or rope is None:
        yield
        return
    positions = mb["position_ids"].t()  # [W, k], Megatron's sequence-first layout

    def hook(_module, _args, out):
        # [W, 1, 1, d] table of positions 0..W-1 -> [W, k, 1, d] at each token's position
        if not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[1:3] != (1, 1):
            return out
        return out[:, 0, 0][positions.to(out.device)].unsqueeze(2)

    handle = rope.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
