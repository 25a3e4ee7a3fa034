"""The services under fuzzing: reward (in-process worker), rollout (the session's vLLM server), trainer (a
`trainer serve` group on the tiny model's HF weights), coordinator (in-process, with a finished run in its
journal). Each comes with good requests and the check that it still answers them correctly."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))


@dataclass
class Service:
    target: Any  # harness.Target
    check: Any  # () -> None: good requests get correct answers


def _channel(address: str):
    from services.common.client import make_channel

    return make_channel(address)


@pytest.fixture(scope="module")
def reward_service() -> Iterator[Service]:
    from harness import Target

    from rlfabric.v1 import reward_pb2
    from services.reward.worker import RewardWorker, RewardWorkerOptions

    def request(i: int, answer: str) -> reward_pb2.ScoreRequest:
        return reward_pb2.ScoreRequest(sample_id=f"good/{i}", response=f"so the answer is \\boxed{{{answer}}}",
                                       ground_truth="4", verifiers=[reward_pb2.VerifierSpec(name="math_17k_acc",
                                                                                          weight=1.0)])

    good = reward_pb2.ScoreRequestBatch(requests=[request(0, "4"), request(1, "5"), request(2, "4"), request(3, "7")])
    with RewardWorker(RewardWorkerOptions(processes=1, deadline_s=5.0, metrics_port=None)) as worker:
        channel = _channel(worker.endpoint)
        stub = reward_pb2_grpc_stub(channel)

        def check() -> None:
            # The score-shift repro's shape: right/wrong/right/wrong scored as such, each by its own id.
            replies = [r for b in stub.Score(iter([good]), timeout=30) for r in b.responses]
            assert {r.sample_id: r.reward for r in replies} == {"good/0": 1.0, "good/1": 0.0, "good/2": 1.0,
                                                                "good/3": 0.0}

        target = Target(channel, reward_pb2.DESCRIPTOR.services_by_name["Reward"],
                        good={"Score": [good], "ListVerifiers": [reward_pb2.ListVerifiersRequest()]})
        check()
        yield Service(target, check)
        channel.close()


def reward_pb2_grpc_stub(channel):
    from rlfabric.v1 import reward_pb2_grpc

    return reward_pb2_grpc.RewardStub(channel)


@pytest.fixture(scope="module")
def rollout_service(rollout_server, rollout_engine) -> Iterator[Service]:
    from harness import Target

    from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
    from services.common.tensors import to_proto

    server, _ = rollout_server
    channel = _channel(server.address)
    stub = rollout_pb2_grpc.RolloutStub(channel)
    group = common_pb2.PromptGroup(group_id="good", prompt_token_ids=to_proto(np.arange(5, 17, dtype=np.int32)), n=3)
    generate = rollout_pb2.GenerateRequest(group=group, sampling=common_pb2.SamplingParams(max_tokens=6))
    version = rollout_engine.weights_version

    def check() -> None:
        stub.Wake(rollout_pb2.WakeRequest(), timeout=60)  # a fuzzed Sleep may have put it to sleep
        samples = [r.sample for r in stub.Generate(iter([generate]), timeout=120)]
        assert sorted(x.sample_id for x in samples) == ["good/0", "good/1", "good/2"]
        assert all(not x.error and 0 < x.response_length <= 6 for x in samples)
        assert stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30).weights_version == version

    def affordable(request):
        # Valid but costly sizes are cut to a few tokens (sizes past the limits still reach the server and are
        # refused): the fuzzing is about the validation, not about generating thousands of tokens.
        if 4 < request.group.n <= 1024:
            request.group.n = 4
        if 8 < request.sampling.max_tokens <= 4096:
            request.sampling.max_tokens = 8
        return request

    target = Target(channel, rollout_pb2.DESCRIPTOR.services_by_name["Rollout"], fix={"Generate": affordable},
                    good={"Generate": [generate], "Info": [rollout_pb2.RolloutInfoRequest(include_parameters=True)],
                          "Sleep": [rollout_pb2.SleepRequest(level=1)], "Wake": [rollout_pb2.WakeRequest()]},
                    slow=frozenset({"Generate"}),
                    after={"Sleep": lambda: stub.Wake(rollout_pb2.WakeRequest(), timeout=60)})
    check()
    yield Service(target, check)
    stub.Wake(rollout_pb2.WakeRequest(), timeout=60)
    channel.close()


@pytest.fixture(scope="module")
def trainer_service(start_trainer, tiny_model_dir: Path, tmp_path_factory) -> Iterator[Service]:
    from harness import Target

    from rlfabric.v1 import trainer_pb2, trainer_pb2_grpc
    from services.common.sequences import Sequences
    from services.common.tensors import to_numpy

    group, address = start_trainer("--hf-dir", str(tiny_model_dir))
    channel = _channel(address)
    stub = trainer_pb2_grpc.TrainerStub(channel)
    rng = np.random.default_rng(0)
    seqs = Sequences.from_lists(["a", "b"], [rng.integers(5, 200, 6), rng.integers(5, 200, 4)],
                                [rng.integers(5, 200, 5), rng.integers(5, 200, 3)])
    log_probs = trainer_pb2.LogProbRequest(batch=seqs.to_proto(), temperature=1.0)
    sandbox = tmp_path_factory.mktemp("fuzz_checkpoints")

    def values() -> tuple[np.ndarray, int, int]:
        out = [to_numpy(r.log_probs) for r in stub.ComputeLogProbs(iter([log_probs]), timeout=120)]
        info = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30)
        return np.concatenate(out), info.weights_version, info.iteration

    before = values()

    def check() -> None:
        assert group.alive()
        stub.Onload(trainer_pb2.OnloadRequest(params=True, grads=True, optimizer=True), timeout=120)
        after = values()
        assert after[1:] == before[1:]  # no fuzzed Update, checkpoint load or push moved the weights
        np.testing.assert_allclose(after[0], before[0], rtol=1e-5, atol=1e-6)

    def confine_dir(request):
        request.dir = str(sandbox / "ckpt")  # the dir is fuzzed by the security suite (confinement)
        return request

    def nothing_to_load(request):
        # A fuzzed SaveCheckpoint writes real checkpoints (any iteration up to the bound); loading one back would
        # move the trainer's state legitimately. Loads go to an empty dir: what is fuzzed is their validation.
        request.dir = str(sandbox / "empty")
        return request

    def dead_target(request):
        del request.targets[:]
        request.targets.append("127.0.0.1:9")  # nothing listens there: the push fails fast
        return request

    target = Target(channel, trainer_pb2.DESCRIPTOR.services_by_name["Trainer"],
                    good={"ComputeLogProbs": [log_probs], "Info": [trainer_pb2.TrainerInfoRequest(include_parameters=True)],
                          "Offload": [trainer_pb2.OffloadRequest(grads=True)], "Onload": [trainer_pb2.OnloadRequest()]},
                    fix={"SaveCheckpoint": confine_dir, "LoadCheckpoint": nothing_to_load, "PushWeights": dead_target},
                    deadline_s=60.0)
    yield Service(target, check)
    channel.close()


@pytest.fixture(scope="module")
def coordinator_service(redis_url: str, repo_root: Path, tmp_path_factory) -> Iterator[Service]:
    from harness import Target

    from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
    from services.common.redis_store import RunJournal, connect
    from services.common.server import ServiceSpec, create_server
    from services.coordinator.app import build_driver
    from services.coordinator.server import SERVICE_NAME, CoordinatorServicer

    client = connect(redis_url)
    runs = tmp_path_factory.mktemp("fuzz_runs")
    journal = RunJournal(client, "fuzz-done")
    for i in (1, 2):
        journal.record_iteration(i, {"reward": i / 4}, weights_version=i + 1, phase="iteration_done")
    journal.write(phase="done")

    def factory(config_yaml: str, overrides: list[str], run_id: str):
        return build_driver(config_yaml, overrides, run_id, redis_client=client, configs_dir=repo_root / "configs",
                            runs_dir=runs, discovery_timeout_s=5)

    server = create_server([ServiceSpec(coordinator_pb2_grpc.add_CoordinatorServicer_to_server,
                                        CoordinatorServicer(client, factory), SERVICE_NAME)],
                           component="coordinator", metrics_port=None).start()
    channel = _channel(server.address)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)

    def check() -> None:
        status = stub.GetRun(coordinator_pb2.GetRunRequest(run_id="fuzz-done"), timeout=30)
        assert (status.phase, status.iteration) == (coordinator_pb2.RUN_PHASE_DONE, 2)
        rows = [(m.iteration, dict(m.metrics.values)) for m in
                stub.StreamMetrics(coordinator_pb2.StreamMetricsRequest(run_id="fuzz-done", from_iteration=1),
                                   timeout=30)]
        assert rows == [(1, {"reward": 0.25}), (2, {"reward": 0.5})]

    target = Target(channel, coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
                    good={"GetRun": [coordinator_pb2.GetRunRequest(run_id="fuzz-done")],
                          "StreamMetrics": [coordinator_pb2.StreamMetricsRequest(run_id="fuzz-done")],
                          "StopRun": [coordinator_pb2.StopRunRequest(run_id="fuzz-done")],
                          "StartRun": [coordinator_pb2.StartRunRequest(run_id="fuzz-new", config_yaml="a: 1")]})
    check()
    yield Service(target, check)
    channel.close()
    server.stop(0)
