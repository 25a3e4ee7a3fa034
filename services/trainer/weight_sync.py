"""The trainer side of a weight sync: gather the plan's shard slices to rank 0 and stream HF tensors out.

`push_weights(worker, ...)` runs on every rank in lockstep (a CommandBus operation). All ranks read the
same `ReshardPlan` (services/common/reshard_plan.py) and walk its tensors in order: for every source slice,
the rank holding that shard (the DP-rank-0 copy) cuts the slice, casts it to the tensor's dtype in the plan and
sends it to rank 0 over torch.distributed (gloo on CPU); rank 0 assembles one HF tensor at a time
(services/common/weight_layout.py) and hands it to the transport, which buckets and streams it to every
target. So rank 0 holds one HF tensor plus a few buckets, never a second copy of the model.

With expert parallelism (a MoE plan, `trainer_ep` > 1) a slice is keyed (tp_rank, pp_rank, ep_rank): an expert
slice (`mlp.experts.local_experts.i`, numbered on its EP rank) comes from the rank at that position whose
expert-data-parallel rank is 0 (the first copy of those experts); every other slice names EP rank 0 and comes
from the DP-rank-0 copy as without experts (the EP ranks hold the same values). Each per-expert HF tensor is
then one more tensor of the stream, so every transport carries it as it carries the dense ones.

What is sent is the model's parameters cast to the plan's dtype. With `bf16: true` the optimizer keeps fp32 master
weights and sets each bf16 parameter to the round-to-nearest cast of its master after every step and every load
(services/trainer/optimizer.py), so for a bf16 rollout (the configuration validation asks for) the parameters are
exactly the masters cast to the rollout dtype; a rollout in another dtype gets the bf16 values, as upstream's
weight sync sends them too. A tensor the replica keeps in a dtype of its own (the plan names it: vLLM's float32
e_score_correction_bias in a bf16 engine, while the trainer keeps the router's expert bias in float32 too) is sent
in that dtype, so small bias updates are not rounded away on the way.

Before any byte moves, every rank checks its own shards against the plan and the ranks agree on the outcome
(one all-gather), so a plan that does not fit fails on all ranks instead of leaving some blocked in a send.
Rank 0 always consumes the whole plan, even when every target has failed, for the same reason.

The group adopts the pushed version as the label of its weights only when every target acknowledged it
(rank 0 tells the others in one broadcast): a failed push leaves the label where it was.

Progress reaches the gRPC handler through `progress_sink(push_id)`: the servicer registers a callback under
the push id it passes to the operation (the operation's arguments must be picklable, a callback is not).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import uuid
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from rlfabric.v1 import trainer_pb2
from services.common import tensor_recipes, weight_layout
from services.common.reshard_plan import ReshardPlan
from services.common.transports import TRANSPORTS, TargetFailure, WeightAck
from services.trainer.model import canonical_name
from services.trainer.weights_export import check_expert_layout, exported_tensors

logger = logging.getLogger(__name__)

_SINKS: dict[str, Callable[..., None]] = {}
_SINKS_LOCK = threading.Lock()


def register_sink(push_id: str, sink: Callable[..., None] | None) -> None:
    """Route progress of push `push_id` to `sink(target, sent, total, done, checksum)` (None removes it)."""
    with _SINKS_LOCK:
        if sink is None:
            _SINKS.pop(push_id, None)
        else:
            _SINKS[push_id] = sink


def _sink(push_id: str) -> Callable[..., None] | None:
    with _SINKS_LOCK:
        return _SINKS.get(push_id)


class PushRun:
    """Runs `start(push_id)` (the push operation) on a thread; iterating yields its progress events
    `(target, bytes_sent, bytes_total, done, checksum)` until it ends; `result()` returns or re-raises."""

    _END = object()

    def __init__(self, start: Callable[[str], dict]) -> None:
        self._events: queue.Queue = queue.Queue()
        self._outcome: dict = {}
        self._push_id = uuid.uuid4().hex
        register_sink(self._push_id, lambda *event: self._events.put(event))
        self._thread = threading.Thread(target=self._run, args=(start,), name="push-weights", daemon=True)
        self._thread.start()

    def _run(self, start: Callable[[str], dict]) -> None:
        try:
            self._outcome["result"] = start(self._push_id)
        except Exception as e:  # noqa: BLE001 - re-raised by result()
            self._outcome["error"] = e
        finally:
            register_sink(self._push_id, None)
            self._events.put(self._END)

    def __iter__(self) -> Iterator[tuple]:
        while (event := self._events.get()) is not self._END:
            yield event

    def result(self) -> dict:
        self._thread.join()
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["result"]


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj) -> list:
    rank, world = _rank_and_world()
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


@dataclasses.dataclass(frozen=True)
class _Position:
    """Where a rank sits, as the owner table needs it (all-gathered: picklable)."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int = 0
    edp_rank: int = 0  # expert-data-parallel rank: 0 on the first copy of this EP rank's experts


