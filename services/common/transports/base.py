"""The weight transport interface: send one version of named tensors, get one outcome per target."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable

import torch


@dataclasses.dataclass(frozen=True)
class WeightAck:
    """A target applied `version`; `checksum` is what it acknowledged (verified against what was sent)."""

    target: str
    version: int
    checksum: int
    num_tensors: int
    num_bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class TargetFailure:
    """A target that did not apply the version (`code`: a gRPC status name); it keeps its old weights."""

    target: str
    code: str
    message: str


class WeightTransport(abc.ABC):
    """Moves the tensors of one weights version to every target of the transport."""

    @abc.abstractmethod
    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, WeightAck | TargetFailure]:
        """Consume `named_tensors` (HF names, final dtype) once; return each target's outcome."""


def checked_targets(targets: Iterable[str]) -> list[str]:
    """The targets of one push as a list: at least one, no duplicates (each gets one stream and one outcome)."""
    targets = list(targets)
    if not targets:
        raise ValueError("targets is empty: give at least one rollout endpoint (host:port)")
    if len(set(targets)) != len(targets):
        raise ValueError(f"targets has duplicates: {targets}")
    return targets
