"""The pipelined mode's version fence and behaviour log-probs (services/coordinator/off_policy.py)."""

from __future__ import annotations

import numpy as np
import pytest

from rlfabric.v1 import common_pb2, reward_pb2
from services.common.tensors import to_proto
from services.coordinator.errors import IterationError
from services.coordinator.generation import Group, GroupPrompt
from services.coordinator.off_policy import behavior_log_probs, fence, rollout_mismatch


def _group(versions: list[int], lengths: list[int] | None = None) -> Group:
    lengths = lengths or [2] * len(versions)
    samples = [common_pb2.Sample(sample_id=f"g/{i}", group_id="g", index=i, weights_version=v, response_length=n,
                                 response_token_ids=to_proto(np.arange(n, dtype=np.int32)),
                                 response_log_probs=to_proto(np.full(n, -0.5 * (i + 1), np.float32)))
               for i, (v, n) in enumerate(zip(versions, lengths, strict=True))]
    return Group(GroupPrompt("g", np.array([1], np.int32), ""), samples,
                 [reward_pb2.ScoreResponse() for _ in samples])


def test_fence_reports_the_lag_of_the_trainable_samples() -> None:
    # actor at 7; samples at 6, 7, 6 and one empty response (not trainable) at 3: lags 1, 0, 1.
    metrics = fence([_group([6, 7, 6, 3], [2, 2, 2, 0])], actor_version=7, bound=1)
    # two tokens each: token lags 1, 1, 0, 0, 1, 1
    assert metrics == {"staleness/mean": pytest.approx(2 / 3), "staleness/max": 1.0,
                       "staleness/token_mean": pytest.approx(4 / 6)}


def test_fence_reads_each_tokens_version_of_a_continued_response() -> None:
    """Partial rollout: a response's first tokens at version 4, its last at 6 (its weights_version is the oldest)."""
    group = _group([4], [5])
    group.samples[0].response_token_versions.CopyFrom(to_proto(np.array([4, 4, 4, 6, 6], np.int64)))
    metrics = fence([group], actor_version=7, bound=3)
    assert metrics == {"staleness/mean": 3.0, "staleness/max": 3.0, "staleness/token_mean": pytest.approx(11 / 5)}
    with pytest.raises(IterationError, match="allow 0..2"):
        fence([group], actor_version=7, bound=2)


@pytest.mark.parametrize(("versions", "bound"), [([5, 7], 1), ([7, 8], 1), ([6], 0)])
def test_fence_refuses_samples_outside_the_bound(versions: list[int], bound: int) -> None:
    with pytest.raises(IterationError, match=f"allow 0..{bound}"):
        fence([_group(versions)], actor_version=7, bound=bound)


def test_behaviour_log_probs_are_the_rollouts_per_sample() -> None:
    out = behavior_log_probs([_group([1, 1], [3, 1])])
    assert out["g/0"].tolist() == [-0.5, -0.5, -0.5] and out["g/1"].tolist() == [-1.0]


def test_a_sample_without_its_log_probs_is_refused() -> None:
    g = _group([1])
    g.samples[0].response_log_probs.CopyFrom(to_proto(np.zeros(1, np.float32)))
    with pytest.raises(IterationError, match="log-prob of every sampled token"):
        behavior_log_probs([g])


# --- when the pipelined step pushes (GrpoIteration.run_overlapped) ------------------------------------------


class _Order:
    """A GrpoIteration whose phases record when they run: the update (`_train`), the push (`after_update`)."""

    def __init__(self) -> None:
        import threading

        from services.coordinator.iteration import GrpoIteration

        self.events: list[str] = []
        self.pushed = threading.Event()
        loop = GrpoIteration.__new__(GrpoIteration)
        loop._train = lambda rollout, iteration, version: self.events.append("update") or "parts"
        loop.update_running = threading.Event()
        loop._finish = lambda rollout, parts, version, t0, t1, also_busy=None: ("result", parts)
        loop.placement = self
        self.loop = loop

    def after_update(self, clock, version: int) -> None:
        self.events.append(f"push {version}")
        self.pushed.set()


def _rollout(label: str):
    from services.coordinator.iteration import Rollout

    return Rollout(gen=label, clock=None, start=0.0, weights_version=0, ref_stream=None)


def test_pipelined_step_pushes_once_generated_while_the_next_scoring_goes_on() -> None:
    order = _Order()

    def prefetch(on_generated):
        order.events.append("generated")
        on_generated()
        # Scoring and the reference pass of the next iteration: the push must not wait for them.
        assert order.pushed.wait(10), "the push waited for the next iteration's scores"
        order.events.append("scored")
        return [_rollout("next")]

    result, following = order.loop.run_overlapped(_rollout("this"), 3, 5, prefetch)
    assert result == ("result", "parts") and [r.gen for r in following] == ["next"]
    assert order.events.index("push 6") < order.events.index("scored")
    assert {"update", "generated"} <= set(order.events[:order.events.index("push 6")])


