"""Shard slices and tensor recipes: how one Hugging Face tensor is composed from Megatron rank shards, and back.

The layout itself (which slices of which ranks) is services/common/weight_layout.py's `recipes`; this module
only applies recipes, pure torch tensor ops, no Megatron import, no I/O.

A `TensorRecipe` says which shard slices compose one HF tensor: each `ShardSlice` views a shard's dim 0 as
[groups, block] and keeps rows [start, stop) of every block (a QKV part, a gate/up half, the unpadded
vocabulary rows, or everything); the pieces are concatenated along `concat_dim`. The mapping is pure slicing
and concatenation, so HF -> mcore -> HF is bitwise exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

ShardKey = tuple[int, int, int]  # (tp_rank, pp_rank, ep_rank); ep_rank is 0 without expert parallelism


def shard_key(key: Sequence[int]) -> ShardKey:
    """(tp_rank, pp_rank[, ep_rank]) as a ShardKey: a rank key without an ep_rank is a rank without EP."""
    if len(key) not in (2, 3):
        raise ValueError(f"a rank key is (tp_rank, pp_rank) or (tp_rank, pp_rank, ep_rank), got {tuple(key)}")
    t, p, *e = (int(k) for k in key)
    return (t, p, e[0] if e else 0)


@dataclasses.dataclass(frozen=True)
class ShardSlice:
    """Rows [start, stop) of every block when shard `name` of rank (tp_rank, pp_rank, ep_rank) is viewed as
    [groups, block, ...]."""

    name: str  # stage-local Megatron name (experts numbered locally to their EP rank)
    tp_rank: int
    pp_rank: int
    shard_shape: tuple[int, ...]
    groups: int = 1
    start: int = 0
    stop: int | None = None  # None: to the end of the block
    ep_rank: int = 0

    @property
    def key(self) -> ShardKey:
        return (self.tp_rank, self.pp_rank, self.ep_rank)

    @property
    def rank_text(self) -> str:
        """"tp_rank T, pp_rank P[, ep_rank E]", for messages."""
        return f"tp_rank {self.tp_rank}, pp_rank {self.pp_rank}" + (f", ep_rank {self.ep_rank}" if self.ep_rank else "")

    @property
    def _block(self) -> int:
        return self.shard_shape[0] // self.groups

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the piece this slice takes."""
        stop = self._block if self.stop is None else self.stop
        return (self.groups * (stop - self.start), *self.shard_shape[1:])

    @property
    def whole(self) -> bool:
        return self.groups == 1 and self.start == 0 and self.stop in (None, self.shard_shape[0])

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        """The piece of `shard` (a view when the slice is the whole shard or one contiguous range)."""
        if tuple(shard.shape) != self.shard_shape:
            raise ValueError(f"{self.name} ({self.rank_text}): shard has shape {tuple(shard.shape)}, the layout "
                             f"expects {self.shard_shape}")
        if self.whole:
            return shard
        tail = self.shard_shape[1:]
        return shard.reshape(self.groups, self._block, *tail)[:, self.start:self.stop].reshape(-1, *tail)

    def put(self, shard: torch.Tensor, piece: torch.Tensor) -> None:
        """Write `piece` into its rows of `shard` (the inverse of `take`)."""
        tail = self.shard_shape[1:]
        shard.reshape(self.groups, self._block, *tail)[:, self.start:self.stop].copy_(
            piece.reshape(self.groups, -1, *tail))


@dataclasses.dataclass(frozen=True)
class TensorRecipe:
    """How one HF tensor is composed from Megatron shard slices."""

    hf_name: str
    hf_shape: tuple[int, ...]
    sources: tuple[ShardSlice, ...]  # concatenated in this order along concat_dim
    concat_dim: int
    relay: str = ""  # "", "qkv:q|k|v" or "gate_up:gate|up" (the re-lay the slices perform), "vocab" (pad cut)
    mirrors: tuple[tuple[ShardSlice, ...], ...] = ()  # other shards with the same values (TP / EP replicas, tied copy)
    layer: int | None = None


def assemble(recipe: TensorRecipe, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The HF tensor from the pieces `source.take(shard)` of `recipe.sources`, in order (a new tensor)."""
    return torch.cat(list(pieces), dim=recipe.concat_dim)


def split(recipe: TensorRecipe, hf: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of `assemble`: the piece of `hf` that each source slice holds."""
    if tuple(hf.shape) != recipe.hf_shape:
        raise ValueError(f"{recipe.hf_name}: shape {tuple(hf.shape)}, expected {recipe.hf_shape}")
    sizes = [s.shape[recipe.concat_dim] for s in recipe.sources]
    return list(hf.split(sizes, dim=recipe.concat_dim))


def to_hf(
    recipe_list: Sequence[TensorRecipe], fetch: Callable[[ShardSlice], torch.Tensor]
) -> Iterator[tuple[TensorRecipe, torch.Tensor]]:
    """Assemble each recipe's HF tensor from `fetch(slice)` (the whole shard the slice reads), one at a time."""
    for r in recipe_list:
        yield r, assemble(r, [s.take(fetch(s)) for s in r.sources])


def to_mcore(
    recipe_list: Sequence[TensorRecipe], hf: Callable[[str], torch.Tensor], only: Sequence[int] | None = None,
    on_recipe: Callable[[TensorRecipe], None] | None = None,
) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """Scatter HF tensors (`hf(name)`) into rank state dicts keyed by (tp_rank, pp_rank, ep_rank).

    Shards start as zeros, so vocabulary padding rows are zero. `only` builds one rank's dict.
    """
    want = None if only is None else shard_key(only)
    shards: dict[ShardKey, dict[str, torch.Tensor]] = {}
    for r in recipe_list:
        pieces = split(r, hf(r.hf_name))
        for mirror in (r.sources, *r.mirrors):
            for s, piece in zip(mirror, pieces, strict=True):
                if want is not None and s.key != want:
                    continue
                dst = shards.setdefault(s.key, {})
                if s.name not in dst:
                    dst[s.name] = torch.zeros(s.shard_shape, dtype=piece.dtype)
                s.put(dst[s.name], piece)
        if on_recipe is not None:
            on_recipe(r)
    return shards
