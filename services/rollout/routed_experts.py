"""Routed-experts capture for routing replay: the experts each MoE layer chose for each token of a sample.

vLLM 0.32 has this upstream (`enable_return_routed_experts`, `CompletionOutput.routed_experts`), but only
with the V2 model runner, which needs Triton: on vLLM-CPU, VLLM_USE_V2_MODEL_RUNNER=1 fails the engine build
("Model Runner V2 requires Triton"), and with the V1 runner the option builds but every output has
`routed_experts=None` (measured on the tiny Qwen3-MoE). So the capture is done here, on any runner, with the
same hook upstream uses: every MoE router (`BaseRouter.capture_fn`) hands over
its logical top-k expert ids (before any expert-parallel remapping) during the forward; after each
`execute_model` the step's rows are split per request (the runner's batch order and scheduled token
counts) and filed by position, so a preempted and recomputed request simply overwrites its rows.

What a sample gets (`RolloutEngine.take_routed_experts` on the engine side): int32 [positions, moe_layers,
top_k], row p the experts chosen for the token at position p of prompt + response, for every position the
engine computed: prompt_length + response_length - 1 rows (the last sampled token is never fed back).
Rows `prompt_length - 1:` are the forwards that produced the response tokens, one per response token.
Layers are the MoE layers in order (`layers`), expert ids are the HF expert numbers. The prefix cache must be
off: a cached prompt block is never computed, so its rows would be missing (refused at build).

Functions run inside the worker (`collective_rpc`), at module level so that executors can pickle them.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


class RoutingCapture:
    """Worker side: binds the routers, files each step's rows per request, hands them over on `take`."""

    def __init__(self, runner: Any) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        moe = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        if not moe:
            raise ValueError("return_routed_experts: the model has no MoE layers")
        self.layers = sorted({int(m.layer_id) for m in moe})
        if len(self.layers) != len(moe):
            raise ValueError("return_routed_experts: two MoE layers share a layer index")
        column = {layer: i for i, layer in enumerate(self.layers)}
        for m in moe:
            if m._quant_method.is_monolithic or not isinstance(m.router, BaseRouter):
                raise ValueError(f"return_routed_experts: MoE layer {m.layer_id} routes inside a fused kernel "
                                 f"({type(m.router).__name__}); its expert ids cannot be captured")
            m.router.set_capture_fn(functools.partial(self._capture, column[int(m.layer_id)]))
        self.top_k = int(runner.vllm_config.model_config.get_num_experts_per_tok())
        num_experts = int(runner.vllm_config.model_config.get_num_experts())
        self._dtype = np.uint8 if num_experts <= 256 else np.int16  # kept narrow while a sample runs
        self._step: dict[int, Any] = {}
        self._filed: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._runner = runner
        self._execute = runner.execute_model
        runner.execute_model = self._execute_model

    def _capture(self, column: int, topk_ids: Any) -> None:
        self._step[column] = topk_ids.detach().to("cpu", copy=True)

    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._step.clear()  # rows of dummy (profiling) forwards outside a step
        out = self._execute(scheduler_output, *args, **kwargs)
        n = int(scheduler_output.total_num_scheduled_tokens)
        if n and self._step:
            self._file(scheduler_output, n)
        self._step.clear()
        return out

    def _file(self, scheduler_output: Any, n: int) -> None:
        if len(self._step) != len(self.layers):
            raise RuntimeError(f"routed-experts capture: {len(self._step)} of {len(self.layers)} MoE layers "
                               "reported their experts in this step")
        rows = np.stack([self._step[c][:n].numpy() for c in range(len(self.layers))], axis=1).astype(self._dtype)
        positions = self._runner.positions[:n].cpu().numpy().astype(np.int64)
        batch = self._runner.input_batch
        start = 0
        # The step's tokens are the batch's requests in batch order, each with its scheduled count.
        for req_id in batch.req_ids[:batch.num_reqs]:
            count = int(scheduler_output.num_scheduled_tokens.get(req_id, 0))
            if count:
                self._filed.setdefault(req_id, []).append((positions[start:start + count],
                                                           rows[start:start + count]))
            start += count
        if start != n:
            raise RuntimeError(f"routed-experts capture: {start} of the step's {n} tokens belong to known requests")

    def _pop(self, req_id: str) -> list[tuple[np.ndarray, np.ndarray]]:
        # The runner knows a request by vLLM's internal id: the caller's id plus "-" and 8 random characters
        # (InputProcessor.assign_request_id); the caller's ids are unique among the requests in flight.
        for key in [k for k in self._filed if k == req_id or k.rsplit("-", 1)[0] == req_id]:
            return self._filed.pop(key)
        return []

    def take(self, req_ids: list[str]) -> dict[str, np.ndarray]:
        """Each request's rows, int32 [positions, layers, top_k] (see module docstring), forgotten here."""
        out = {}
        for req_id in req_ids:
            chunks = self._pop(req_id)
            size = max((int(p.max()) + 1 for p, _ in chunks if len(p)), default=0)
            routed = np.full((size, len(self.layers), self.top_k), -1, dtype=np.int32)
            for positions, rows in chunks:
                routed[positions] = rows
            out[req_id] = routed
        return out

    def drop(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._pop(req_id)


def start_capture(worker: Any) -> tuple[list[int], int]:
    """Installs the capture on the worker's runner (once); returns (MoE layer indices, top_k)."""
    runner = worker.model_runner
    capture = getattr(runner, "_rlfabric_routing", None)
    if capture is None:
        capture = runner._rlfabric_routing = RoutingCapture(runner)
    return list(capture.layers), capture.top_k


def take(worker: Any, req_ids: list[str]) -> dict[str, np.ndarray]:
    return worker.model_runner._rlfabric_routing.take(req_ids)


def drop(worker: Any, req_ids: list[str]) -> int:
    worker.model_runner._rlfabric_routing.drop(req_ids)
    return len(req_ids)
