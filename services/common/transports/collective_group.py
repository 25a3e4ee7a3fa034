"""The process-group primitives of the collective weight transport (services/common/transports/collective.py):
the backend of each device type, the address a group binds, a process group outside torch's default one, the
packed layout of a bucket and the broadcast that moves it."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta as _td
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlfabric.v1 import common_pb2

if TYPE_CHECKING:
    from services.common.transports.grpc_stream import _TargetStream

BACKENDS = {"cpu": common_pb2.COLLECTIVE_BACKEND_GLOO, "cuda": common_pb2.COLLECTIVE_BACKEND_NCCL,
            "npu": common_pb2.COLLECTIVE_BACKEND_HCCL}


class CollectiveError(RuntimeError):
    """A step of the group failed; `code`: the gRPC status name; `culprits`: the streams at fault, when known."""

    def __init__(self, code: str, message: str, culprits: Sequence[_TargetStream] = ()) -> None:
        super().__init__(message)
        self.code, self.culprits = code, list(culprits)


def _code_of(e: BaseException) -> str:
    return "DEADLINE_EXCEEDED" if any(w in str(e).lower() for w in ("timed out", "timeout")) else "UNAVAILABLE"


def local_address_toward(host: str) -> str:
    """This machine's address on the route to `host` (the interface a peer there reaches us on)."""
    try:
        family = socket.getaddrinfo(host, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _bind_host(targets: Sequence[str]) -> str:
    """What the store and gloo bind: a non-loopback route if a target needs one (loopback peers reach it too)."""
    routes = [local_address_toward(t.rsplit(":", 1)[0].strip("[]")) for t in targets]
    remote = [r for r in routes if not r.startswith("127.") and r != "::1"]
    return remote[0] if remote else routes[0]


def new_process_group(backend: int, store, rank: int, world: int, timeout_s: float, host: str):
    """A process group outside torch's default one (the trainer's own group stays untouched)."""
    if backend == common_pb2.COLLECTIVE_BACKEND_GLOO:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _td(timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # not every interface
        return dist.ProcessGroupGloo(store, rank, world, opts)
    if backend == common_pb2.COLLECTIVE_BACKEND_NCCL:
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise CollectiveError("FAILED_PRECONDITION", "this torch has no NCCL: the nccl backend needs CUDA")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    if backend == common_pb2.COLLECTIVE_BACKEND_HCCL:
        try:
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        except ImportError as e:
            raise CollectiveError("FAILED_PRECONDITION", "torch_npu is not installed: the hccl backend needs it") from e
        opts = ProcessGroupHCCL.Options()
        opts._timeout = _td(timeout_s)
        return ProcessGroupHCCL(store, rank, world, opts)
    raise CollectiveError("INVALID_ARGUMENT", f"collective backend {backend} is not one of {sorted(BACKENDS.values())}")


def _layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of a bucket's tensors packed into one buffer (64-byte aligned: the receiver's views are tensors),
    and its size; one tensor alone is its own buffer."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // 64) * 64
    return offsets, (offsets[-1] + sizes[-1] if sizes else 0)


def broadcast(pg, tensor: torch.Tensor) -> None:
    """Broadcast from rank 0 (in place on the other ranks); raises CollectiveError."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        pg.broadcast([tensor], opts).wait()
    except RuntimeError as e:
        raise CollectiveError(_code_of(e), f"broadcast failed: {e}") from e