@pytest.mark.parametrize("fails_after_generation", [False, True], ids=["during-generation", "during-scoring"])
def test_pipelined_step_with_a_failed_prefetch_fails(fails_after_generation: bool) -> None:
    order = _Order()

    def prefetch(on_generated):
        if fails_after_generation:
            on_generated()
        raise IterationError("reward: no score for 1 samples")

    with pytest.raises(IterationError, match="no score"):
        order.loop.run_overlapped(_rollout("this"), 3, 5, prefetch)
    # A rollout that failed before its last sample never sees new weights pushed for it.
    assert ("push 6" in order.events) == fails_after_generation


def test_rollout_mismatch_compares_the_samples_made_at_the_trainers_weights() -> None:
    # g/0 and g/1 at version 7 (the trainer's), g/2 one version behind: left out (an update, not the engines).
    groups = [_group([7, 7, 6], [2, 1, 2])]  # rollout log-probs: -0.5, -1.0, -1.5 per token
    trainer = {"g/0": np.array([-0.5, -0.7], np.float32), "g/1": np.array([-1.2], np.float32),
               "g/2": np.array([0.0, 0.0], np.float32)}
    d = np.array([0.0, -0.2, -0.2])
    metrics = rollout_mismatch(groups, trainer, actor_version=7)
    assert metrics["rollout_mismatch/mean_abs_logp_diff"] == pytest.approx(np.abs(d).mean(), rel=1e-6)
    assert metrics["rollout_mismatch/max_ratio"] == pytest.approx(1.0, rel=1e-6)  # the largest exp(d): d = 0
    assert metrics["rollout_mismatch/kl"] == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-6)
    assert metrics["rollout_mismatch/kl"] > 0
    same = {k: v.copy() for k, v in trainer.items()}
    same["g/0"][:] = -0.5
    same["g/1"][:] = -1.0
    assert rollout_mismatch(groups, same, 7) == {"rollout_mismatch/mean_abs_logp_diff": 0.0,
                                                 "rollout_mismatch/max_ratio": 1.0, "rollout_mismatch/kl": 0.0}
    assert rollout_mismatch(groups, {}, 7) == {}  # no old-log-prob pass: nothing to compare



class _SlowUpdateLoop:
    """A GrpoIteration for _Stepper: its rollouts record (iteration, version) and take `rollout_s`, its update
    `update_s`."""

    def __init__(self, update_s: float, rollout_s: float) -> None:
        import threading
        import time

        from services.coordinator.iteration import GrpoIteration, Rollout

        self.generated: list[tuple[int, int]] = []
        loop = GrpoIteration.__new__(GrpoIteration)
        loop.partial = None
        loop.update_running = threading.Event()
        loop._train = lambda rollout, iteration, version: time.sleep(update_s) or "parts"
        loop._finish = lambda rollout, parts, version, t0, t1, also_busy=(): ("result", rollout.gen)
        loop.placement = self

        def rollout(next_batch, iteration, version, data_batches=0, on_generated=None):
            batch = next_batch()
            time.sleep(rollout_s)
            self.generated.append((iteration, version))
            if on_generated is not None:
                on_generated()
            return Rollout(gen=_Gen([batch]), clock=None, start=0.0, weights_version=version, ref_stream=None)

        loop.rollout = rollout
        self.loop = loop

    def after_update(self, clock, version: int) -> None:
        pass


class _Gen:
    def __init__(self, batches: list) -> None:
        self.batches = batches


class _Loader:
    batches_per_epoch = 100

    def __init__(self) -> None:
        self.consumed_batches = 0

    def next_batch(self) -> int:
        self.consumed_batches += 1
        return self.consumed_batches - 1


@pytest.mark.parametrize(("update_s", "rollout_s", "depth", "ahead_after"),
                         [(0.0, 0.2, 2, [2]), (0.6, 0.0, 2, [2, 3]), (0.6, 0.0, 1, [2])],
                         ids=["fast-update", "slow-update", "depth-1"])
def test_a_pipeline_of_depth_n_generates_ahead_only_beside_the_update(update_s: float, rollout_s: float, depth: int,
                                                                      ahead_after: list[int]) -> None:
    """max_staleness N: the next iteration's rollout is always generated; each further one (up to N ahead) only
    while the update still runs; all of one step at the replicas' weights; the cursor leaves out what is ahead."""
    import threading

    from services.coordinator.run import _Stepper

    fake, loader = _SlowUpdateLoop(update_s, rollout_s), _Loader()
    step = _Stepper(fake.loop, loader, lambda loader, m: loader.next_batch, 10, threading.Event(), depth)
    result, cursor = step(1, 5)
    assert result[0] == "result"
    assert [m for m, _ in fake.generated] == [1, *ahead_after]
    assert {v for _, v in fake.generated} == {5}
    assert [r.weights_version for r in step.ahead] == [5] * len(ahead_after)
    assert cursor == 1  # batch 0 trained; the batches of the rollouts ahead are not consumed yet
    # The next step trains iteration 2's rollout (one version old) and tops the pipeline up at version 6.
    step(2, 6)
    assert fake.generated[0] == (1, 5) and fake.generated[len(ahead_after) + 1][1] == 6
    assert max(m for m, _ in fake.generated) <= 2 + depth
