"""One sample as the engine takes it (`SampleRequest`) and gives it back (`SampleResult`).

A sample that is never generated (refused prompt, weights changed before it started, aborted) is built in
one place, `SampleResult.failed`, whoever decides it: the engine or the servicer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.rollout.options import SamplingOptions

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_INTERRUPTED = "interrupted"  # ended by the caller; the response so far
FINISH_ERROR = "error"


@dataclass(frozen=True)
class SampleRequest:
    """One sample to generate."""

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingOptions
    # When non-zero, the sample starts only if the engine still holds this version when it is admitted.
    expected_weights_version: int = 0


@dataclass
class SampleResult:
    """One finished (or failed) sample."""

    request_id: str
    response_token_ids: np.ndarray  # int32 [response_length]
    response_log_probs: np.ndarray  # float32 [response_length]
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH | FINISH_ABORT | FINISH_ERROR
    prompt_length: int
    weights_version: int
    error: str = ""
    finished_at: float = field(default_factory=time.monotonic)  # time.monotonic()
    # With EngineOptions.return_routed_experts: int32 [prompt_length + response_length - 1, moe_layers, top_k],
    # the experts each MoE layer chose at each position (routed_experts.py); None otherwise.
    routed_experts: np.ndarray | None = None

    @classmethod
    def failed(cls, request: SampleRequest, version: int, reason: str, error: str) -> SampleResult:
        """A sample without a response: `reason` is FINISH_ERROR or FINISH_ABORT, `error` says why."""
        return cls(
            request_id=request.request_id,
            response_token_ids=np.zeros(0, dtype=np.int32),
            response_log_probs=np.zeros(0, dtype=np.float32),
            finish_reason=reason,
            prompt_length=len(request.prompt_token_ids),
            weights_version=version,
            error=error,
        )
