"""Offload / onload of a trainer rank's state (services/trainer/offload.py) on a CPU-only host: the memory
really leaves the process and the state comes back bit for bit."""

from __future__ import annotations

import pytest
import torch

from services.common.memory import resident_bytes
from services.trainer.offload import OffloadedError, StateOffloader

MIB = 1 << 20


def _trained_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # 2 x 2048 x 2048 fp32 weights = 32 MiB of parameters, 32 MiB of grads, 64 MiB of Adam moments.
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def test_offload_frees_the_memory_and_onload_restores_every_value() -> None:
    model, optimizer = _trained_model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    moments = {k: v.clone() for k, v in optimizer.state[model[0].weight].items()}
    off = StateOffloader(model, optimizer, torch.device("cpu"))

    before = resident_bytes()
    moved = off.offload(["params", "grads", "optimizer"])
    after = resident_bytes()
    # 4 Linear weights+biases: params 32 MiB + 16 KiB, grads the same, Adam moments twice that.
    assert moved == 4 * (2 * 2048 * 2048 + 2 * 2048) * 4
    assert before - after > 100 * MIB  # of the 128 MiB moved out, the process gave (nearly) all back
    assert all(p.numel() == 0 for p in model.parameters()) and all(p.grad is None for p in model.parameters())

    with pytest.raises(OffloadedError, match="params and grads and optimizer"):
        off.require("params", "grads", "optimizer", what="Update")
    assert off.onload(["params", "grads", "optimizer"]) == moved
    assert resident_bytes() - after > 100 * MIB
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]) and torch.equal(p.grad, grads[n])
    for k, v in optimizer.state[model[0].weight].items():
        assert torch.equal(v, moments[k])
    off.require("params", "grads", "optimizer", what="Update")  # nothing offloaded any more
    optimizer.step()  # the optimizer still knows its parameters


def test_offload_is_per_kind_and_idempotent() -> None:
    model, optimizer = _trained_model()
    off = StateOffloader(model, optimizer, torch.device("cpu"))
    first = off.offload(["optimizer"])
    assert first == 2 * (2 * 2048 * 2048 + 2 * 2048) * 4 and off.offload(["optimizer"]) == 0
    assert all(p.numel() > 0 for p in model.parameters())  # only what was asked for moved
    off.require("params", what="ComputeLogProbs")
    assert off.onload(["optimizer", "grads"]) == first and off.onload(["optimizer"]) == 0
    with pytest.raises(ValueError, match="unknown offload kind"):
        off.offload(["weights"])
