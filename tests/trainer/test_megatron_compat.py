"""Both sides of the Megatron CPU shim: active without an accelerator, a no-op with one."""

from __future__ import annotations

import pytest
import torch

from services.trainer import megatron_compat


@pytest.fixture
def clean_cuda(monkeypatch: pytest.MonkeyPatch):
    # The shim patches torch.cuda process-wide; register the originals so they come back after the test.
    monkeypatch.setattr(torch.cuda, "current_device", torch.cuda.current_device)
    monkeypatch.setattr(torch.cuda, "synchronize", torch.cuda.synchronize)
    from megatron.core.tensor_parallel import random as tp_random

    monkeypatch.setattr(tp_random, "_get_cuda_rng_state", tp_random._get_cuda_rng_state)
    monkeypatch.setattr(tp_random, "_set_cuda_rng_state", tp_random._set_cuda_rng_state)
    monkeypatch.setattr(megatron_compat, "_PATCHED", False)
    return monkeypatch


def test_gate_reports_no_accelerator_on_this_machine():
    assert torch.cuda.is_available() is False
    assert megatron_compat.accelerator_present() is False


def test_patches_apply_on_cpu(clean_cuda):
    assert megatron_compat.apply_cpu_patches() is True
    assert megatron_compat.patches_applied()
    # RoPE / GlobalMemoryBuffer allocate on torch.cuda.current_device(): now the CPU.
    assert torch.arange(3, device=torch.cuda.current_device()).device.type == "cpu"
    torch.cuda.synchronize()  # p2p_communication calls it; a no-op on CPU
    assert megatron_compat.apply_cpu_patches() is True  # idempotent


def test_patches_are_skipped_with_an_accelerator(clean_cuda):
    clean_cuda.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.cuda.current_device
    assert megatron_compat.accelerator_present() is True
    assert megatron_compat.apply_cpu_patches() is False
    assert torch.cuda.current_device is before
    assert not megatron_compat.patches_applied()


def test_cuda_device_mode_redirects_allocations_on_cpu():
    with megatron_compat.cpu_device_mode():
        z = torch.zeros(2, dtype=torch.int, device="cuda")
        t = torch.tensor([1.0], device=torch.device("cuda"))
        moved = torch.ones(2).cuda()
        to = torch.ones(1).to("cuda")
    assert z.device.type == t.device.type == moved.device.type == to.device.type == "cpu"
    assert z.tolist() == [0, 0] and t.item() == 1.0


def test_cuda_device_mode_is_a_noop_with_an_accelerator(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # Without the mode a "cuda" allocation reaches torch, which has no CUDA here and raises:
    # proof that nothing was redirected.
    with megatron_compat.cpu_device_mode(), pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_seeding_uses_the_upstream_cuda_path_with_an_accelerator(monkeypatch: pytest.MonkeyPatch):
    from megatron.core import tensor_parallel

    calls = []
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(megatron_compat, "accelerator_present", lambda: True)
    megatron_compat.seed_model_parallel_rng(7)
    assert calls == [((7,), {})]
    monkeypatch.setattr(megatron_compat, "accelerator_present", lambda: False)
    megatron_compat.seed_model_parallel_rng(7)
    assert calls[1] == ((7,), {"inference_rng_tracker": True, "force_reset_rng": True})


def test_megatron_activation_checkpoint_runs_on_cpu(clean_cuda):
    """Recompute (CheckpointFunction) saves and restores the RNG on a CPU: the recomputed dropout mask is the
    forward's, and nothing is left queued for a CUDA that never comes."""
    from megatron.core import tensor_parallel

    megatron_compat.apply_cpu_patches()
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)

    def f(x):
        return torch.nn.functional.dropout(torch.tanh(x @ w), 0.5, training=True)

    queued = len(torch.cuda._queued_calls)
    torch.manual_seed(0)
    y = tensor_parallel.checkpoint(f, False, x)
    y.pow(2).sum().backward()
    got = (y.detach().clone(), w.grad.clone(), x.grad.clone())
    w.grad = x.grad = None
    torch.manual_seed(0)
    f(x).pow(2).sum().backward()
    assert torch.equal(got[1], w.grad) and torch.equal(got[2], x.grad)
    assert (got[0] == 0).any()  # dropout did act, so the mask had to be reproduced
    assert len(torch.cuda._queued_calls) == queued


def test_torch_norm_runs_under_sequence_parallelism_and_tags_its_weight():
    from megatron.core.transformer import TransformerConfig

    def config(**kw):
        return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2, **kw)

    norm = megatron_compat.TorchNorm(config(normalization="RMSNorm", sequence_parallel=True), 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6 and norm.weight.sequence_parallel is True
    plain = megatron_compat.TorchNorm(config(normalization="LayerNorm"), 8)
    assert isinstance(plain, torch.nn.LayerNorm) and all(p.sequence_parallel is False for p in plain.parameters())
    with pytest.raises(ValueError, match="L2Norm"):
        megatron_compat.TorchNorm(config(normalization="L2Norm"), 8)


def test_megatron_import_under_the_patches_leaves_torch_compile_for_a_first_call():
    # A fresh process: the patches import Megatron-core; its fusion decorators must not import torch._dynamo.
    import subprocess
    import sys

    code = ("import sys; from services.trainer import megatron_compat as m; assert m.apply_cpu_patches(); "
            "import megatron.core.jit as j, torch; print('torch._dynamo' in sys.modules, torch.compile.__module__, "
            "j.jit_fuser.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    # not imported; torch.compile itself back once the import ended; Megatron's jit_fuser the deferred compile
    assert out == ["False", "torch", "deferred"]


def test_deferred_compile_compiles_once_on_the_first_call_with_the_callers_options(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return lambda *a: fn(*a) * 10

    monkeypatch.setattr(torch, "compile", fake_compile)
    with megatron_compat.compile_on_first_call():
        plain = torch.compile(lambda x: x + 1)

        @torch.compile(dynamic=False)
        def decorated(x):
            return x + 2

    assert torch.compile is fake_compile and calls == []  # nothing compiled at definition
    assert plain(1) == 20 and plain(2) == 30 and decorated(1) == 30
    assert calls == [{}, {"dynamic": False}]  # once per function, with its options
    assert decorated.__name__ == "decorated"
