"""The Rollout gRPC servicer: protos <-> engine objects, version fencing, admission, streaming, cancellation.

`Generate` runs two threads per stream: a reader that validates each prompt group, fences its weights
version, waits for admission capacity and hands the group's n samples to the engine, and the handler that
streams each sample back the moment the engine finishes it. Admission is bounded service-wide
(`max_in_flight_samples`, default 2 x max_num_seqs so the engine always has queued work): while full, the
reader stops pulling request messages and gRPC flow control pushes back on the client. A group larger
than the bound runs alone; `max_samples_per_group` (default 4 x max_num_seqs) refuses groups so large
that they would hold the engine for many rounds. When the stream ends early (client cancel, deadline,
error), the unfinished samples are aborted in the engine.

`UpdateWeights` hands its stream to update_stream.py, which stages and applies the buckets as they arrive and,
when the stream fails, restores the served weights before the error is answered. Error codes follow
protos/rlfabric/v1/rollout.proto; client values are quoted through services/common/status.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.memory import resident_bytes
from services.common.seeds import sample_seed
from services.common.server import ServiceServer, ServiceSpec, create_server
from services.common.status import abort, echo
from services.common.tensors import TensorDecodeError, dtype_code, to_numpy, to_proto
from services.common.transports.wire import receiving_views
from services.common.weight_version import serves
from services.rollout import metrics
from services.rollout.engine import RolloutEngine
from services.rollout.engine_thread import EngineUnavailableError
from services.rollout.options import InvalidSamplingValueError, SamplingOptions
from services.rollout.samples import FINISH_ERROR, SampleRequest, SampleResult
from services.rollout.update_stream import UpdateStream
from services.rollout.weights import WeightUpdateError

logger = logging.getLogger(__name__)

SERVICE_NAME = "rlfabric.v1.Rollout"

_FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
    "interrupted": common_pb2.FINISH_REASON_INTERRUPTED,
}


class Admission:
    """A service-wide bound on samples inside the engine; a group larger than the bound runs alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self.peak = 0  # most samples ever admitted at once (observability and tests)
        self._cond = threading.Condition()

    def acquire(self, n: int, cancelled: threading.Event) -> bool:
        with self._cond:
            while not cancelled.is_set() and self._used > 0 and self._used + n > self.limit:
                self._cond.wait(timeout=0.5)
            if cancelled.is_set():
                return False
            self._used += n
            self.peak = max(self.peak, self._used)
            return True

    def release(self, n: int) -> None:
        if n:
            with self._cond:
                self._used -= n
                self._cond.notify_all()

    @property
    def used(self) -> int:
        return self._used


def merge_sampling(defaults: SamplingOptions, wire: rollout_pb2.GenerateRequest | Any) -> SamplingOptions:
    """Applies the request's SamplingParams over the configured defaults (zero = default, see common.proto)."""
    s = wire
    return SamplingOptions(
        max_tokens=s.max_tokens or defaults.max_tokens,
        temperature=s.temperature if s.has_temperature else defaults.temperature,
        top_p=s.top_p if s.top_p != 0 else defaults.top_p,
        top_k=s.top_k if s.top_k != 0 else defaults.top_k,
        min_p=s.min_p if s.min_p != 0 else defaults.min_p,
        logprobs=s.logprobs or defaults.logprobs,
        seed=s.seed if s.has_seed else defaults.seed,
    )


class _StreamError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_END = object()


