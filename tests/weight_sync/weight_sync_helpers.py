"""Helpers of the weight-sync tests, built on the rollout tests' own helpers."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS / "rollout") not in sys.path:
    sys.path.append(str(_TESTS / "rollout"))

from rollout_helpers import generate, group_request, hf_greedy, tokens  # noqa: E402

__all__ = ["PROMPTS", "assert_engine_holds", "assert_engine_reads_back", "engine_parameters", "hf_checkpoint",
           "hf_greedy_all", "names_by_expert_rank", "restore_checkpoint_weights", "rollout_greedy", "rollout_version",
           "serve_rollout", "start_ep2_trainer"]

PROMPTS = [[5, 99, 1200, 7, 3000, 42], [17, 18, 19, 20], [4000, 3, 3, 812, 90, 91, 92, 2048]]


def rollout_greedy(stub, prompts: Sequence[Sequence[int]], max_tokens: int = 12, version: int = 0) -> list[list[int]]:
    samples = generate(stub, [group_request(f"g{i}", p, version=version, temperature=0.0, max_tokens=max_tokens)
                              for i, p in enumerate(prompts)])
    by_group = {s.group_id: tokens(s) for s in samples}
    return [by_group[f"g{i}"] for i in range(len(prompts))]


def hf_greedy_all(model, prompts: Sequence[Sequence[int]], max_tokens: int = 12) -> list[list[int]]:
    return [hf_greedy(model, p, max_tokens) for p in prompts]


def rollout_version(address: str) -> int:
    from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
    from services.common.client import make_channel

    with make_channel(address) as channel:
        return rollout_pb2_grpc.RolloutStub(channel).Info(rollout_pb2.RolloutInfoRequest(), timeout=30).weights_version


def restore_checkpoint_weights(address: str, model_dir: Path) -> None:
    """Pushes the model folder's own weights to the replica, at its next version."""
    from services.common.transports import GrpcStreamTransport, WeightAck
    from services.trainer.convert import load_hf_state

    version = rollout_version(address) + 1
    outcome = GrpcStreamTransport([address], timeout_s=120).send(version, iter(load_hf_state(model_dir).items()))
    assert isinstance(outcome[address], WeightAck), outcome


def serve_rollout(engine):
    """A started Rollout server over `engine` (several servers may share one engine: several targets)."""
    from services.rollout.options import SamplingOptions
    from services.rollout.server import create_rollout_server

    server, _ = create_rollout_server(engine, SamplingOptions(max_tokens=16, temperature=1.0), metrics_port=None)
    server.start()
    return server


def _parameter_copies(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_parameters(engine) -> dict:
    """Copies of the engine's own (fused) parameters, read on its thread."""
    import functools

    params = engine._call(functools.partial(engine._engine.apply_model, _parameter_copies))
    return params[0] if isinstance(params, list) else params


def _placed(model) -> set[str]:
    places = getattr(model, "_rlfabric_placements", None)
    return set(places.current()) if places is not None else set()


def placed_names(engine) -> set[str]:
    """The HF names whose streamed tensors the engine copies itself (services/rollout/worker_ops.py _Placements)."""
    import functools

    names = engine._call(functools.partial(engine._engine.apply_model, _placed))
    return names[0] if isinstance(names, list) else names


def assert_engine_holds(engine, hf_state: dict) -> None:
    """Bitwise: every vLLM parameter equals the HF tensors it is built from (qkv / gate_up fused on dim 0)."""
    import torch

    params = engine_parameters(engine)
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    checked = 0
    for name, value in params.items():
        parts = next(([name.replace(k, p) for p in v] for k, v in fused.items() if f".{k}." in name), [name])
        if not all(p in hf_state for p in parts):
            assert name == "lm_head.weight", f"vLLM parameter {name} has no HF source"
            continue  # tied to the embedding
        expected = torch.cat([hf_state[p] for p in parts]) if len(parts) > 1 else hf_state[parts[0]]
        assert value.dtype == expected.dtype and torch.equal(value, expected), f"{name} differs"
        checked += 1
    assert checked >= len(params) - 1


def start_ep2_trainer(start_trainer, hf_dir: Path):
    """(group, Trainer stub) of an EP 2 group (world 2: TP 1, PP 1, DP 2) on `hf_dir`'s weights."""
    import grpc

    from rlfabric.v1 import trainer_pb2_grpc

    group, address = start_trainer("--hf-dir", str(hf_dir), "--ep", "2", "--world-size", "2",
                                   "--forward-micro-batch-size", "4")
    return group, trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(address))


def hf_checkpoint(path: Path) -> dict:
    from services.trainer.convert import load_hf_state

    return load_hf_state(path)


def assert_engine_reads_back(engine, state: dict) -> None:
    """Bitwise: the engine's read-back of every HF tensor of `state` (MoE engines read whole HF tensors back)."""
    import torch

    held = engine.read_weights(list(state))
    differing = [n for n, t in state.items() if held[n] is None or not torch.equal(held[n], t)]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:3]}"


def names_by_expert_rank(info) -> dict[int, list[str]]:
    """A TrainerInfo's shard names per EP rank, each rank's listed once (its DP replicas are not repeated)."""
    by_rank: dict[int, list[str]] = {}
    for s in info.shards:
        by_rank.setdefault(s.ep_rank, []).append(s.name)
    for names in by_rank.values():
        assert len(names) == len(set(names))
    return by_rank
