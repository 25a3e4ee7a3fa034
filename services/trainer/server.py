"""The `rlfabric.v1.Trainer` servicer (rank 0 of a trainer group): proto <-> worker operations.

Each RPC is validated here (inputs.py), then run on every rank through `GroupExecutor` (group.py),
awaited with the call's deadline. Status codes: INVALID_ARGUMENT for malformed input, FAILED_PRECONDITION
for a batch from another weights version, ALREADY_EXISTS for a repeated Update step, UNAVAILABLE
when a rank died (the group is broken and the server reports NOT_SERVING), DEADLINE_EXCEEDED when
an operation outlives the call, INTERNAL when an operation failed on some rank. Messages are capped and
client values quoted through services/common/status.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np

from rlfabric.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.credentials import client_credentials
from services.common.memory import resident_bytes
from services.common.reshard_plan import ReshardPlan
from services.common.sequences import Sequences
from services.common.server import ServiceServer, ServiceSpec, create_server
from services.common.status import abort, echo
from services.common.tensors import dtype_code, to_proto
from services.common.transports import TRANSPORTS
from services.trainer import inputs
from services.trainer import metrics as trainer_metrics
from services.trainer.group import GroupBrokenError, GroupExecutor, OperationFailedError

logger = logging.getLogger(__name__)

SERVICE_NAME = "rlfabric.v1.Trainer"


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """Serves one trainer group; `executor.run(op, ...)` runs an op on every rank."""

    def __init__(self, executor: GroupExecutor, worker, *, kl_coef: float = 0.0,
                 checkpoint_roots: list[Path] | None = None,
                 push_targets: Callable[[], set[str]] | None = None) -> None:
        self.checkpoint_roots = list(checkpoint_roots or [])
        self.push_targets = push_targets  # the registered rollout endpoints; None: any target
        self.executor = executor
        self.worker = worker  # rank 0's worker: read-only state (versions, layout)
        self.kl_coef = kl_coef
        self.server: ServiceServer | None = None
        self._update_lock = threading.Lock()

    # ---- plumbing ---------------------------------------------------------------------------
    @contextmanager
    def _errors(self, context: grpc.ServicerContext, what: str):
        try:
            yield
        except GroupBrokenError as e:
            if self.server is not None:
                self.server.set_serving(False)
            abort(context, grpc.StatusCode.UNAVAILABLE, f"{what}: {e}")
        except TimeoutError as e:
            abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: {e}")
        except OperationFailedError as e:
            if e.kinds <= {"ValueError"}:  # the input was refused on every rank that failed
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {e}")
            if e.kinds <= {"FileNotFoundError"}:
                abort(context, grpc.StatusCode.NOT_FOUND, f"{what}: {e}")
            if e.kinds <= {"OffloadedError"}:  # services/trainer/offload.py: state moved out, Onload first
                abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"{what}: {e}")
            abort(context, grpc.StatusCode.INTERNAL, f"{what} failed: {e}")
        except ValueError as e:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {e}")

    def _run(self, context: grpc.ServicerContext, op: str, **kwargs):
        remaining = context.time_remaining()
        return self.executor.run(op, remaining, **kwargs)

    def _rows(self, batch: trainer_pb2.SequenceBatch) -> Sequences:
        return inputs.sequences(batch, self.worker.spec.vocab_size, self.worker.spec.moe)

    # ---- RPCs -------------------------------------------------------------------------------
    def ComputeLogProbs(self, request_iterator, context) -> Iterator[trainer_pb2.LogProbResponse]:
        for req in request_iterator:
            with self._errors(context, "ComputeLogProbs"):
                inputs.check_temperature(req.temperature)
                seqs = self._rows(req.batch)
                logp, ent = self._run(
                    context, "log_probs",
                    token_ids=np.array(seqs.token_ids), prompt_lengths=np.array(seqs.prompt_lengths),
                    response_lengths=np.array(seqs.response_lengths), temperature=float(req.temperature),
                    with_entropy=req.with_entropy, routed_experts=seqs.routed_experts,
                )
            resp = trainer_pb2.LogProbResponse(
                sample_ids=seqs.sample_ids, log_probs=to_proto(logp.numpy()),
                weights_version=self.worker.weights_version,
            )
            if ent is not None:
                resp.entropy.CopyFrom(to_proto(ent.numpy()))
            yield resp

    def Update(self, request_iterator, context) -> trainer_pb2.UpdateResponse:
        with self._errors(context, "Update"):
            parts = list(request_iterator)
            if not parts:
                raise ValueError("Update needs at least one UpdateRequest")
            step, temperature = parts[0].step, parts[0].temperature
            _counters(step=step)  # the step becomes the trainer's iteration
            kl_coef = parts[0].kl_coef if parts[0].HasField("kl_coef") else self.kl_coef
            inputs.check_temperature(temperature)
            inputs.check_kl_coef(kl_coef)
            if any(p.step != step or p.temperature != temperature
                   or (p.kl_coef if p.HasField("kl_coef") else self.kl_coef) != kl_coef for p in parts):
                raise ValueError("all UpdateRequests of one call must carry the same step, temperature and kl_coef")
            seqs = [self._rows(p.batch) for p in parts]
            arrays = inputs.experience_arrays(parts, seqs)
            with self._update_lock:
                last = self.worker.last_update_step
                if last is not None and step <= last:
                    abort(context, grpc.StatusCode.ALREADY_EXISTS, f"step {step} already applied (last step {last})")
                version = self.worker.weights_version
                # Version fence: a sample is at most max_staleness versions behind (pipelined mode), never ahead.
                bound = self.worker.opts.update.max_staleness
                stale = {s.weights_version for s in seqs if not version - bound <= s.weights_version <= version}
                if stale:
                    abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                          f"batch generated with weights version(s) {echo(sorted(stale))}, trainer holds version "
                          f"{version} and accepts samples at most {bound} version(s) old (rlfabric.max_staleness)")
                t0 = time.monotonic()
                metrics = self._run(context, "update", step=int(step), temperature=float(temperature),
                                    kl_coef=float(kl_coef), **arrays)
                metrics["timing/update"] = time.monotonic() - t0
                trainer_metrics.observe_update(metrics)
        return trainer_pb2.UpdateResponse(
            metrics=common_pb2.Metrics(values=metrics),
            weights_version=self.worker.weights_version,
            num_tokens=int(arrays["response_lengths"].sum()),
        )

    def SaveCheckpoint(self, request, context) -> trainer_pb2.CheckpointResponse:
        with self._errors(context, "SaveCheckpoint"):
            if not request.dir:
                raise ValueError("dir is required (megatron_training.save)")
            _counters(iteration=request.iteration, consumed_samples=request.consumed_samples)
            self._confine(context, request.dir)
            t0 = time.monotonic()
            path, iteration, consumed = self._run(context, "save", root=request.dir, iteration=int(request.iteration),
                                                  consumed_samples=int(request.consumed_samples))
        return trainer_pb2.CheckpointResponse(path=str(path), iteration=iteration, consumed_samples=consumed,
                                              duration_s=time.monotonic() - t0)

    def LoadCheckpoint(self, request, context) -> trainer_pb2.CheckpointResponse:
        with self._errors(context, "LoadCheckpoint"):
            if not request.dir:
                raise ValueError("dir is required (megatron_training.load)")
            _counters(iteration=request.iteration)
            self._confine(context, request.dir)
            t0 = time.monotonic()
            res = self._run(context, "load", root=request.dir, iteration=int(request.iteration) or None,
                            finetune=request.finetune, no_load_optim=request.no_load_optim,
                            no_load_rng=request.no_load_rng)
        return trainer_pb2.CheckpointResponse(
            path=str(res.path), iteration=res.iteration, consumed_samples=res.consumed_samples,
            duration_s=time.monotonic() - t0,
        )

    def PushWeights(self, request, context) -> Iterator[trainer_pb2.PushWeightsProgress]:
        """Streams `request.version` to the targets (services/trainer/weight_sync.py); progress per bucket/target."""
        from services.trainer import weight_sync

        t0 = time.monotonic()
        with self._errors(context, "PushWeights"):
            targets = list(request.targets)
            if not targets:
                raise ValueError("targets is empty: give the rollout endpoints (host:port) to push to")
            if len(set(targets)) != len(targets):
                raise ValueError(f"targets has duplicates: {echo(targets)}")
            self._check_targets(context, targets)
            transport = request.transport or trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM
            if transport not in TRANSPORTS:
                raise ValueError(f"transport {transport} is unknown; available: "
                                 f"{[trainer_pb2.WeightTransport.Name(t) for t in TRANSPORTS]}")
            _counters(version=request.version)
            if request.version < self.worker.weights_version:
                abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                      f"push of version {request.version} asked, the trainer holds version "
                      f"{self.worker.weights_version}; versions only move forward")
            if not request.HasField("plan"):
                raise ValueError("plan is missing: the coordinator computes it (services/coordinator/resharding.py, "
                                 "plan_resharding) from Trainer.Info and Rollout.Info with include_parameters")
            plan = ReshardPlan.from_proto(request.plan)  # a bad plan is the caller's error, refused before any rank works
            layout = self.worker.layout
            if (plan.trainer_tp, plan.trainer_pp) != (layout.tp, layout.pp):
                raise ValueError(f"the plan is for trainer TP={plan.trainer_tp} PP={plan.trainer_pp}, this "
                                 f"group is TP={layout.tp} PP={layout.pp}; recompute it")
        run = weight_sync.PushRun(lambda push_id: self._run(
            context, "push_weights", plan=plan, version=int(request.version), targets=targets,
            transport=int(transport), bucket_bytes=int(request.bucket_bytes),
            deadline_s=context.time_remaining() or 600.0, push_id=push_id, token=_outbound_token()))
        for target, sent, total, done, checksum in run:
            yield trainer_pb2.PushWeightsProgress(target=target, bytes_sent=sent, bytes_total=total, done=done,
                                                  checksum=checksum, elapsed_s=time.monotonic() - t0)
        with self._errors(context, "PushWeights"):
            outcomes = run.result()
        failed = {t: o for t, o in outcomes.items() if not o["ok"]}
        if failed:
            abort(context, grpc.StatusCode.UNAVAILABLE, "PushWeights: " + "; ".join(
                f"target {echo(t)} did not apply version {request.version}: {o['code']}: {o['message']}"
                for t, o in failed.items()) + f"; the trainer keeps version {self.worker.weights_version}")

    def _confine(self, context, directory: str) -> None:
        from services.trainer.checkpoint import CheckpointPathError, confine

        try:
            confine(directory, self.checkpoint_roots)
        except CheckpointPathError as e:
            abort(context, grpc.StatusCode.PERMISSION_DENIED, str(e))

    def _check_targets(self, context, targets: list[str]) -> None:
        """Weights go to registered rollout replicas only, not to any host:port a caller names."""
        if self.push_targets is None:
            return
        allowed = self.push_targets()
        stray = [t for t in targets if t not in allowed]
        if stray:
            abort(context, grpc.StatusCode.PERMISSION_DENIED,
                  f"PushWeights: target(s) {echo(stray)} are not rollout replicas registered in Redis "
                  f"(registered: {echo(sorted(allowed))})")

    def Offload(self, request, context) -> trainer_pb2.OffloadResponse:
        return self._move(context, "offload", request)

    def Onload(self, request, context) -> trainer_pb2.OffloadResponse:
        return self._move(context, "onload", request)

    def _move(self, context, op: str, request) -> trainer_pb2.OffloadResponse:
        """Offload or Onload (`op`) of what `request` selects, on every rank."""
        with self._errors(context, op.capitalize()):
            t0 = time.monotonic()
            moved = self._run(context, op, params=request.params, grads=request.grads, optimizer=request.optimizer)
        return trainer_pb2.OffloadResponse(duration_s=time.monotonic() - t0, bytes=int(moved),
                                           resident_bytes=resident_bytes())

    def Info(self, request, context) -> trainer_pb2.TrainerInfo:
        w = self.worker
        info = trainer_pb2.TrainerInfo(
            role=w.opts.role, tensor_parallel_size=w.layout.tp, pipeline_parallel_size=w.layout.pp,
            data_parallel_size=w.layout.dp, weights_version=w.weights_version, iteration=w.iteration,
            dtype=dtype_code(w.opts.params_dtype),
        )
        if request.include_parameters:
            with self._errors(context, "Info"):
                shards = self._run(context, "shards")
            for s in shards:
                info.shards.add(name=s["name"], shape=list(s["shape"]), tp_rank=s["tp_rank"], pp_rank=s["pp_rank"],
                                partition_dim=s["partition_dim"], ep_rank=s.get("ep_rank", 0))
        return info


def _counters(**values: int) -> None:
    """Iterations, sample counts and versions the trainer would record or adopt: refused (ValueError naming
    the field: INVALID_ARGUMENT) past services/trainer/checkpoint.py MAX_COUNTER, before any rank works."""
    from services.trainer.checkpoint import check_counter

    for name, value in values.items():
        check_counter(name, int(value))


def _outbound_token() -> str | None:
    # This process's service token (`--auth-token-file`, services/common/security.py).
    return client_credentials().token


def worker_handlers(worker) -> dict:
    """Operation name -> callable on this rank's worker (same table on every rank)."""
    import torch

    from services.trainer.step import SequenceRows
    from services.trainer.update import Experience

    def rows(token_ids, prompt_lengths, response_lengths, routed_experts=None) -> SequenceRows:
        return SequenceRows(torch.from_numpy(np.asarray(token_ids, dtype=np.int64)),
                            torch.from_numpy(np.asarray(prompt_lengths, dtype=np.int64)),
                            torch.from_numpy(np.asarray(response_lengths, dtype=np.int64)),
                            None if routed_experts is None else torch.from_numpy(np.asarray(routed_experts,
                                                                                            dtype=np.int64)))

    def log_probs(token_ids, prompt_lengths, response_lengths, temperature, with_entropy, routed_experts=None):
        return worker.compute_log_probs(rows(token_ids, prompt_lengths, response_lengths, routed_experts),
                                        temperature, with_entropy)

    def update(step, temperature, kl_coef, token_ids, prompt_lengths, response_lengths, advantages,
               old_log_probs, ref_log_probs, behavior_log_probs=None, routed_experts=None, response_mask=None):
        def t(x):
            return None if x is None else torch.from_numpy(np.asarray(x, dtype=np.float32))

        sequences = rows(token_ids, prompt_lengths, response_lengths, routed_experts)
        if response_mask is not None:
            sequences.response_mask = torch.from_numpy(np.asarray(response_mask, dtype=np.bool_))
        exp = Experience(sequences, t(advantages), t(old_log_probs), t(ref_log_probs), t(behavior_log_probs))
        return worker.update(exp, temperature=temperature, kl_coef=kl_coef, step=step)

    def push_weights(**kwargs):
        from services.trainer.weight_sync import push_weights as push

        return push(worker, **kwargs)

    def shards():
        from megatron.core import parallel_state as ps

        from services.trainer.worker import gather_objects

        # One copy of each (tp, pp, ep) rank's shards: data-parallel replicas hold the same ones. With expert
        # parallelism the first copy of each EP rank's experts is on its expert-data-parallel rank 0.
        first_copy = ps.get_expert_data_parallel_rank() == 0 if worker.layout.ep > 1 else worker.layout.dp_rank == 0
        parts = gather_objects(worker.shard_infos() if first_copy else [])
        return [s for part in (parts or []) for s in part]

    return {
        "log_probs": log_probs,
        "update": update,
        "save": lambda root, iteration, consumed_samples: worker.save(root, iteration, consumed_samples),
        "load": lambda root, iteration, finetune, no_load_optim, no_load_rng: worker.load(
            root, iteration=iteration, finetune=finetune, no_load_optim=no_load_optim, no_load_rng=no_load_rng),
        "offload": lambda params, grads, optimizer: worker.offload(params=params, grads=grads, optimizer=optimizer),
        "onload": lambda params, grads, optimizer: worker.onload(params=params, grads=grads, optimizer=optimizer),
        "shards": shards,
        "push_weights": push_weights,
    }


def create_trainer_server(
    executor: GroupExecutor, worker, *, address: str = "127.0.0.1:0", kl_coef: float = 0.0,
    metrics_port: int | None = 0, checkpoint_roots: list[Path] | None = None,
    push_targets: Callable[[], set[str]] | None = None,
) -> tuple[ServiceServer, TrainerServicer]:
    """The trainer's server; token and TLS are this process's (services/common/security.py)."""
    servicer = TrainerServicer(executor, worker, kl_coef=kl_coef, checkpoint_roots=checkpoint_roots,
                               push_targets=push_targets)
    server = create_server(
        [ServiceSpec(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer, SERVICE_NAME)],
        address, component="trainer", metrics_port=metrics_port,
    )
    servicer.server = server
    return server, servicer
