"""The `rlfabric.v1.Trainer` servicer (rank 0 of a trainer group): proto <-> worker operations.

Each RPC is validated here (inputs.py), then run on every rank through `GroupExecutor` (group.py; the operations
are handlers.py's), awaited with the call's deadline. Status codes: INVALID_ARGUMENT for malformed input,
FAILED_PRECONDITION for a batch from another weights version or an RPC of another role (roles.py: ComputeValues is
the critic's; ComputeLogProbs and PushWeights the actor's and the reference's; Update the actor's and the
critic's), ALREADY_EXISTS for a repeated Update step, UNAVAILABLE
when a rank died (the group is broken and the server reports NOT_SERVING), DEADLINE_EXCEEDED when
an operation outlives the call, INTERNAL when an operation failed on some rank. Messages are capped and
client values quoted through services/common/status.py.
"""

from __future__ import annotations

import itertools
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
from services.common.weight_version import moves_forward, outside_fence
from services.trainer import inputs, roles
from services.trainer import metrics as trainer_metrics
from services.trainer.group import GroupBrokenError, GroupExecutor, OperationFailedError
from services.trainer.roles import update_timing_key

logger = logging.getLogger(__name__)

SERVICE_NAME = "rlfabric.v1.Trainer"


class StaleBatchError(Exception):
    """A streaming Update's later request outside the actor's version fence (FAILED_PRECONDITION)."""


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
            # OffloadedError (services/trainer/offload.py): state moved out, Onload first; StaleBatchError: a later
            # request of a streaming Update outside the version fence.
            if e.kinds <= {"OffloadedError", "StaleBatchError"}:
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
    def _require_role(self, context: grpc.ServicerContext, what: str, wanted: tuple[str, ...], why: str) -> None:
        """FAILED_PRECONDITION unless this trainer's role is one of `wanted` (before any rank works)."""
        role = self.worker.opts.role
        if role not in wanted:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"{what}: this trainer is the {role}; {why}")

    def ComputeLogProbs(self, request_iterator, context) -> Iterator[trainer_pb2.LogProbResponse]:
        self._require_role(context, "ComputeLogProbs", (roles.ACTOR, roles.REFERENCE),
                           "the critic's output is a value per position (ComputeValues), not log-probs")
        for req in request_iterator:
            with self._errors(context, "ComputeLogProbs"):
                inputs.check_temperature(req.temperature)
                if req.adapters_off and self.worker.opts.lora is None:
                    abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                          f"adapters_off: the {self.worker.opts.role} trainer has no LoRA adapters (share_backbone "
                          f"needs an actor with lora_target_modules)")
                seqs = self._rows(req.batch)
                logp, ent = self._run(
                    context, "log_probs",
                    token_ids=np.array(seqs.token_ids), prompt_lengths=np.array(seqs.prompt_lengths),
                    response_lengths=np.array(seqs.response_lengths), temperature=float(req.temperature),
                    with_entropy=req.with_entropy, routed_experts=seqs.routed_experts,
                    adapters_off=req.adapters_off,
                )
            resp = trainer_pb2.LogProbResponse(
                sample_ids=seqs.sample_ids, log_probs=to_proto(logp.numpy()),
                weights_version=self.worker.weights_version,
            )
            if ent is not None:
                resp.entropy.CopyFrom(to_proto(ent.numpy()))
            yield resp

    def ComputeValues(self, request_iterator, context) -> Iterator[trainer_pb2.ValueResponse]:
        self._require_role(context, "ComputeValues", (roles.CRITIC,),
                           "only PPO's critic has a value head (trainer serve --role critic)")
        for req in request_iterator:
            with self._errors(context, "ComputeValues"):
                seqs = self._rows(req.batch)
                values = self._run(context, "values", token_ids=np.array(seqs.token_ids),
                                   prompt_lengths=np.array(seqs.prompt_lengths),
                                   response_lengths=np.array(seqs.response_lengths), routed_experts=seqs.routed_experts)
            yield trainer_pb2.ValueResponse(sample_ids=seqs.sample_ids, values=to_proto(values.numpy()),
                                            weights_version=self.worker.weights_version)

    def Update(self, request_iterator, context) -> trainer_pb2.UpdateResponse:
        role = self.worker.opts.role
        self._require_role(context, "Update", roles.TRAINING_ROLES, "the reference does not train")
        with self._errors(context, "Update"):
            first = next(request_iterator, None)
            if first is None:
                raise ValueError("Update needs at least one UpdateRequest")
            _counters(step=first.step)  # the step becomes the trainer's iteration
            if (role != roles.CRITIC and first.batch_rows > len(first.batch.sample_ids)
                    and self.worker.can_stream_update(first.batch_rows)):
                metrics, tokens = self._update_streamed(context, first, request_iterator)
            else:
                metrics, tokens = self._update_collected(context, [first, *request_iterator])
            trainer_metrics.observe_update(metrics)
        return trainer_pb2.UpdateResponse(
            metrics=common_pb2.Metrics(values=metrics),
            weights_version=self.worker.weights_version,
            num_tokens=tokens,
        )

    def _update_collected(self, context, parts: list[trainer_pb2.UpdateRequest]) -> tuple[dict[str, float], int]:
        """The whole call's requests first, then the pass on every rank: (metrics, response tokens)."""
        role, step = self.worker.opts.role, parts[0].step
        if any(p.step != step or p.batch_rows != parts[0].batch_rows for p in parts):
            raise ValueError("all UpdateRequests of one call must carry the same step and batch_rows")
        # The critic reads neither the temperature nor the KL coefficient (rlfabric/v1/trainer.proto).
        loss_args = {} if role == roles.CRITIC else self._policy_loss_args(parts)
        seqs = [self._rows(p.batch) for p in parts]
        rows = sum(len(x) for x in seqs)
        if parts[0].batch_rows and rows != parts[0].batch_rows:
            raise ValueError(f"the Update stream sent {rows} rows; its batch_rows said {parts[0].batch_rows}")
        arrays = inputs.experience_arrays(parts, seqs, role)
        with self._update_lock:
            self._check_step_and_versions(context, step, seqs)
            t0 = time.monotonic()
            metrics = self._run(context, "update", step=int(step), **loss_args, **arrays)
            metrics[update_timing_key(role)] = time.monotonic() - t0
        return metrics, int(arrays["response_lengths"].sum())

    def _update_streamed(self, context, first: trainer_pb2.UpdateRequest,
                         rest: Iterator[trainer_pb2.UpdateRequest]) -> tuple[dict[str, float], int]:
        """The actor's pass started on the first request, each later one checked and handed over as it comes
        (services/trainer/streamed_update.py; a single-rank group, so nothing is broadcast): (metrics, tokens)."""
        role, step = self.worker.opts.role, first.step
        loss_args = self._policy_loss_args([first])
        # Each request is checked as it comes; the actor's schedule builds its inputs (inputs.experience_arrays)
        # over the requests a micro-batch touches (handlers.py, streamed_update.ExperienceStream).
        tokens = 0

        def parts() -> Iterator[tuple[trainer_pb2.UpdateRequest, Sequences]]:
            nonlocal tokens
            for p in itertools.chain([first], rest):
                if p.step != step or p.batch_rows != first.batch_rows:
                    raise ValueError("all UpdateRequests of one call must carry the same step and batch_rows")
                self._policy_loss_args([first, p])
                seqs = self._rows(p.batch)
                stale = self._outside_fence([seqs])
                if stale:
                    raise StaleBatchError(stale)
                tokens += int(seqs.response_lengths.sum())
                yield p, seqs

        with self._update_lock:
            self._check_step_and_versions(context, step, [])  # the version fence: per request, in parts()
            t0 = time.monotonic()
            metrics = self._run(context, "update_streamed", step=int(step), batch_rows=int(first.batch_rows),
                                parts=parts(), **loss_args)
            metrics[update_timing_key(role)] = time.monotonic() - t0
        return metrics, tokens

    def _policy_loss_args(self, parts: list[trainer_pb2.UpdateRequest]) -> dict[str, float]:
        """The actor's temperature and KL coefficient, the same on every request of the call."""
        temperature = parts[0].temperature
        kl_coef = parts[0].kl_coef if parts[0].HasField("kl_coef") else self.kl_coef
        inputs.check_temperature(temperature)
        inputs.check_kl_coef(kl_coef)
        if any(p.temperature != temperature or (p.kl_coef if p.HasField("kl_coef") else self.kl_coef) != kl_coef
               for p in parts):
            raise ValueError("all UpdateRequests of one call must carry the same step, temperature and kl_coef")
        return {"temperature": float(temperature), "kl_coef": float(kl_coef)}

    def _check_step_and_versions(self, context: grpc.ServicerContext, step: int, seqs: list[Sequences]) -> None:
        """ALREADY_EXISTS for a step already applied; for the actor, FAILED_PRECONDITION for samples outside its
        version fence. The critic has no fence: a batch's weights_version names the policy that generated it, and
        the critic's own version counts critic updates (its `values` come from ComputeValues of the same call
        sequence, and pipelined mode is refused with a critic: services/common/config/ppo.py)."""
        last = self.worker.last_update_step
        if last is not None and step <= last:
            abort(context, grpc.StatusCode.ALREADY_EXISTS, f"step {step} already applied (last step {last})")
        if self.worker.opts.role == roles.CRITIC:
            return
        stale = self._outside_fence(seqs)
        if stale:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION, stale)

    def _outside_fence(self, seqs: list[Sequences]) -> str | None:
        """Why the actor refuses `seqs` by the version fence (a sample is at most the bound's versions behind,
        never ahead), or None."""
        version = self.worker.weights_version
        bound = self.worker.opts.update.max_staleness
        stale = outside_fence((s.weights_version for s in seqs), version, bound)
        if not stale:
            return None
        return (f"batch generated with weights version(s) {echo(stale)}, trainer holds version "
                f"{version} and accepts samples at most {bound} version(s) old (rlfabric.max_staleness)")

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
        self._require_role(context, "PushWeights", (roles.ACTOR, roles.REFERENCE),
                           "the critic's weights serve no rollout (its output layer is a value head)")
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
            if not moves_forward(request.version, self.worker.weights_version):
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