def _position(layout) -> _Position:
    from megatron.core import parallel_state as ps

    edp_rank = ps.get_expert_data_parallel_rank() if layout.ep > 1 else layout.dp_rank
    return _Position(layout.tp_rank, layout.pp_rank, layout.dp_rank, layout.ep_rank, edp_rank)


def local_parameters(model) -> dict[str, torch.Tensor]:
    """This rank's exported tensors (parameters and routers' expert bias) by stage-local, canonical Megatron name."""
    return {canonical_name(n): p.detach() for n, p in exported_tensors(model)}


def _mine(s: tensor_recipes.ShardSlice, pos: _Position) -> bool:
    """Whether this rank is the one sending slice `s` (see module docstring)."""
    if (s.tp_rank, s.pp_rank) != (pos.tp_rank, pos.pp_rank):
        return False
    if weight_layout.is_expert_shard(s.name):
        return s.ep_rank == pos.ep_rank and pos.edp_rank == 0
    return pos.dp_rank == 0


def _check_local(plan: ReshardPlan, params: dict[str, torch.Tensor], pos: _Position) -> str | None:
    for r in plan.tensors:
        for s in r.sources:
            if not _mine(s, pos):
                continue
            p = params.get(s.name)
            if p is None:
                return f"plan tensor {r.hf_name!r} needs {s.name!r} of {s.rank_text}: no such parameter"
            if tuple(p.shape) != s.shard_shape:
                return (f"plan tensor {r.hf_name!r} needs {s.name!r} of {s.rank_text} with shape "
                        f"{s.shard_shape}, the rank holds {tuple(p.shape)}")
    return None


def _owners(everyone: list[_Position]) -> dict[tuple[bool, tensor_recipes.ShardKey], int]:
    """(expert slice?, slice key) -> the global rank sending it; every rank computes the same table."""
    owners: dict[tuple[bool, tensor_recipes.ShardKey], int] = {}
    for rank, pos in enumerate(everyone):
        if pos.dp_rank == 0:
            owners.setdefault((False, (pos.tp_rank, pos.pp_rank, 0)), rank)
        if pos.edp_rank == 0:
            owners.setdefault((True, (pos.tp_rank, pos.pp_rank, pos.ep_rank)), rank)
    return owners


def plan_dtypes(plan: ReshardPlan, params: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """HF name -> the dtype each tensor of the plan is sent in (the plan's, or the tensor's own where the plan gives
    one); a plan without a dtype keeps the trainer's parameters' dtype."""
    default = next(iter(params.values())).dtype
    out: dict[str, torch.dtype] = {}
    for r in plan.tensors:
        name = plan.dtype_of(r.hf_name)
        dtype = getattr(torch, name, None) if name else default
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"plan dtype {name!r} of {r.hf_name!r} is not a torch dtype")
        out[r.hf_name] = dtype
    return out


