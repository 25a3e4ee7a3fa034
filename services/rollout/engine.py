"""The vLLM adapter of the rollout service: prompt token ids in, response token ids and log-probs out.

`RolloutEngine` owns one vLLM `LLMEngine` (in-process engine core) and one thread that drives it: the
thread admits requests, runs `step()`, and hands every sample to its callback the moment vLLM reports it
finished, so callers can stream samples as they complete. Everything that touches the engine (adding and
aborting requests, weight updates, sleep, wake, introspection) runs on that thread between two steps, which
makes a weight update atomic with respect to generation. Each request is ONE sample (n=1): a group of n is
n requests, so each sample finishes and streams on its own.

Choices:
- Token ids only: prompts are `TokensPrompt`s, detokenization is off, nothing is re-tokenised.
- `logprobs_mode="processed_logprobs"` by default: the returned log-prob of a token is under the
  distribution it was sampled from (after temperature, top-k/top-p); at temperature 0 it equals the
  model's log-softmax.
- A weight update aborts the samples in flight (they would otherwise mix two versions); they come back
  with finish reason "abort". The prefix cache is reset after every update. A streamed update comes in
  pieces, during which the engine refuses to generate; pieces applied with `backup` (gRPC buckets) first
  copy the vLLM parameters they write into (the whole fused qkv / gate_up parameter, host buffers reused
  across pushes: one model's worth of host memory), and `restore_weights` puts them back when the push
  fails, so the engine again serves its previous weights and version, bitwise.
- Sleep: vLLM's sleep mode where the platform has it (CUDA/Ascend). vLLM-CPU has none (its worker ignores
  sleep), so on CPU `sleep` frees the KV-cache storage and `wake` re-allocates and zeroes it; weights stay
  in host memory (they already live there), so both levels behave the same on CPU.
- vLLM settings that come from the environment (in-process engine core, cache root, CPU KV-cache size)
  are set from `EngineOptions` (vllm_args.py); users set none of them.
- Admission window: a client sends a batch of groups as a stream, and their samples reach the engine thread
  one by one. When the engine goes from idle to generating, it waits for the rest of the batch (while the
  next sample arrives within ADMISSION_GAP_S, at most ADMISSION_WINDOW_S in all) before its first step, so
  the batch starts together: a sample that missed the first step finishes one step after the others and
  adds a whole step to the batch (measured on the demo's 8 x 8 x 8-token rollout: 9.0 steps on average
  instead of 8). A lone request waits ADMISSION_GAP_S at most.
- MoE models: with `return_routed_experts` each finished sample carries the experts every MoE layer chose per
  token (routed_experts.py), fetched from the worker once per step for the samples that finished in it.
  `read_weights` reads HF-named tensors back out of vLLM's fused parameters (moe_weights.py).
- Each HF tensor is expected (and listed by Info) in the dtype of the vLLM parameter it loads into, read once
  after the build (`held_dtypes`), not the model dtype for all: vLLM keeps some in float32 whatever the model
  dtype (DeepSeek-V3's e_score_correction_bias), and a push must reach those unrounded.
- A weight update never takes the served version backwards (checked here, where updates are applied,
  because several servicers may share one engine).

Knows nothing of gRPC (see server.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.rollout import metrics, moe_weights, routed_experts, worker_ops
from services.rollout.options import EngineOptions
from services.rollout.samples import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    SampleRequest,
    SampleResult,
)
from services.rollout.vllm_args import configure_environment, engine_args, sampling_params
from services.rollout.weights import (
    StagedUpdate,
    WeightsVersionBehindError,
    WeightUpdateError,
    read_checkpoint_specs,
)

logger = logging.getLogger(__name__)

ADMISSION_GAP_S = 0.002  # see "Admission window" above
ADMISSION_WINDOW_S = 0.02


class EngineUnavailableError(RuntimeError):
    """The engine cannot generate now (asleep, or its weights are invalid); the message says why."""


@dataclass
class _InFlight:
    request: SampleRequest
    on_finish: Callable[[SampleResult], None]
    version: int
    submitted_at: float
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


class RolloutEngine:
    """One vLLM engine driven by a private thread (see module docstring)."""

    def __init__(self, options: EngineOptions) -> None:
        if options.return_routed_experts and options.enable_prefix_caching:
            raise ValueError("return_routed_experts needs enable_prefix_caching off: a cached prompt block is "
                             "never computed, so its tokens would have no routed experts")
        self.options = options
        self._version = 0
        self._weights_error: str | None = None
        # While a push applies pieces with a backup: the refusal to generate from before it (see _restore_weights).
        self._before_push: tuple[str | None] | None = None
        # One update at a time, whichever servicer streams it (several servers may share one engine).
        self.update_lock = threading.Lock()
        self._sleeping = False
        self._kv_released_bytes = 0
        self._active: dict[str, _InFlight] = {}
        self._commands: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._closed = False
        self._close_lock = threading.Lock()  # nothing is queued behind close()'s sentinel (see _call)
        # The engine is built on, and only ever touched from, its own thread: vLLM's CPU attention checks
        # that the OpenMP thread count it planned with is the one it runs with, and that is per thread.
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="rollout-engine", daemon=True)
        self._thread.start()
        ready.result()
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
        # What UpdateWeights accepts, and what Info lists: the HF checkpoint's names and full shapes, each in the
        # dtype the engine really keeps it in.
        specs = read_checkpoint_specs(options.model, self._engine.model_config.dtype)
        held = self._engine.apply_model(functools.partial(held_dtypes, list(specs)))[0]
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
        return self._version

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def unavailable_reason(self) -> str | None:
        """Why the engine cannot generate now, or None when it can."""
        if self._sleeping:
            return "the replica is asleep; call Wake first"
        return self._weights_error

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
        future: Future = Future()
        with self._close_lock:
            if self._closed:
                raise EngineUnavailableError("the engine is closed")
            self._commands.put((functools.partial(self._apply_weights, update, first, last, backup), future))
        return future

    def restore_weights(self) -> int:
        """Undoes the pieces applied with `backup` since the last complete update: the parameters, the
        refusal to generate and the version are as before that push (bitwise). Returns the parameters restored."""
        return self._call(self._restore_weights)

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

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stops the engine within `timeout_s` (True: its thread stopped). That thread runs what was queued
        before, aborts the samples in flight and shuts vLLM down itself; later calls fail."""
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._commands.put(None)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():  # a daemon thread: left behind, it does not keep the process up
            logger.error("the engine thread did not stop within %.0f s; leaving it behind", timeout_s)
        return not self._thread.is_alive()

    # --- engine thread --------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], Any], wait: bool = True) -> Any:
        future: Future = Future()
        if not wait:
            future.add_done_callback(_log_failure)
        # Under close()'s lock: a command queued behind the sentinel would never run, its caller never return.
        with self._close_lock:
            if self._closed:
                raise EngineUnavailableError("the engine is closed")
            self._commands.put((fn, future))
        return future.result() if wait else None

    def _run(self, ready: Future) -> None:
        try:
            self._build()
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructor
            ready.set_exception(e)
            return
        ready.set_result(None)
        self._loop()

    def _loop(self) -> None:
        while True:
            idle = not self._active
            try:
                # Block while idle; while generating, only drain what is already queued.
                item = self._commands.get(block=idle)
            except queue.Empty:
                item = ()
            window_end = None
            while item != ():
                if item is None:
                    self._shutdown()
                    return
                fn, future = item
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
                if window_end is None and idle and self._active:
                    window_end = time.monotonic() + ADMISSION_WINDOW_S
                item = self._next_command(window_end)
            if self._active:
                try:
                    self._step()
                except Exception as e:
                    logger.exception("engine step failed")
                    self._abort(list(self._active), f"engine step failed: {e}")

    def _next_command(self, window_end: float | None) -> Any:
        """The next queued command, or () when none is; within an admission window (`window_end`), waits
        up to ADMISSION_GAP_S for one."""
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            pass
        remaining = window_end - time.monotonic() if window_end is not None else 0.0
        if remaining <= 0:
            return ()
        try:
            return self._commands.get(timeout=min(ADMISSION_GAP_S, remaining))
        except queue.Empty:
            return ()

    def _shutdown(self) -> None:  # on the engine thread, after every command queued before close()
        self._abort(list(self._active), "the engine is shutting down")
        try:
            self._engine.engine_core.shutdown()
        except Exception:  # the process is going; what vLLM's teardown raises changes nothing
            logger.warning("vLLM engine shutdown raised", exc_info=True)

    def _add(self, request: SampleRequest, on_finish: Callable[[SampleResult], None]) -> None:
        from vllm.inputs import TokensPrompt

        reason = self.unavailable_reason()
        expected = request.expected_weights_version
        if reason is None and expected and expected != self._version:
            # The version changed between the caller's check and this point: never mix versions.
            self._deliver(on_finish, SampleResult.failed(request, self._version, FINISH_ABORT,
                                             f"the weights changed to version {self._version} before this sample "
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
            self._deliver(on_finish, SampleResult.failed(request, self._version, FINISH_ERROR, reason))
            return
        self._active[request.request_id] = _InFlight(request, on_finish, self._version, time.monotonic())
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
                result = SampleResult(
                    request_id=out.request_id,
                    response_token_ids=np.asarray(entry.token_ids, dtype=np.int32),
                    response_log_probs=np.asarray(entry.log_probs, dtype=np.float32),
                    finish_reason=reason,
                    prompt_length=len(entry.request.prompt_token_ids),
                    weights_version=entry.version,
                    finished_at=now,
                )
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

    @staticmethod
    def _deliver(on_finish: Callable[[SampleResult], None], result: SampleResult) -> None:
        try:
            on_finish(result)
        except Exception:
            logger.exception("sample callback failed for %s", result.request_id)

    def _apply_weights(self, update: StagedUpdate, first: bool = True, last: bool = True,
                       backup: bool = False) -> float:
        started = time.monotonic()
        if first:
            if backup:
                # What `_restore_weights` returns to, set before any check: pieces queued behind a refused first
                # one are still applied (with their backup), then undone.
                self._before_push = (self._weights_error,)
            if self._sleeping and self.sleep_mode_native:
                # vLLM's sleep mode has moved or discarded the device weights; writing them now would be lost.
                raise EngineUnavailableError("the replica is asleep; call Wake before UpdateWeights")
            if update.version < self._version:
                raise WeightsVersionBehindError(update.version, self._version)
            if self._active:
                self._abort(list(self._active),
                            f"weights changed from version {self._version} to {update.version} during generation; "
                            "regenerate at the new version")
        try:
            if update.tensors and backup:
                self._engine.apply_model(functools.partial(worker_ops.load_weights_with_backup, update.names,
                                                           update.tensors, first=first))
            elif update.tensors:
                self._engine.apply_model(functools.partial(worker_ops.load_weights, update.tensors, first=first))
        except Exception as e:
            # Some tensors may have been written: refuse to serve until a complete update lands.
            self._weights_error = (f"the weight update to version {update.version} failed midway ({e}); "
                                   "the weights are inconsistent until a complete UpdateWeights succeeds")
            if isinstance(e, WeightUpdateError):  # a bucket refused by its checks: the caller hears why
                logger.info("weight update to version %d refused while applying: %s", update.version, e)
            else:
                logger.exception("weight update to version %d failed", update.version)
            raise
        if not last:
            self._weights_error = (f"the weight update to version {update.version} did not complete; the weights "
                                   "are inconsistent until a complete UpdateWeights succeeds")
            return time.monotonic() - started
        if self._before_push is not None:
            self._engine.apply_model(worker_ops.drop_backup)
            self._before_push = None
        # Cached prefixes were computed with the old weights.
        self._engine.reset_prefix_cache()
        self._version = update.version
        self._weights_error = None
        seconds = time.monotonic() - started
        metrics.WEIGHTS_VERSION.set(update.version)
        metrics.WEIGHT_UPDATE_SECONDS.observe(seconds)
        logger.info("weights version %d applied: %d tensors, %d bytes in %.3f s", update.version,
                    update.num_tensors or len(update.tensors), update.num_bytes, seconds)
        return seconds

    def _restore_weights(self) -> int:
        if self._before_push is None:
            return 0  # no piece was applied with a backup (or the push completed)
        restored = self._engine.apply_model(worker_ops.restore_backup)
        restored = sum(restored) if isinstance(restored, list) else restored
        # Nothing generated since the push began (it refused to), so the prefix cache still matches these weights.
        (self._weights_error,), self._before_push = self._before_push, None
        logger.info("weight update failed midway: restored %d parameters, still serving version %d", restored,
                    self._version)
        return restored

    def _sleep(self, level: int) -> float:
        if self._sleeping:
            return 0.0
        started = time.monotonic()
        if self._active:
            self._abort(list(self._active), "the replica went to sleep")
        if self.sleep_mode_native:
            self._engine.sleep(level)
            if level >= 2:
                self._weights_error = ("the replica was woken from a level-2 sleep, which discards the weights; "
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


def held_dtypes(hf_names: list[str], model: Any) -> dict[str, Any]:
    """(Runs in the worker.) HF name -> dtype of the vLLM parameter loading it writes into (the fused one for
    q/k/v, gate/up and the experts: moe_weights.target), for the names it places in a float dtype the wire carries;
    the others (a model's own renaming, quantized storage) stay at the model dtype."""
    import torch

    carried = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    out = {}
    for name in hf_names:
        target = moe_weights.target(name, params, packed)
        if target is not None and params[target].dtype in carried:
            out[name] = params[target].dtype
    return out


def _log_failure(future: Future) -> None:
    if future.exception() is not None:
        logger.error("engine command failed", exc_info=future.exception())
