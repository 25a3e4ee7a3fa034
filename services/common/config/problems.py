"""What a configuration rule reports: a `Problem` (the keys it is about, and the message).

Every rule module (validation.py and the topic modules it gathers: algorithm, resume, activations, moe,
loss_variants) yields these, and the loader turns them into errors pointing at the file:line of the first key.
Kept apart so the topic modules need nothing of validation.py, which imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig


@dataclass(frozen=True)
class Problem:
    """A broken rule: the keys involved (first = the one to point at) and the message."""

    keys: tuple[str, ...]
    message: str


Rule = Callable[["RLFabricConfig"], Iterable[Problem]]