def hf_tensors(plan: ReshardPlan, params: dict[str, torch.Tensor],
               owners: dict[tuple[bool, tensor_recipes.ShardKey], int],
               dtypes: dict[str, torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every rank runs this to the end; only rank 0 yields anything (the assembled HF tensors, each in its dtype
    of `dtypes`, plan_dtypes)."""
    rank, _ = _rank_and_world()
    device = next(iter(params.values())).device
    for r in plan.tensors:
        dtype = dtypes[r.hf_name]
        pieces = []
        for s in r.sources:
            owner = owners[(weight_layout.is_expert_shard(s.name), s.key)]
            if owner == rank:
                piece = s.take(params[s.name]).to(dtype)
                if rank == 0:
                    pieces.append(piece)
                else:
                    dist.send(piece.contiguous(), dst=0)
            elif rank == 0:
                buf = torch.empty(s.shape, dtype=dtype, device=device)
                dist.recv(buf, src=owner)
                pieces.append(buf)
        if rank == 0:
            yield r.hf_name, tensor_recipes.assemble(r, pieces)


def push_weights(worker, *, plan: ReshardPlan, version: int, targets: list[str], transport: int, bucket_bytes: int,
                 deadline_s: float, push_id: str, token: str | None = None) -> dict[str, dict] | None:
    """Collective: stream `version` per the plan; rank 0 returns {target: {"ok": bool, ...outcome}}."""
    layout = worker.layout
    if (plan.trainer_tp, plan.trainer_pp) != (layout.tp, layout.pp):
        raise ValueError(f"the plan is for trainer TP={plan.trainer_tp} PP={plan.trainer_pp}, this group is "
                         f"TP={layout.tp} PP={layout.pp}; recompute it")
    if plan.trainer_ep != layout.ep:
        raise ValueError(f"the plan is for trainer EP={plan.trainer_ep}, this group is EP={layout.ep}; recompute it")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport} is not available; available: {sorted(TRANSPORTS)}")
    check_expert_layout()
    params = local_parameters(worker.model)
    pos = _position(layout)
    everyone = _all_gather((pos, _check_local(plan, params, pos)))
    problems = [p for _, p in everyone if p]
    if problems:
        raise ValueError(problems[0])
    owners = _owners([p for p, _ in everyone])
    missing = sorted({(weight_layout.is_expert_shard(s.name), s.key) for r in plan.tensors for s in r.sources} - set(owners))
    if missing:
        raise ValueError(f"no rank of this group holds the plan's shards of (tp_rank, pp_rank, ep_rank) "
                         f"{missing[0][1]}; recompute the plan")
    dtypes = plan_dtypes(plan, params)
    tensors = hf_tensors(plan, params, owners, dtypes)
    rank, _ = _rank_and_world()
    outcomes: dict[str, dict] | None = None
    error: Exception | None = None
    if rank == 0:
        total = sum(math.prod(r.hf_shape) * dtypes[r.hf_name].itemsize for r in plan.tensors)
        try:
            extra = {"num_tensors": len(plan.tensors)} if transport == trainer_pb2.WEIGHT_TRANSPORT_SHM else {}
            sender = TRANSPORTS[transport](targets, bucket_bytes=bucket_bytes, timeout_s=deadline_s, token=token,
                                           on_progress=_sink(push_id), total_bytes=total, **extra)
            outcomes = {t: _outcome_dict(o) for t, o in sender.send(version, tensors).items()}
        except Exception as e:  # noqa: BLE001 - re-raised once every rank has been told the push failed
            error = e
    for _ in tensors:  # the other ranks are sending until the plan's end
        pass
    acked = _from_rank0(outcomes is not None and all(o["ok"] for o in outcomes.values()))
    if acked:
        # The coordinator owns version numbers (monotonic across restarts): these weights now carry its label,
        # so the samples generated with them pass Update's version check.
        worker.weights_version = version
    if error is not None:
        raise error
    return outcomes


def _from_rank0(value: bool) -> bool:
    """Rank 0's `value` on every rank."""
    _, world = _rank_and_world()
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def _outcome_dict(o: WeightAck | TargetFailure) -> dict:
    if isinstance(o, WeightAck):
        return {"ok": True, "checksum": o.checksum, "num_tensors": o.num_tensors, "num_bytes": o.num_bytes}
    return {"ok": False, "code": o.code, "message": o.message}
