"""Collective weight transport: the bytes travel by torch.distributed broadcast in a group of the trainer's rank 0
and the replicas; the `Rollout.UpdateWeights` streams carry only each bucket's names, shapes and checksum.

Each target gets the gRPC transport's bucket metadata with a `CollectiveRef` instead of the bytes, then the commit;
the replica (`CollectiveReceiver`, called from services/rollout/weights.py) receives each bucket's tensors, packed,
in one broadcast and stages them like a gRPC bucket: same checksums, commit checks, atomic apply and
acknowledgement. One broadcast feeds every replica instead of one byte stream per replica.

The group (gloo for host tensors; NCCL / HCCL, import-guarded, for tensors on those devices; its primitives are
collective_group.py's):
- formed on the first push and kept (`_SenderGroup`, one per trainer process): later pushes pay no rendezvous.
  Its TCPStore listens on the local address that routes to the targets, never every interface; its keys live
  under a random secret prefix that only travels on the token-guarded streams, so only targets can join;
- rendezvous: each replica takes a rank from a counter in the store; the sender publishes "go" once every target
  joined, or "abort: why" when a target's stream failed first (the joined ones then fail at once);
- before each bucket's broadcast every replica marks itself ready in the store; the sender polls the marks and the
  streams, so a replica that refused a bucket or died fails the push at once, not at the group timeout; every
  step (join, readiness, one broadcast) is bounded by `group_timeout_s` (at most the push deadline);
- it fails as one: every target fails (the one at fault with its own status, the others UNAVAILABLE naming it;
  DEADLINE_EXCEEDED on a timeout) and the next push forms a new group. A restarted replica is no member of the
  kept group: it refuses (UNAVAILABLE) and joins the next one.

A failed push ends in this order, so that no healthy member still holds the group once the push's failure is
reported: (1) the sender destroys its process group (that closes its connections: a member's pending broadcast
fails at once; gloo's `abort()` would leave it waiting for the group timeout), or, when the group had not formed,
has published "abort" in the store (a joining member reads it at once); (2) it ends each healthy member's stream without a commit, instead of
cancelling it, so the member reads every bucket sent before the end (a cancelled stream can end before the
member saw the new group's first bucket, and the member would keep its previous group); (3) the member, whose
step failed or whose stream ended without a commit, leaves the group before it answers
(services/rollout/update_stream.py); (4) the sender waits for those answers (at most `_ANSWER_S`: a member that does
not answer by then is stalled itself and is cancelled), then reports every target's failure and closes the store.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta as _td

import grpc
import numpy as np
import torch
import torch.distributed as dist

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.checksum import chain, combine_checksums, data_checksum
from services.common.deadlines import DEFAULT_DEADLINE_S
from services.common.tensors import dtype_code, dtype_name, itemsize
from services.common.transports.base import TargetFailure, WeightAck, WeightTransport, checked_targets
from services.common.transports.collective_group import (
    BACKENDS,
    CollectiveError,
    _bind_host,
    _code_of,
    _layout,
    broadcast,
    local_address_toward,
    new_process_group,
)
from services.common.transports.grpc_stream import Progress, _no_progress, _TargetStream

# 16 MiB as gRPC: a packed bucket is a fresh buffer on each side, and glibc serves up to 32 MiB from its heap,
# larger ones from fresh mmaps whose first-touch page faults cost more than the broadcast.
DEFAULT_COLLECTIVE_BUCKET_BYTES = 16 << 20
# A step of the group that takes longer has failed: one broadcast of the largest tensor (an embedding of a few
# GB) takes seconds over gloo.
DEFAULT_GROUP_TIMEOUT_S = 120.0
_POLL_S = (0.0002, 0.01)  # first and longest sleep between polls of the store
# A member whose group the sender destroyed answers its ended stream in milliseconds (its join reads the abort,
# its broadcast sees the connections close); one that has not answered within this is stalled itself.
_ANSWER_S = 10.0


@dataclasses.dataclass
class _SenderGroup:
    targets: frozenset[str]
    backend: int
    host: str
    timeout_s: float
    store: dist.Store
    keys: dist.Store  # the store under the group's secret prefix
    address: str
    group_id: str
    pg: object | None = None  # formed at the first push's rendezvous

    @classmethod
    def create(cls, targets: Sequence[str], backend: int, timeout_s: float) -> _SenderGroup:
        host = _bind_host(targets)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, 0), family=family, backlog=128)
        port = sock.getsockname()[1]
        # The store takes over the bound socket (so torch never listens on every interface); it closes it.
        store = dist.TCPStore(host, port, None, True, timeout=_td(timeout_s), wait_for_workers=False,
                              master_listen_fd=sock.detach())
        group_id = secrets.token_hex(16)
        address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        return cls(frozenset(targets), backend, host, timeout_s, store, dist.PrefixStore(group_id, store), address,
                   group_id)

    def ref(self, push_id: str) -> common_pb2.CollectiveRef:
        return common_pb2.CollectiveRef(store_address=self.address, group_id=self.group_id,
                                        world_size=len(self.targets) + 1, backend=self.backend,
                                        timeout_s=self.timeout_s, push_id=push_id)


_LOCK = threading.Lock()
_GROUP: list[_SenderGroup] = []  # the kept group of this process (at most one)


def drop_group() -> None:
    """Forget the kept group (its store and connections close): the next push forms a new one."""
    _GROUP.clear()


class CollectiveTransport(WeightTransport):
    """Broadcasts each bucket's bytes in the kept group; streams the metadata (module docstring).

    Takes GrpcStreamTransport's arguments, plus `group_timeout_s` (each step of the group; default
    min(timeout_s, 120 s))."""

    def __init__(self, targets: Sequence[str], *, bucket_bytes: int = 0, timeout_s: float = DEFAULT_DEADLINE_S,
                 token: str | None = None, on_progress: Progress | None = None, total_bytes: int = 0,
                 max_queued_buckets: int = 2, group_timeout_s: float | None = None) -> None:
        self.targets = checked_targets(targets)
        self.bucket_bytes = bucket_bytes or DEFAULT_COLLECTIVE_BUCKET_BYTES
        self.timeout_s = timeout_s
        self.group_timeout_s = min(timeout_s, group_timeout_s or DEFAULT_GROUP_TIMEOUT_S)
        self.token = token
        self.on_progress = on_progress or _no_progress
        self.total_bytes = total_bytes
        self.max_queued_buckets = max_queued_buckets

    def _buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[
            list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor.detach().contiguous()))
            size += nbytes
        if bucket:
            yield bucket

    def _group(self, backend: int) -> _SenderGroup:
        if _GROUP and (_GROUP[0].targets != frozenset(self.targets) or _GROUP[0].backend != backend):
            drop_group()  # other members: a group cannot change its members
        if not _GROUP:
            _GROUP.append(_SenderGroup.create(self.targets, backend, self.group_timeout_s))
        return _GROUP[0]

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[
            str, WeightAck | TargetFailure]:
        deadline = time.monotonic() + self.timeout_s
        push_id = uuid.uuid4().hex[:12]
        with _LOCK:
            streams: list[_TargetStream] = []
            group: _SenderGroup | None = None
            ok = False
            try:
                for t in self.targets:  # appended one by one: `finally` closes those opened before a failure
                    streams.append(_TargetStream(t, token=self.token, timeout_s=self.timeout_s,
                                                 max_queued=self.max_queued_buckets, total=self.total_bytes,
                                                 on_progress=self.on_progress))
                checksums: list[int] = []
                for index, bucket in enumerate(self._buckets(named_tensors)):
                    if group is None:
                        group = self._group(BACKENDS.get(bucket[0][1].device.type, common_pb2.COLLECTIVE_BACKEND_GLOO))
                    chunk, flat = self._chunk(version, index, bucket, group.ref(push_id))
                    size = flat.numel()
                    checksums.append(chunk.bucket.checksum)
                    for s in streams:
                        s.offer((chunk, size), deadline)
                    if group.pg is None:
                        self._rendezvous(group, streams, deadline)
                    self._wait(group.keys, f"{push_id}/ready/{index}", len(streams), streams, deadline)
                    if size:
                        broadcast(group.pg, flat)
                checksum = combine_checksums(checksums)
                if checksums:
                    commit = rollout_pb2.WeightUpdateChunk(commit=common_pb2.WeightCommit(
                        version=version, num_buckets=len(checksums), checksum=checksum))
                    for s in streams:
                        s.offer((commit, 0), deadline)
                for s in streams:
                    s.offer(None, deadline)
                outcomes = {s.target: s.outcome(version, checksum, deadline) for s in streams}
                ok = all(isinstance(o, WeightAck) for o in outcomes.values())
                if ok and group is not None:
                    for i in range(len(checksums)):  # the kept store holds no key per push
                        group.keys.delete_key(f"{push_id}/ready/{i}")
                return outcomes
            except CollectiveError as e:
                if group is not None:
                    group.pg = None  # destroyed: its connections close, a member's broadcast fails now
                    traceback.clear_frames(e.__traceback__)  # a failed broadcast's frame holds the group too
                return self._failed(streams, e, deadline)
            finally:
                if not ok and group is not None:
                    group.pg = None
                for s in streams:
                    s.close()
                if not ok:
                    drop_group()  # the members' states are in doubt: the next push forms a new group

    @staticmethod
    def _chunk(version: int, index: int, bucket: list[tuple[str, torch.Tensor]],
               ref: common_pb2.CollectiveRef) -> tuple[rollout_pb2.WeightUpdateChunk, torch.Tensor]:
        """The bucket's metadata chunk, and its tensors' bytes packed into one buffer: one broadcast per bucket
        (per-tensor broadcasts of the 1-10 MB tensors of a layer measured ~30% slower than the copy costs)."""
        chunk = rollout_pb2.WeightUpdateChunk()
        chunk.bucket.version, chunk.bucket.index = version, index
        chunk.bucket.collective.CopyFrom(ref)
        raw = [t.reshape(-1).view(torch.uint8) for _, t in bucket]
        offsets, total = _layout([r.numel() for r in raw])
        flat = raw[0] if len(raw) == 1 else torch.zeros(total, dtype=torch.uint8, device=raw[0].device)
        for r, at in zip(raw, offsets, strict=True) if len(raw) > 1 else ():
            flat[at:at + r.numel()].copy_(r)
        host = flat.cpu().numpy()  # the checksum reads host bytes (a device bucket is copied once for it)
        for name, tensor in bucket:
            named = chunk.bucket.tensors.add()
            named.name = name
            named.tensor.dtype = dtype_code(tensor.dtype)
            named.tensor.shape.extend(tensor.shape)
        chunk.bucket.checksum = chain(data_checksum(host[at:at + r.numel()]) for r, at in zip(raw, offsets, strict=True))
        return chunk, flat

    def _rendezvous(self, group: _SenderGroup, streams: list[_TargetStream], deadline: float) -> None:
        try:
            self._wait(group.keys, "joined", len(streams), streams, deadline)
        except CollectiveError as e:
            group.keys.set("go", f"abort: {e}")  # the joined replicas fail now, not at their timeout
            raise
        group.keys.set("go", "go")
        try:
            group.pg = new_process_group(group.backend, group.keys, 0, len(streams) + 1, group.timeout_s, group.host)
        except RuntimeError as e:
            raise CollectiveError(_code_of(e), f"forming the collective group failed: {e}") from e

    def _wait(self, keys: dist.Store, key: str, count: int, streams: list[_TargetStream], deadline: float) -> None:
        """Until the counter `key` reaches `count`; fails as soon as a stream ended or the group timeout passed."""
        until = min(deadline, time.monotonic() + self.group_timeout_s)
        pause = _POLL_S[0]
        while keys.add(key, 0) < count:
            dead = [s for s in streams if not s.alive()]
            if dead:
                raise CollectiveError("UNAVAILABLE", f"{', '.join(s.target for s in dead)} left the collective "
                                   f"group (its UpdateWeights stream ended) while the group waited on {key!r}", dead)
            if time.monotonic() > until:
                raise CollectiveError("DEADLINE_EXCEEDED", f"{keys.add(key, 0)} of {count} targets reached {key!r} "
                                   f"within the group timeout ({self.group_timeout_s:g} s)")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])

    def _failed(self, streams: list[_TargetStream], e: CollectiveError,
                deadline: float) -> dict[str, WeightAck | TargetFailure]:
        """Every target fails: the culprits with their own status, the others naming the group's failure."""
        # A stream that already ended is the likeliest culprit of a broken broadcast too.
        culprits = set(e.culprits) | {s for s in streams if s.call.done()}
        members = [s for s in streams if s not in culprits]
        until = min(deadline, time.monotonic() + min(self.group_timeout_s, _ANSWER_S))
        for s in members:  # ended, not cancelled: each member reads what was sent, leaves the group and answers
            s.offer(None, until)
        for s in members:
            try:
                s.call.exception(timeout=max(0.0, until - time.monotonic()))
            except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
                pass  # stalled: cancelled by `fail` below
        out: dict[str, WeightAck | TargetFailure] = {}
        for s in streams:
            if s in culprits:
                got = s.outcome(0, 0, min(deadline, time.monotonic() + 5))
                out[s.target] = got if isinstance(got, TargetFailure) else TargetFailure(s.target, e.code, str(e))
            else:
                s.fail(e.code, f"the collective group failed: {e}")
                out[s.target] = s.outcome(0, 0, deadline)
        return out


