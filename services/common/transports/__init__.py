"""Weight transports: how one version of HF-named tensors travels from the trainer to the rollout replicas.

`TRANSPORTS` maps the `PushWeightsRequest.transport` values (the `WeightTransport` enum) to implementations
(base.py has the interface); it lists exactly the transports that exist.
"""

from __future__ import annotations

from rlfabric.v1 import trainer_pb2
from services.common.transports.base import TargetFailure, WeightAck, WeightTransport
from services.common.transports.collective import CollectiveTransport
from services.common.transports.grpc_stream import GrpcStreamTransport
from services.common.transports.shm import ShmTransport

TRANSPORTS: dict[int, type[WeightTransport]] = {
    trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM: GrpcStreamTransport,
    trainer_pb2.WEIGHT_TRANSPORT_SHM: ShmTransport,
    trainer_pb2.WEIGHT_TRANSPORT_COLLECTIVE: CollectiveTransport,
}

__all__ = ["TRANSPORTS", "CollectiveTransport", "GrpcStreamTransport", "ShmTransport", "TargetFailure", "WeightAck", "WeightTransport"]