class _GenerateStream:
    """State of one Generate call: pending samples, their outputs, cancellation."""

    _ids = itertools.count()

    def __init__(self, servicer: RolloutServicer) -> None:
        self.servicer = servicer
        self.uid = f"s{next(self._ids)}"
        self.out: queue.Queue[Any] = queue.Queue()
        self.cancelled = threading.Event()
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[str, int, float]] = {}  # engine id -> (group_id, index, arrival)
        self._reader_done = False
        self._seq = itertools.count()

    def read(self, requests: Iterator[rollout_pb2.GenerateRequest]) -> None:
        try:
            for request in requests:
                if self.cancelled.is_set():
                    return
                if request.interrupt:
                    self._interrupt()
                else:
                    self._admit(request)
        except _StreamError as e:
            self.out.put(e)
        except Exception as e:  # noqa: BLE001 - the client went away or sent garbage
            if not self.cancelled.is_set():
                logger.debug("Generate request stream ended with %r", e)
                self.out.put(_StreamError(grpc.StatusCode.CANCELLED, f"request stream failed: {e}"))
        finally:
            with self._lock:
                self._reader_done = True
                if not self._pending:
                    self.out.put(_END)

    def _admit(self, request: rollout_pb2.GenerateRequest) -> None:
        servicer = self.servicer
        engine = servicer.engine
        group = request.group
        where = f"group {echo(group.group_id)}"
        if not serves(request.expected_weights_version, engine.weights_version):
            raise _StreamError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: this replica holds weights version {engine.weights_version}, the request expects "
                f"{request.expected_weights_version}; sync weights (UpdateWeights) or use another replica",
            )
        reason = engine.unavailable_reason()
        if reason is not None:
            raise _StreamError(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {reason}")
        prompt, sampling = self._validate(request, where)
        arrival = time.monotonic()
        if not servicer.admission.acquire(group.n, self.cancelled):
            return
        # Decided here so the reason names the limit; the engine would otherwise stop the response short.
        unfit = _unfit_reason(len(prompt), sampling.max_tokens, engine.max_model_len)
        for i in range(group.n):
            seed = None if sampling.seed is None else sample_seed(sampling.seed, group.group_id, i)
            engine_id = f"{self.uid}:{next(self._seq)}"
            with self._lock:
                if self.cancelled.is_set():
                    servicer.admission.release(group.n - i)
                    return
                self._pending[engine_id] = (group.group_id, i, arrival)
            sample = SampleRequest(engine_id, prompt, dataclasses.replace(sampling, seed=seed),
                                   expected_weights_version=request.expected_weights_version)
            if unfit:
                self._on_finish(SampleResult.failed(sample, engine.weights_version, FINISH_ERROR, unfit))
            else:
                engine.submit(sample, self._on_finish)

    def _interrupt(self) -> None:
        """GenerateRequest.interrupt: every sample of this stream admitted so far ends now with what it has."""
        with self._lock:
            ids = list(self._pending)
        if ids:
            self.servicer.engine.interrupt(ids)
            logger.debug("Generate stream %s: interrupted %d samples", self.uid, len(ids))

    def _validate(self, request: rollout_pb2.GenerateRequest, where: str) -> tuple[list[int], SamplingOptions]:
        """The prompt's token ids and the sampling values, or _StreamError(INVALID_ARGUMENT) naming the field."""
        group, limit = request.group, self.servicer.max_samples_per_group
        if not group.group_id:
            raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT, "group.group_id must be set (sample ids derive from it)")
        if not 1 <= group.n <= limit:
            raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{where}: group.n must be in [1, {limit}] (this replica's max_samples_per_group), "
                               f"got {group.n}")
        if group.prompt_token_ids.dtype not in (common_pb2.DTYPE_INT32, common_pb2.DTYPE_INT64):
            raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{where}: group.prompt_token_ids must hold DTYPE_INT32 (or DTYPE_INT64) token ids")
        try:
            prompt = to_numpy(group.prompt_token_ids).reshape(-1).tolist()
        except TensorDecodeError as e:
            raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: group.prompt_token_ids: {e}") from e
        sampling = merge_sampling(self.servicer.defaults, request.sampling)
        try:
            sampling.validate(self.servicer.engine.max_model_len)
        except InvalidSamplingValueError as e:
            raise _StreamError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {e}") from e
        return prompt, sampling

    def _on_finish(self, result: SampleResult) -> None:
        with self._lock:
            meta = self._pending.pop(result.request_id, None)
            if meta is None:
                return  # cancelled meanwhile
            self.servicer.admission.release(1)
            self.out.put((meta, result))
            if self._reader_done and not self._pending:
                self.out.put(_END)

    def cancel(self) -> None:
        """Aborts what is still running (idempotent); called whenever the RPC ends."""
        self.cancelled.set()
        with self._lock:
            ids = list(self._pending)
            self._pending.clear()
        # Unblocks the handler if it is still waiting for samples.
        self.out.put(_END)
        if ids:
            self.servicer.admission.release(len(ids))
            self.servicer.engine.abort(ids)
            logger.info("Generate stream %s ended early: aborted %d samples", self.uid, len(ids))


def _unfit_reason(prompt_length: int, max_tokens: int, max_model_len: int) -> str:
    """Why a prompt cannot get `max_tokens` response tokens within `max_model_len` ("" when it can)."""
    if prompt_length + max_tokens <= max_model_len:
        return ""
    return (f"prompt of {prompt_length} tokens + max_tokens {max_tokens} exceed max_model_len={max_model_len}; "
            f"shorten the prompt (rl_config.max_prompt_length), lower max_tokens, or raise "
            f"generate_config.max_model_len")