class CollectiveReceiver:
    """The replica's side: the group it is a member of (kept across pushes), and receiving a bucket's bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._id: str | None = None
        self._pg = None
        self._keys: dist.Store | None = None

    def close(self) -> None:
        """Leave the group (as a restarted replica would have)."""
        with self._lock:
            self._id, self._pg, self._keys = None, None, None

    def leave(self, group_id: str) -> None:
        """Leave `group_id` if this replica is its member: a stream of that group failed, and the sender drops
        the group on every failed push (module docstring: the replica leaves before it answers)."""
        with self._lock:
            if self._id == group_id:
                self._id, self._pg, self._keys = None, None, None

    def receive(self, bucket: common_pb2.WeightBucket) -> list[np.ndarray]:
        """The bytes of each tensor of `bucket` (uint8 arrays, in order); raises CollectiveError."""
        ref = bucket.collective
        sizes = []
        for named in bucket.tensors:
            if any(d < 0 for d in named.tensor.shape):
                raise CollectiveError("INVALID_ARGUMENT", f"{named.name!r}: negative dimension")
            try:
                dtype_name(named.tensor.dtype)
                sizes.append(math.prod(named.tensor.shape) * itemsize(named.tensor.dtype))
            except ValueError as e:
                raise CollectiveError("INVALID_ARGUMENT", f"{named.name!r}: {e}") from e
            if named.tensor.data:
                raise CollectiveError("INVALID_ARGUMENT", "a collective bucket carries the bytes in the group, not `data`")
        with self._lock:
            try:
                if ref.group_id != self._id:
                    self._join(ref)
                assert self._keys is not None
                self._keys.add(f"{ref.push_id}/ready/{bucket.index}", 1)
                device = torch.device(next(d for d, b in BACKENDS.items() if b == ref.backend))
                offsets, total = _layout(sizes)
                buf = torch.empty(total, dtype=torch.uint8, device=device)  # the bucket, packed as the sender did
                if total:
                    broadcast(self._pg, buf)
                host = buf.cpu().numpy()  # the staging and the checksum read host memory
                return [host[at:at + n] for at, n in zip(offsets, sizes, strict=True)]
            except CollectiveError:
                self._id, self._pg, self._keys = None, None, None  # the sender drops the group too
                raise
            except RuntimeError as e:  # the store: refused connection, timeout
                self._id, self._pg, self._keys = None, None, None
                raise CollectiveError(_code_of(e), f"collective group {ref.group_id[:8]}...: {e}") from e

    def _join(self, ref: common_pb2.CollectiveRef) -> None:
        self._id, self._pg, self._keys = None, None, None  # drop the old group's connections first
        if ref.backend not in BACKENDS.values():
            raise CollectiveError("INVALID_ARGUMENT", f"collective backend {ref.backend} is not one of "
                                                      f"{sorted(BACKENDS.values())}")
        if not 0 < ref.timeout_s <= 3600 or ref.world_size < 2:
            raise CollectiveError("INVALID_ARGUMENT", f"collective group: timeout_s {ref.timeout_s} (0, 3600] and "
                                                      f"world_size {ref.world_size} >= 2 required")
        host, _, port = ref.store_address.rpartition(":")
        host = host.strip("[]")
        store = dist.TCPStore(host, int(port), None, False, timeout=_td(ref.timeout_s))
        keys = dist.PrefixStore(ref.group_id, store)
        rank = keys.add("joined", 1)
        if rank >= ref.world_size:
            raise CollectiveError("UNAVAILABLE", f"this replica is not a member of collective group "
                                                 f"{ref.group_id[:8]}... (it formed before this replica started); "
                                                 "the next push forms a new group")
        go = keys.get("go").decode()
        if go != "go":
            raise CollectiveError("UNAVAILABLE", f"the sender gave up forming the collective group: {go}")
        self._pg = new_process_group(ref.backend, keys, rank, ref.world_size, ref.timeout_s,
                                     local_address_toward(host))
        self._id, self._keys = ref.group_id, keys
