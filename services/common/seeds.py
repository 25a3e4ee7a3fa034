"""Per-sample sampling seeds: one stream per (run seed, prompt group, sample index).

A group id names its iteration, batch and prompt (the coordinator builds `it{iteration}/b{batch}/p{prompt}`), so
deriving each sample's seed from the group id gives every (iteration, group, sample) its own random stream, and
asking for the same group again (a retry, a resumed run) redraws exactly the same samples. `base + index` would not do: it hands
sample i of every group, in every iteration, the same stream, and the policy then learns those streams.
"""

from __future__ import annotations

import hashlib

_SEED_MASK = (1 << 63) - 1  # non-negative int64: vLLM and torch generators accept it


def sample_seed(base: int, group_id: str, index: int) -> int:
    """The seed of sample `index` of group `group_id` under run seed `base` (stable across processes)."""
    digest = hashlib.blake2b(f"{base}\x00{group_id}\x00{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK
