"""The trainer's counters (iteration, consumed samples, weights version) move only by Update, LoadCheckpoint and
an acknowledged PushWeights, and never past services/trainer/checkpoint.py MAX_COUNTER (2**53-1).

Found by the 10,000-message trainer fuzz soak (docs/reliability.md): its after-check read iteration 2**53+1.
SaveCheckpoint adopted the iteration it was asked to record before it knew it could save, so one refused
(params offloaded) SaveCheckpoint of iteration 2**53+1 left the trainer there, and a LoadCheckpoint of a
checkpoint saved at 2**64-1 made that the trainer's iteration. One real `trainer serve` rank.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rlfabric.v1 import trainer_pb2, trainer_pb2_grpc


@pytest.fixture(scope="module")
def trainer(start_trainer, tiny_model_dir: Path, tmp_path_factory):
    from services.common.client import make_channel

    _, address = start_trainer("--hf-dir", str(tiny_model_dir))
    channel = make_channel(address)
    yield trainer_pb2_grpc.TrainerStub(channel), tmp_path_factory.mktemp("counters")
    channel.close()


def counters(stub) -> tuple[int, int]:
    info = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30)
    return info.iteration, info.weights_version


def code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details() or ""


def test_a_refused_save_checkpoint_moves_no_counter(trainer) -> None:
    stub, work = trainer
    stub.Offload(trainer_pb2.OffloadRequest(optimizer=True), timeout=60)
    try:
        save = trainer_pb2.SaveCheckpointRequest(dir=str(work / "refused"), iteration=7, consumed_samples=9)
        code, details = code_and_details(lambda: stub.SaveCheckpoint(save, timeout=60))
    finally:
        stub.Onload(trainer_pb2.OnloadRequest(optimizer=True), timeout=60)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "Onload" in details
    assert counters(stub) == (0, 0)
    assert not (work / "refused" / "iter_0000007").exists()


def test_save_checkpoint_records_its_numbers_but_does_not_move_the_trainers(trainer) -> None:
    stub, work = trainer
    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(dir=str(work / "ok"), iteration=7,
                                                                  consumed_samples=9), timeout=120)
    assert (saved.iteration, saved.consumed_samples) == (7, 9)
    assert (work / "ok" / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert counters(stub) == (0, 0)  # a checkpoint write is not a training step
    # Loading it is what moves the trainer to its iteration (and the weights to a new version label).
    loaded = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(dir=str(work / "ok")), timeout=120)
    assert (loaded.iteration, loaded.consumed_samples) == (7, 9)
    assert counters(stub) == (7, 1)


BIG = {"2**53": 2**53, "2**53+1": 2**53 + 1, "2**64-1": 2**64 - 1}


@pytest.mark.parametrize("value", list(BIG), ids=list(BIG))
@pytest.mark.parametrize("rpc,field", [("SaveCheckpoint", "iteration"), ("SaveCheckpoint", "consumed_samples"),
                                       ("LoadCheckpoint", "iteration"), ("PushWeights", "version")])
def test_counters_past_the_bound_are_refused_naming_the_field(trainer, rpc: str, field: str, value: str) -> None:
    stub, work = trainer
    before = counters(stub)
    target = work / f"big-{rpc}-{field}-{value}"
    if rpc == "PushWeights":
        plan = trainer_pb2.ReshardPlan(trainer_tensor_parallel_size=1, trainer_pipeline_parallel_size=1)
        request = trainer_pb2.PushWeightsRequest(targets=["127.0.0.1:9"], plan=plan, **{field: BIG[value]})
        code, details = code_and_details(lambda: list(stub.PushWeights(request, timeout=60)))
    else:
        message = getattr(trainer_pb2, f"{rpc}Request")(dir=str(target), **{field: BIG[value]})
        code, details = code_and_details(lambda: getattr(stub, rpc)(message, timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"{rpc}: {field} {BIG[value]} is out of range"), details
    assert counters(stub) == before
    assert not target.exists()


def test_a_checkpoint_recording_an_absurd_iteration_is_refused_before_any_state_moves(trainer) -> None:
    import torch

    stub, work = trainer
    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(dir=str(work / "absurd"), iteration=3),
                                timeout=120)
    # As written by a trainer that took any number (before the bound) or by another tool.
    shard = Path(saved.path) / "mp_rank_00" / "model_optim_rng.pt"
    payload = torch.load(shard, map_location="cpu", weights_only=False)
    payload["iteration"] = 2**64 - 1
    torch.save(payload, shard)
    before = counters(stub)
    code, details = code_and_details(lambda: stub.LoadCheckpoint(
        trainer_pb2.LoadCheckpointRequest(dir=str(work / "absurd")), timeout=120))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"iteration {2**64 - 1} is out of range" in details
    assert counters(stub) == before