def to_sample(meta: tuple[str, int, float], result: SampleResult) -> common_pb2.Sample:
    group_id, index, arrival = meta
    sample = common_pb2.Sample(
        sample_id=f"{group_id}/{index}",
        group_id=group_id,
        index=index,
        response_token_ids=to_proto(result.response_token_ids),
        response_log_probs=to_proto(result.response_log_probs),
        weights_version=result.weights_version,
        finish_reason=_FINISH_REASONS[result.finish_reason],
        prompt_length=result.prompt_length,
        response_length=len(result.response_token_ids),
        error=result.error,
        latency_s=max(0.0, result.finished_at - arrival),
    )
    if result.routed_experts is not None and not result.error:
        sample.routed_experts.CopyFrom(to_proto(result.routed_experts.astype(np.int32, copy=False)))
    return sample


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Serves one RolloutEngine (see module docstring)."""

    def __init__(self, engine: RolloutEngine, defaults: SamplingOptions, *,
                 max_in_flight_samples: int | None = None, max_samples_per_group: int | None = None) -> None:
        self.engine = engine
        self.defaults = defaults
        self.admission = Admission(max_in_flight_samples or 2 * engine.options.max_num_seqs)
        self.max_samples_per_group = max_samples_per_group or 4 * engine.options.max_num_seqs

    def Generate(self, request_iterator, context):
        stream = _GenerateStream(self)
        context.add_callback(stream.cancel)
        metrics.STREAMS.inc()
        reader = threading.Thread(target=stream.read, args=(request_iterator,), name=f"generate-{stream.uid}",
                                  daemon=True)
        reader.start()
        try:
            while True:
                item = stream.out.get()
                if item is _END:
                    return
                if isinstance(item, _StreamError):
                    stream.cancel()
                    abort(context, item.code, str(item))
                meta, result = item
                yield rollout_pb2.GenerateResponse(sample=to_sample(meta, result))
        finally:
            stream.cancel()
            metrics.STREAMS.dec()

    def UpdateWeights(self, request_iterator, context):
        try:
            staged = UpdateStream(self.engine).apply(request_iterator)
        except EngineUnavailableError as e:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except WeightUpdateError as e:
            abort(context, getattr(grpc.StatusCode, e.code), str(e))
        duration = time.monotonic() - staged.started_at
        metrics.WEIGHT_SYNC_SECONDS.observe(duration)
        return rollout_pb2.WeightUpdateAck(version=staged.version, checksum=staged.checksum,
                                           num_tensors=staged.num_tensors, num_bytes=staged.num_bytes,
                                           duration_s=duration)

    def Sleep(self, request, context):
        level = request.level or 1
        if level not in (1, 2):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"level must be 1 or 2, got {request.level}")
        seconds = self.engine.sleep(level)
        metrics.SLEEP_SECONDS.labels("sleep").observe(seconds)
        return rollout_pb2.SleepResponse(duration_s=seconds, resident_bytes=resident_bytes())

    def Wake(self, request, context):
        seconds = self.engine.wake()
        metrics.SLEEP_SECONDS.labels("wake").observe(seconds)
        return rollout_pb2.WakeResponse(duration_s=seconds, resident_bytes=resident_bytes())

    def Info(self, request, context):
        engine = self.engine
        info = rollout_pb2.RolloutInfo(
            model=engine.options.model,
            engine=engine.engine_name,
            tensor_parallel_size=engine.options.tensor_parallel_size,
            dtype=dtype_code(engine.dtype),
            weights_version=engine.weights_version,
            sleeping=engine.sleeping,
            max_model_len=engine.max_model_len,
            max_samples_per_group=self.max_samples_per_group,
            returns_routed_experts=engine.options.return_routed_experts,
        )
        if request.include_parameters:
            for name, spec in engine.expected_weights.items():
                info.parameters.add(name=name, shape=list(spec.shape), dtype=dtype_code(spec.dtype))
        return info


def create_rollout_server(
    engine: RolloutEngine,
    defaults: SamplingOptions,
    address: str = "127.0.0.1:0",
    *,
    max_in_flight_samples: int | None = None,
    max_samples_per_group: int | None = None,
    **server_kwargs: Any,
) -> tuple[ServiceServer, RolloutServicer]:
    """Builds (does not start) a server for `engine`; `server_kwargs` go to services.common.create_server."""
    servicer = RolloutServicer(engine, defaults, max_in_flight_samples=max_in_flight_samples,
                               max_samples_per_group=max_samples_per_group)
    # UpdateWeights requests keep the tensor bytes as views of the received message (wire.py), not copies.
    add = receiving_views(rollout_pb2_grpc.add_RolloutServicer_to_server, "UpdateWeights")
    server = create_server([ServiceSpec(add, servicer, SERVICE_NAME)],
                           address, component="rollout", **server_kwargs)
    return server, servicer
