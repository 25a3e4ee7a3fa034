"""The vLLM workarounds are active where needed and leave the rest of the process alone."""

from __future__ import annotations

import torch

from services.rollout.patches import active_patches, engine_arg_overrides


def test_cpu_patches_are_active_and_thread_control_is_restored(rollout_engine) -> None:
    if not rollout_engine.is_cpu:
        assert active_patches() == []
        return
    assert "cpu_unquantized_gemm_keeps_weight" in active_patches()
    # Without the patch, vLLM empties every linear weight after packing it (shape (0,)).
    shapes = rollout_engine.engine_parameter_shapes()
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (128, 512)
    # The vLLM CPU worker replaces torch.set_num_threads process-wide; the engine gives it back.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(before)


def test_cpu_engine_args_disable_chunked_prefill(rollout_engine) -> None:
    overrides = engine_arg_overrides(4096, 1024)
    if rollout_engine.is_cpu:
        assert overrides == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    else:
        assert overrides == {}


def test_cpu_logprob_ranks_are_counted_eagerly_with_the_compiled_functions_values(rollout_engine) -> None:
    if not rollout_engine.is_cpu:
        return
    import vllm.v1.sample.ops.logprobs as compiled
    import vllm.v1.sample.sampler as sampler

    assert "cpu_logprob_ranks_eager" in active_patches()
    assert sampler.batched_count_greater_than is not compiled.batched_count_greater_than
    logprobs = torch.log_softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(0)), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor([[0], [7], [299], [3], [150]]))
    ranks = sampler.batched_count_greater_than(logprobs, chosen)
    # The rank vLLM reports: how many tokens are at least as likely as the chosen one (1 for the most likely).
    assert ranks.tolist() == [int((row >= c).sum()) for row, c in zip(logprobs, chosen[:, 0], strict=True)]
    assert ranks.dtype == torch.int64 and ranks.shape == (5,)
