"""Weight transports: how one version of HF-named tensors travels from the trainer to the rollout replicas.

`TRANSPORTS` maps the `PushWeightsRequest.transport` names to implementations (base.py has the interface).
"""

from __future__ import annotations

from services.common.transports.base import TargetFailure, WeightAck, WeightTransport
from services.common.transports.grpc_stream import GrpcStreamTransport

TRANSPORTS: dict[str, type[WeightTransport]] = {"grpc": GrpcStreamTransport}

__all__ = ["TRANSPORTS", "GrpcStreamTransport", "TargetFailure", "WeightAck", "WeightTransport"]
