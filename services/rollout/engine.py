"""The vLLM adapter of the rollout service: prompt token ids in, response token ids and log-probs out.

`RolloutEngine` owns one vLLM `LLMEngine` (in-process engine core) and one thread that drives it
(engine_thread.py): the thread admits requests, runs `step()`, and hands every sample to its callback the moment
vLLM reports it finished, so callers can stream samples as they complete. Everything that touches the engine
(adding and aborting requests, weight updates, sleep, wake, introspection) runs on that thread between two
steps, which makes a weight update atomic with respect to generation. Each request is ONE sample (n=1): a group
of n is n requests, so each sample finishes and streams on its own.

Choices:
- Token ids only: prompts are `TokensPrompt`s, detokenization is off, nothing is re-tokenised.
- `logprobs_mode="processed_logprobs"` by default: the returned log-prob of a token is under the
  distribution it was sampled from (after temperature, top-k/top-p); at temperature 0 it equals the
  model's log-softmax.
- A weight update aborts the samples in flight, never takes the served version backwards, and can be undone
  until its last piece (`restore_weights`): served_weights.py.
- Sleep: vLLM's sleep mode where the platform has it (CUDA/Ascend). vLLM-CPU has none (its worker ignores
  sleep), so on CPU `sleep` frees the KV-cache storage and `wake` re-allocates and zeroes it; weights stay
  in host memory (they already live there), so both levels behave the same on CPU.
- vLLM settings that come from the environment (in-process engine core, cache root, CPU KV-cache size)
  are set from `EngineOptions` (vllm_args.py); users set none of them.
- Admission window: an idle engine waits a moment for the rest of a batch before its first step, so the batch
  starts together (engine_thread.py).
- MoE models: with `return_routed_experts` each finished sample carries the experts every MoE layer chose per
  token (routed_experts.py), fetched from the worker once per step for the samples that finished in it.
  `read_weights` reads HF-named tensors back out of vLLM's fused parameters (moe_weights.py).
- Each HF tensor is expected (and listed by Info) in the dtype of the vLLM parameter it loads into, read once
  after the build (worker_ops.py `held_dtypes`), not the model dtype for all: vLLM keeps some in float32 whatever
  the model dtype (DeepSeek-V3's e_score_correction_bias), and a push must reach those unrounded.

Knows nothing of gRPC (see server.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.weight_version import serves
from services.rollout import metrics, routed_experts, worker_ops
from services.rollout.engine_thread import EngineThread, EngineUnavailableError
from services.rollout.options import EngineOptions
from services.rollout.samples import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    SampleRequest,
    SampleResult,
)
from services.rollout.served_weights import ServedWeights
from services.rollout.vllm_args import configure_environment, engine_args, sampling_params
from services.rollout.weights import StagedUpdate, read_checkpoint_specs

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    request: SampleRequest
    on_finish: Callable[[SampleResult], None]
    version: int
    submitted_at: float
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)

    def result(self, finish_reason: str, finished_at: float) -> SampleResult:
        """The sample as it stands: every token generated so far, with its log-prob."""
        return SampleResult(request_id=self.request.request_id,
                            response_token_ids=np.asarray(self.token_ids, dtype=np.int32),
                            response_log_probs=np.asarray(self.log_probs, dtype=np.float32),
                            finish_reason=finish_reason, prompt_length=len(self.request.prompt_token_ids),
                            weights_version=self.version, finished_at=finished_at)


class RolloutEngine(EngineThread):
    """One vLLM engine driven by a private thread (see module docstring)."""

    def __init__(self, options: EngineOptions) -> None:
        if options.return_routed_experts and options.enable_prefix_caching:
            raise ValueError("return_routed_experts needs enable_prefix_caching off: a cached prompt block is "
                             "never computed, so its tokens would have no routed experts")
        self.options = options
        # One update at a time, whichever servicer streams it (several servers may share one engine).
        self.update_lock = threading.Lock()
        self._sleeping = False
        self._kv_released_bytes = 0
        self._active: dict[str, _InFlight] = {}
        # The engine is built on, and only ever touched from, its own thread: vLLM's CPU attention checks
        # that the OpenMP thread count it planned with is the one it runs with, and that is per thread.
        self._start("rollout-engine")
        metrics.WEIGHTS_VERSION.set(0)
        logger.info("engine %s built in %.1f s from %s (dtype %s, patches %s)", self.engine_name,
                    self.build_seconds, options.model, self.dtype, self.patches)

    def _build(self) -> None:
        options = self.options
        configure_environment(options)
        import torch

        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        import vllm
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        from services.rollout.patches import apply_patches, keep_torch_set_num_threads

        self.is_cpu = current_platform.is_cpu()
        self.patches = apply_patches()
        self.sleep_mode_native = not self.is_cpu and current_platform.is_sleep_mode_available()
        started = time.monotonic()
        args = engine_args(options, sleep_mode=self.sleep_mode_native)
        with keep_torch_set_num_threads():
            self._engine = LLMEngine.from_engine_args(args)
        self.engine_name = f"vllm {vllm.__version__}"
        self.dtype = str(self._engine.model_config.dtype).removeprefix("torch.")
        self.max_model_len = int(self._engine.model_config.max_model_len)
        self.build_seconds = time.monotonic() - started
        self._weights = ServedWeights(self._engine)
        # What UpdateWeights accepts, and what Info lists: the HF checkpoint's names and full shapes, each in the
        # dtype the engine really keeps it in.
        specs = read_checkpoint_specs(options.model, self._engine.model_config.dtype)
        held = self._engine.apply_model(functools.partial(worker_ops.held_dtypes, list(specs)))[0]
        self.expected_weights = {n: dataclasses.replace(s, dtype=held.get(n, s.dtype)) for n, s in specs.items()}
        # With return_routed_experts: the MoE layer indices and top_k of SampleResult.routed_experts.
        self.routed_expert_layers: list[int] = []
        self.routed_experts_top_k = 0
        if options.return_routed_experts:
            (self.routed_expert_layers, self.routed_experts_top_k), *_ = self._engine.collective_rpc(
                routed_experts.start_capture)

    # --- public API (thread-safe) -----------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        return self._weights.version

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def unavailable_reason(self) -> str | None:
        """Why the engine cannot generate now, or None when it can."""
        if self._sleeping:
            return "the replica is asleep; call Wake first"
        return self._weights.error

    def submit(self, request: SampleRequest, on_finish: Callable[[SampleResult], None]) -> None:
        """Queues one sample; `on_finish` is called once, on the engine thread, when it finishes or fails.

        The callback must be quick and must not call back into the engine synchronously.
        """
        self._call(functools.partial(self._add, request, on_finish), wait=False)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stops the given samples; their callbacks are NOT called (the caller is gone)."""
        with contextlib.suppress(EngineUnavailableError):  # closed: the shutdown aborted every sample in flight
            if request_ids:
                self._call(functools.partial(self._abort, list(request_ids), None), wait=False)

    def interrupt(self, request_ids: Sequence[str]) -> None:
        """Ends the given samples now; each one's callback gets the tokens it has, FINISH_INTERRUPTED (those that
        already finished are left alone)."""
        if request_ids:
            self._call(functools.partial(self._interrupt, list(request_ids)), wait=False)

    def update_weights(self, update: StagedUpdate, *, first: bool = True, last: bool = True,
                       backup: bool = False) -> float:
        """Applies a verified update between two steps; returns the apply time in seconds. A streamed update
        comes in pieces, `first` to `last`: between them the engine refuses to generate. With `backup`
        (gRPC buckets) each piece first saves the values it overwrites, so `restore_weights` can undo the
        pieces of a push that fails before its `last`."""
        return self._call(functools.partial(self._apply_weights, update, first, last, backup))

    def update_weights_async(self, update: StagedUpdate, *, first: bool, last: bool, backup: bool) -> Future:
        """`update_weights` without waiting: pieces queued in order are applied in order, and the caller reads
        the next piece meanwhile; the future holds the apply time or the failure."""
        return self._queue(functools.partial(self._apply_weights, update, first, last, backup), Future())

    def restore_weights(self) -> int:
        """Undoes the pieces applied with `backup` since the last complete update: the parameters, the
        refusal to generate and the version are as before that push (bitwise). Returns the parameters restored."""
        return self._call(self._weights.restore)

    def sleep(self, level: int = 1) -> float:
        """Releases memory (see module docstring); idempotent. Returns seconds taken."""
        return self._call(functools.partial(self._sleep, level))

    def wake(self) -> float:
        """Re-acquires what `sleep` released; idempotent. Returns seconds taken."""
        return self._call(self._wake)

    def read_weights(self, names: Sequence[str]) -> dict[str, Any]:
        """Host copies of the named HF tensors (full shapes) as the engine serves them, read between two
        steps from vLLM's parameters (moe_weights.py); None for a name whose place is not known."""
        specs = {n: s.shape for n, s in self.expected_weights.items()}
        unknown = [n for n in names if n not in specs]
        if unknown:
            raise KeyError(f"not a weight of this model: {unknown[:3]}")
        return self._call(lambda: self._engine.apply_model(
            functools.partial(worker_ops.read_weights, list(names), specs))[0])

    def engine_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """vLLM's own parameters (fused, possibly repacked), for diagnostics; updates use HF names."""
        return self._call(lambda: self._engine.apply_model(worker_ops.parameter_shapes)[0])

    def num_in_flight(self) -> int:
        return len(self._active)

    # --- engine thread --------------------------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._active)

    def _step_failed(self, error: Exception) -> None:
        self._abort(list(self._active), f"engine step failed: {error}")

    def _shutdown(self) -> None:  # on the engine thread, after every command queued before close()
        self._abort(list(self._active), "the engine is shutting down")
        try:
            self._engine.engine_core.shutdown()
        except Exception:  # the process is going; what vLLM's teardown raises changes nothing
            logger.warning("vLLM engine shutdown raised", exc_info=True)

    def _add(self, request: SampleRequest, on_finish: Callable[[SampleResult], None]) -> None:
        from vllm.inputs import TokensPrompt

        reason = self.unavailable_reason()
        expected, version = request.expected_weights_version, self._weights.version
        if reason is None and not serves(expected, version):
            # The version changed between the caller's check and this point: never mix versions.
            self._deliver(on_finish, SampleResult.failed(request, version, FINISH_ABORT,
                                             f"the weights changed to version {version} before this sample "
                                             f"started (expected {expected}); regenerate at the new version"))
            return
        if reason is None:
            params = sampling_params(request.sampling)
            try:
                prompt = TokensPrompt(prompt_token_ids=[int(t) for t in request.prompt_token_ids])
                self._engine.add_request(request.request_id, prompt, params)
            except Exception as e:  # noqa: BLE001 - vLLM's input validation (length, vocab, ...): this sample only
                reason = f"prompt rejected by the engine: {e}"
        if reason is not None:
            self._deliver(on_finish, SampleResult.failed(request, version, FINISH_ERROR, reason))
            return
        self._active[request.request_id] = _InFlight(request, on_finish, version, time.monotonic())
        metrics.REQUESTS_ADMITTED.inc()

    def _step(self) -> None:
        outputs = self._engine.step()
        now = time.monotonic()
        new_tokens = 0
        finished: list[tuple[_InFlight, SampleResult]] = []
        for out in outputs:
            entry = self._active.get(out.request_id)
            if entry is None or not out.outputs:
                continue
            completion = out.outputs[0]
            if not entry.token_ids and completion.token_ids:
                metrics.TIME_TO_FIRST_TOKEN.observe(now - entry.submitted_at)
            tokens = list(completion.token_ids)
            entry.token_ids.extend(tokens)
            new_tokens += len(tokens)
            if completion.logprobs is not None:
                entry.log_probs.extend(lp[t].logprob for lp, t in zip(completion.logprobs, tokens, strict=True))
            if out.finished:
                del self._active[out.request_id]
                reason = {"stop": FINISH_STOP, "length": FINISH_LENGTH}.get(completion.finish_reason or "",
                                                                             FINISH_ABORT)
                result = entry.result(reason, now)
                metrics.SAMPLES_FINISHED.labels(reason).inc()
                finished.append((entry, result))
        if finished and self.routed_expert_layers:
            routes = self._engine.collective_rpc(routed_experts.take, args=([r.request_id for _, r in finished],))[0]
            for _, result in finished:  # rows of the computed positions only (see routed_experts.py)
                result.routed_experts = routes[result.request_id][:result.prompt_length
                                                                  + len(result.response_token_ids) - 1]
        for entry, result in finished:
            self._deliver(entry.on_finish, result)
        metrics.GENERATED_TOKENS.inc(new_tokens)
        self._update_queue_gauges()

    def _update_queue_gauges(self) -> None:
        scheduler = getattr(getattr(self._engine.engine_core, "engine_core", None), "scheduler", None)
        running = getattr(scheduler, "running", None)
        waiting = getattr(scheduler, "waiting", None)
        if running is not None and waiting is not None:
            metrics.REQUESTS.labels("running").set(len(running))
            metrics.REQUESTS.labels("waiting").set(len(waiting))
        else:
            metrics.REQUESTS.labels("running").set(len(self._active))

    def _abort(self, request_ids: list[str], reason: str | None) -> None:
        known = [r for r in request_ids if r in self._active]
        if known:
            self._engine.abort_request(known)
            if self.routed_expert_layers:
                self._engine.collective_rpc(routed_experts.drop, args=(known,))
        for rid in known:
            entry = self._active.pop(rid)
            metrics.SAMPLES_FINISHED.labels(FINISH_ABORT).inc()
            if reason is not None:
                self._deliver(entry.on_finish, SampleResult.failed(entry.request, entry.version, FINISH_ABORT,
                                                                  reason))
        self._update_queue_gauges()

    def _interrupt(self, request_ids: list[str]) -> None:
        known = [r for r in request_ids if r in self._active]
        if not known:
            return
        self._engine.abort_request(known)
        if self.routed_expert_layers:
            self._engine.collective_rpc(routed_experts.drop, args=(known,))
        now = time.monotonic()
        for rid in known:
            entry = self._active.pop(rid)
            metrics.SAMPLES_FINISHED.labels(FINISH_INTERRUPTED).inc()
            self._deliver(entry.on_finish, entry.result(FINISH_INTERRUPTED, now))
        self._update_queue_gauges()

    @staticmethod
    def _deliver(on_finish: Callable[[SampleResult], None], result: SampleResult) -> None:
        try:
            on_finish(result)
        except Exception:
            logger.exception("sample callback failed for %s", result.request_id)

    def _apply_weights(self, update: StagedUpdate, first: bool = True, last: bool = True,
                       backup: bool = False) -> float:
        return self._weights.apply(update, first, last, backup, asleep=self._sleeping and self.sleep_mode_native,
                                   abort_in_flight=self._abort_in_flight)

    def _abort_in_flight(self, reason: str) -> None:
        if self._active:
            self._abort(list(self._active), reason)

    def _sleep(self, level: int) -> float:
        if self._sleeping:
            return 0.0
        started = time.monotonic()
        self._abort_in_flight("the replica went to sleep")
        if self.sleep_mode_native:
            self._engine.sleep(level)
            if level >= 2:
                self._weights.error = ("the replica was woken from a level-2 sleep, which discards the weights; "
                                      "sync weights (UpdateWeights) before generating")
        else:
            self._engine.reset_prefix_cache()
            self._kv_released_bytes = sum(self._engine.collective_rpc(worker_ops.release_kv_cache))
        self._sleeping = True
        metrics.SLEEPING.set(1)
        seconds = time.monotonic() - started
        logger.info("asleep (level %d) in %.3f s, released %d KV bytes", level, seconds, self._kv_released_bytes)
        return seconds

    def _wake(self) -> float:
        if not self._sleeping:
            return 0.0
        started = time.monotonic()
        if self.sleep_mode_native:
            self._engine.wake_up()
        else:
            self._engine.collective_rpc(worker_ops.restore_kv_cache)
        self._sleeping = False
        metrics.SLEEPING.set(0)
        seconds = time.monotonic() - started
        logger.info("awake in %.3f s", seconds)
        return seconds
