"""Weight-sync fixtures: trainer groups (TP 1, TP 2, PP 2) started by `rlfabric trainer serve` through the
session's `start_trainer`; the rollout engine and server are the session's own (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from weight_sync_helpers import restore_checkpoint_weights


# TP 1 in the soak: every `up` of the e2e tests pushes from a TP-1 trainer, and test_collective.py checks a TP-1
# push bitwise; the layouts that reshard are TP 2 and PP 2.
@pytest.fixture(scope="module", params=[pytest.param((1, 1), marks=pytest.mark.slow), (2, 1), (1, 2)],
                ids=["tp1", "tp2", "pp2"])
def trainer(request, start_trainer, tiny_model_dir: Path, rollout_server) -> Iterator[dict]:
    from rlfabric.v1 import trainer_pb2_grpc

    tp, pp = request.param
    group, address = start_trainer("--hf-dir", str(tiny_model_dir), "--tp", str(tp), "--pp", str(pp),
                                   "--lr", "1e-2", "--micro-batch-size", "4", "--forward-micro-batch-size", "4")
    server, _ = rollout_server
    channel = grpc.insecure_channel(address)
    try:
        yield {"stub": trainer_pb2_grpc.TrainerStub(channel), "tp": tp, "pp": pp, "work": group.log_path.parent,
               "address": address, "rollout_address": server.address}
    finally:
        channel.close()
        group.stop(grace_s=12)
        restore_checkpoint_weights(server.address, tiny_model_dir)  # the trained weights must not leak out
