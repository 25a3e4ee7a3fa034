"""Where a streamed bucket's tensors are copied without vLLM's loader (services/rollout/worker_ops.py
`_Placements`): learnt by watching the model's own loader, used only for tensors it copied whole, and
forgotten when a parameter moves. A small torch model stands in for vLLM's (same `load_weights` contract);
tests/weight_sync/test_shm.py checks the real engine bitwise."""

from __future__ import annotations

import pytest
import torch

from services.rollout import worker_ops
from services.rollout.weight_checks import ParamSpec, Verification
from services.rollout.weights import make_bucket


class FusedModel(torch.nn.Module):
    """q/k/v loaded into row ranges of one fused parameter (as vLLM's QKVParallelLinear at TP 1), `emb`
    whole, `halved` from a slice of its tensor, `scaled` copied and then written again."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)
        self.halved = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.scaled = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.loaded: list[str] = []

    def load_weights(self, weights):
        rows = {"q": (0, 2), "k": (2, 4), "v": (4, 6)}
        for name, w in weights:
            self.loaded.append(name)
            if name in rows:
                self.qkv.data.narrow(0, rows[name][0], 2).copy_(w)
            elif name == "emb":
                self.emb.data.copy_(w)
            elif name == "halved":
                self.halved.data.copy_(w.narrow(0, 0, 2))
            elif name == "scaled":
                self.scaled.data.copy_(w)
                self.scaled.data.mul_(2.0)
        return set(self.loaded)


SHAPES = {"q": (2, 4), "k": (2, 4), "v": (2, 4), "emb": (3, 4), "halved": (4, 4), "scaled": (2, 4)}
SPECS = {name: ParamSpec(shape, torch.float32) for name, shape in SHAPES.items()}


def _tensors(seed: int, names: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(SHAPES[name], generator=g) for name in names}


def _load(model: FusedModel, tensors: dict[str, torch.Tensor], first: bool = True) -> list[str]:
    """Loads one streamed bucket; returns the names the model's own loader got."""
    bucket = make_bucket(1, 0, tensors)
    verified = Verification(0, 1, bucket.checksum, list(tensors.items()), SPECS).take()
    model.loaded = []
    worker_ops.load_weights(verified, model, first=first)
    return model.loaded


def _reference(*buckets: dict[str, torch.Tensor]) -> FusedModel:
    ref = FusedModel()
    for tensors in buckets:
        ref.load_weights(tensors.items())
    return ref


def _assert_same(model: FusedModel, ref: FusedModel) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name


BUCKET = ["q", "k", "v", "emb", "halved"]


def test_tensors_copied_whole_are_placed_after_the_first_load_and_land_as_the_loader_puts_them() -> None:
    model = FusedModel()
    assert _load(model, _tensors(0, BUCKET)) == BUCKET  # learnt from the loader
    second = _tensors(1, BUCKET)
    assert _load(model, second) == ["halved"]  # the loader gets only what it copied from a slice
    _assert_same(model, _reference(_tensors(0, BUCKET), second))


def test_a_bucket_whose_loading_writes_parameters_otherwise_stays_with_the_loader() -> None:
    model = FusedModel()
    _load(model, _tensors(0, ["emb", "scaled"]))
    second = _tensors(1, ["emb", "scaled"])
    assert _load(model, second) == ["emb", "scaled"]  # the mul_ after the copy: nothing of that load is trusted
    _assert_same(model, _reference(second))


def test_a_moved_parameter_makes_the_places_be_learnt_again() -> None:
    model = FusedModel()
    _load(model, _tensors(0, BUCKET))
    model.emb = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)  # as a wake or a re-processing may
    third = _tensors(2, BUCKET)
    assert _load(model, third) == BUCKET
    assert torch.equal(model.emb, third["emb"])
    _assert_same(model, _reference(third))


def test_a_non_finite_placed_tensor_fails_the_load() -> None:
    model = FusedModel()
    _load(model, _tensors(0, BUCKET))
    bad = _tensors(1, BUCKET)
    bad["emb"][1, 2] = float("nan")
    with pytest.raises(Exception, match=r"parameter 'emb' has 1 non-finite values"):
        _load(model, bad)


def test_a_list_of_tensors_goes_to_the_loader() -> None:
    model = FusedModel()
    tensors = _tensors(0, BUCKET)
    model.loaded = []
    worker_ops.load_weights(list(tensors.items()), model)
    assert model.loaded == BUCKET
    _assert_same(model, _reference(tensors))
