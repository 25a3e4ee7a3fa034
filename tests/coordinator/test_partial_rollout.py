"""Partial rollout (services/coordinator/partial_rollout.py): stitched samples and their per-token versions, the cut
test, continuation requests, the pool's bookkeeping, and rounds / iterations against a fake generator whose
responses have a fixed natural length each."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from rlfabric.v1 import common_pb2, reward_pb2, rollout_pb2
from services.common.tensors import to_numpy, to_proto
from services.coordinator.generation import Generator, GroupPrompt
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.partial_rollout import (
    CONTINUATION_MARK,
    Cut,
    PartialRollouts,
    batch_of,
    chunk_tokens,
    continuation,
    generate_round,
    is_cut,
    partial_rollout,
    prompt_key,
    stitched,
)
from services.coordinator.settings import IterationSettings

STOP, LENGTH, ERROR = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH,
                       common_pb2.FINISH_REASON_ERROR)


def _sample(sample_id: str, tokens: Sequence[int], version: int, *, finish: int = STOP,
            log_probs: Sequence[float] | None = None, prompt_length: int = 3, error: str = "",
            latency_s: float = 0.0) -> common_pb2.Sample:
    group_id, index = sample_id.rsplit("/", 1)
    ids = np.asarray(tokens, np.int32)
    lps = np.asarray(log_probs if log_probs is not None else [-0.5 * (j + 1) for j in range(len(ids))], np.float32)
    return common_pb2.Sample(sample_id=sample_id, group_id=group_id, index=int(index), response_token_ids=to_proto(ids),
                             response_log_probs=to_proto(lps), weights_version=version, finish_reason=finish,
                             prompt_length=prompt_length, response_length=len(ids), error=error, latency_s=latency_s)


def _prompt(group_id: str, tokens: Sequence[int] = (1, 2, 3), answer: str = "42") -> GroupPrompt:
    return GroupPrompt(group_id, np.asarray(tokens, np.int32), answer)


def _score(sample_id: str, reward: float = 1.0) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(sample_id=sample_id, reward=reward)


def _cut_of_three() -> Cut:
    """g/1 cut after 3 tokens generated at version 5 (one chunk so far)."""
    first = _sample("g/1", [10, 11, 12], 5, finish=LENGTH, log_probs=[-0.125, -0.25, -0.375], latency_s=0.5)
    first.routed_experts.CopyFrom(to_proto(np.zeros((5, 2, 1), np.int32)))
    return Cut(_prompt("g"), 1, np.array([10, 11, 12], np.int32), np.array([-0.125, -0.25, -0.375], np.float32),
               np.array([5, 5, 5], np.int64), 1, first)


def _versions(sample: common_pb2.Sample) -> list[int]:
    return to_numpy(sample.response_token_versions).tolist()


# -- stitched ---------------------------------------------------------------------------------------------------


def test_stitched_fresh_response_keeps_the_part_and_tags_every_token_with_its_version() -> None:
    part = _sample("g/0", [7, 8, 9], 4, finish=LENGTH, log_probs=[-0.25, -0.5, -0.75], latency_s=0.5)
    out = stitched(None, part)
    assert (out.sample_id, out.group_id, out.index) == ("g/0", "g", 0)
    assert to_numpy(out.response_token_ids).tolist() == [7, 8, 9]
    assert to_numpy(out.response_log_probs).tolist() == [-0.25, -0.5, -0.75]
    assert out.response_token_versions.dtype == common_pb2.DTYPE_INT64
    assert _versions(out) == [4, 4, 4]
    assert out.response_length == 3 and out.weights_version == 4
    assert out.finish_reason == LENGTH and out.prompt_length == 3 and out.latency_s == 0.5
    assert not part.HasField("response_token_versions")  # the replica's sample is left as it came


def test_stitched_fresh_empty_failed_response_has_no_versions() -> None:
    part = common_pb2.Sample(sample_id="g/0", group_id="g", index=0, weights_version=4, finish_reason=ERROR,
                             error="prompt too long")
    out = stitched(None, part)
    assert out.response_length == 0 and _versions(out) == [] and to_numpy(out.response_token_ids).tolist() == []
    assert out.error == "prompt too long" and out.finish_reason == ERROR


def test_stitched_continuation_concatenates_in_order_and_keeps_the_oldest_version() -> None:
    cut = _cut_of_three()
    # the continuation as the replica returns it: its own group and sample ids, the context as its prompt
    part = _sample("g/1@1/0", [13, 14], 7, finish=STOP, log_probs=[-0.5, -0.625], prompt_length=6, latency_s=0.25)
    out = stitched(cut, part)
    assert to_numpy(out.response_token_ids).tolist() == [10, 11, 12, 13, 14]
    assert to_numpy(out.response_log_probs).tolist() == [-0.125, -0.25, -0.375, -0.5, -0.625]
    assert _versions(out) == [5, 5, 5, 7, 7]
    assert out.response_length == 5
    assert out.weights_version == 5
    assert (out.sample_id, out.group_id, out.index, out.prompt_length) == ("g/1", "g", 1, 3)
    assert out.finish_reason == STOP and out.error == ""
    assert out.latency_s == pytest.approx(0.75)
    assert not out.HasField("routed_experts")
    assert cut.first.HasField("routed_experts")  # the cut itself is untouched


def test_stitched_continuation_takes_finish_and_error_from_the_failed_part() -> None:
    cut = _cut_of_three()
    # a failed chunk: two tokens but no log-probs for them (nothing of it trains)
    part = _sample("g/1@1/0", [13, 14], 7, finish=ERROR, log_probs=[], error="engine died")
    out = stitched(cut, part)
    assert out.finish_reason == ERROR and out.error == "engine died"
    assert to_numpy(out.response_log_probs).tolist() == [-0.125, -0.25, -0.375, 0.0, 0.0]
    assert _versions(out) == [5, 5, 5, 7, 7] and out.weights_version == 5
    empty = stitched(cut, common_pb2.Sample(sample_id="g/1@1/0", group_id="g/1@1", weights_version=7,
                                            finish_reason=ERROR, error="context too long"))
    assert to_numpy(empty.response_token_ids).tolist() == [10, 11, 12] and _versions(empty) == [5, 5, 5]
    assert empty.response_length == 3 and empty.weights_version == 5 and empty.error == "context too long"


# -- is_cut -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("finish", "length", "error", "expected"), [
    (LENGTH, 4, "", True),  # a chunk's end with room left
    (LENGTH, 7, "", True),
    (LENGTH, 8, "", False),  # the whole budget
    (STOP, 4, "", False),
    (STOP, 8, "", False),
    (LENGTH, 4, "replica refused", False),
    (ERROR, 4, "replica refused", False),
])
def test_is_cut(finish: int, length: int, error: str, expected: bool) -> None:
    sample = _sample("g/0", list(range(length)), 1, finish=finish, error=error)
    assert is_cut(sample, budget=8) is expected


# -- continuation -----------------------------------------------------------------------------------------------


def _sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=12, temperature=0.7, has_temperature=True, top_p=0.9, top_k=20,
                                     min_p=0.05, logprobs=1, seed=11, has_seed=True)


@pytest.mark.parametrize(("budget", "max_tokens"), [(12, 4), (9, 4), (8, 4), (6, 2), (5, 1)])
def test_continuation_request(budget: int, max_tokens: int) -> None:
    first = _sample("g/1", [10, 11, 12, 13], 5, finish=LENGTH)
    cut = Cut(_prompt("g", [1, 2, 3]), 1, np.array([10, 11, 12, 13], np.int32), np.zeros(4, np.float32),
              np.array([3, 3, 5, 5], np.int64), 2, first)
    sampling = _sampling()
    request = continuation(cut, sampling, budget, version=9, chunk=4)
    assert isinstance(request, rollout_pb2.GenerateRequest)
    assert request.group.group_id == f"g/1{CONTINUATION_MARK}2" == "g/1@2"
    assert request.group.n == 1
    context = to_numpy(request.group.prompt_token_ids)
    assert context.dtype == np.int32 and context.tolist() == [1, 2, 3, 10, 11, 12, 13]
    assert request.expected_weights_version == 9
    assert request.sampling.max_tokens == max_tokens
    expected = common_pb2.SamplingParams()
    expected.CopyFrom(sampling)
    expected.max_tokens = max_tokens
    assert request.sampling == expected  # every other sampling field as the run's
    assert sampling.max_tokens == 12  # the run's sampling params are left alone


def test_chunk_tokens() -> None:
    assert chunk_tokens(_Settings(max_tokens=8, partial_rollout_max_split=2)) == 4
    assert chunk_tokens(_Settings(max_tokens=9, partial_rollout_max_split=3)) == 3


# -- the pool ---------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Batch:
    """A prompt batch as the loader hands it (compared by identity, as the pool does)."""

    name: str


def _finish(pool: PartialRollouts, sample_id: str, version: int, length: int = 2, reward: float = 1.0) -> None:
    pool.finish(_sample(sample_id, list(range(length)), version), _score(sample_id, reward))


def test_pool_bookkeeping() -> None:
    pool = PartialRollouts(n=2, global_batch_size=2)
    assert pool.capacity == 4 and pool.size() == 0 and pool.has_room_for_batch()
    assert not pool.has_pending() and pool.num_complete() == 0 and pool.batches_in_flight() == []
    a, b = _Batch("a"), _Batch("b")
    prompts_a, prompts_b = [_prompt("g0"), _prompt("g1")], [_prompt("g2"), _prompt("g3")]
    pool.admit(prompts_a, a)
    assert pool.size() == 2 and pool.has_room_for_batch()
    pool.admit(prompts_b, b)
    assert pool.size() == 4 and not pool.has_room_for_batch()
    assert [p.group_id for p in pool.fresh()] == ["g0", "g1", "g2", "g3"]
    assert pool.has_pending() and pool.cuts() == []
    assert pool.batches_in_flight() == [a, b]

    pool.mark_sent(prompts_a)
    assert [p.group_id for p in pool.fresh()] == ["g2", "g3"] and pool.has_pending()
    pool.mark_sent(prompts_b)
    assert pool.fresh() == [] and not pool.has_pending()  # sent, nothing cut: no further round for them

    _finish(pool, "g1/1", 3)
    _finish(pool, "g1/0", 3)
    assert pool.num_complete() == 1
    cut = Cut(prompts_a[0], 1, np.array([5, 6], np.int32), np.zeros(2, np.float32), np.array([3, 3], np.int64), 1,
              _sample("g0/1", [5, 6], 3, finish=LENGTH))
    pool.cut(cut)
    assert pool.cuts() == [cut] and pool.has_pending()
    _finish(pool, "g0/0", 3)
    assert pool.num_complete() == 1  # g0 waits on its cut sample
    _finish(pool, "g0/1", 4, length=5)
    assert pool.cuts() == [] and not pool.has_pending() and pool.num_complete() == 2
    assert pool.size() == 4 and pool.batches_in_flight() == [a, b]


def test_take_oldest_complete_first_in_index_order_with_scores() -> None:
    pool = PartialRollouts(n=2, global_batch_size=2)
    a, b = _Batch("a"), _Batch("b")
    pool.admit([_prompt("g0"), _prompt("g1")], a)
    pool.admit([_prompt("g2"), _prompt("g3")], b)
    pool.mark_sent(pool.fresh())
    # completed in the order g2, g1, g0 (each group's samples out of index order), g3 incomplete
    for sid, reward in [("g2/1", 0.25), ("g2/0", 0.5), ("g1/1", 0.75), ("g1/0", 1.0), ("g0/1", 1.25),
                        ("g0/0", 1.5), ("g3/1", 1.75)]:
        _finish(pool, sid, 3, reward=reward)
    assert pool.num_complete() == 3

    taken = pool.take(2, actor_version=3, bound=0)
    assert [g.group_id for g in taken.groups] == ["g0", "g1"]  # admission order, not completion order
    assert [[x.sample_id for x in g.samples] for g in taken.groups] == [["g0/0", "g0/1"], ["g1/0", "g1/1"]]
    assert [[s.sample_id for s in g.scores] for g in taken.groups] == [["g0/0", "g0/1"], ["g1/0", "g1/1"]]
    assert [[s.reward for s in g.scores] for g in taken.groups] == [[1.5, 1.25], [1.0, 0.75]]
    assert taken.batches == [a]  # both from batch a: named once
    assert taken.stale_dropped == 0
    assert pool.size() == 2 and pool.num_complete() == 1 and pool.batches_in_flight() == [b]
    assert pool.has_room_for_batch()

    rest = pool.take(2, actor_version=3, bound=0)  # only g2 is complete: fewer than k
    assert [g.group_id for g in rest.groups] == ["g2"] and rest.batches == [b] and rest.stale_dropped == 0
    assert pool.size() == 1 and pool.num_complete() == 0 and pool.batches_in_flight() == [b]
    assert pool.take(2, actor_version=3, bound=0).groups == []


def test_take_drops_groups_past_the_version_fence() -> None:
    pool = PartialRollouts(n=2, global_batch_size=2)
    a, b, c = _Batch("a"), _Batch("b"), _Batch("c")
    pool.admit([_prompt("g0"), _prompt("g1")], a)
    pool.admit([_prompt("g2"), _prompt("g3")], b)
    pool.admit([_prompt("g4")], c)
    pool.mark_sent(pool.fresh())
    _finish(pool, "g0/0", 7)
    _finish(pool, "g0/1", 4)  # 3 behind actor 7, bound 2: g0 is dropped
    _finish(pool, "g1/0", 5)  # exactly 2 behind: kept
    _finish(pool, "g1/1", 7)
    _finish(pool, "g2/0", 7)
    pool.finish(common_pb2.Sample(sample_id="g2/1", group_id="g2", index=1, weights_version=0, finish_reason=ERROR,
                                  error="prompt too long"), _score("g2/1"))  # no tokens: its version is no lag
    _finish(pool, "g3/0", 1)
    _finish(pool, "g3/1", 1)
    _finish(pool, "g4/0", 7)
    _finish(pool, "g4/1", 7)

    taken = pool.take(2, actor_version=7, bound=2)
    assert [g.group_id for g in taken.groups] == ["g1", "g2"]  # k counts trained groups only
    assert taken.stale_dropped == 1
    assert taken.batches == [a, b]
    assert pool.size() == 2  # g0 left the pool; g3 (stale too) and g4 were not reached
    later = pool.take(2, actor_version=7, bound=2)
    assert [g.group_id for g in later.groups] == ["g4"] and later.stale_dropped == 1 and later.batches == [c]
    assert pool.size() == 0 and pool.batches_in_flight() == []


# -- rounds against a fake generator ----------------------------------------------------------------------------


@dataclass
class _Settings:
    """The generator settings partial rollout reads (IterationSettings' names; its response_budget)."""

    max_tokens: int = 8
    partial_rollout_max_split: int = 2
    n_samples_per_prompt: int = 2
    max_model_len: int | None = None
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 20
    min_p: float = 0.0
    seed: int | None = 11
    async_engine: bool = False
    require_max_age_all_finished: bool = True

    response_budget = IterationSettings.response_budget


def _token_ids(sample_id: str, start: int, end: int) -> list[int]:
    """Positions start..end of a fake response: 1000 x group number + 100 x index + position."""
    group, index = sample_id.rsplit("/", 1)
    return [1000 * int(group.removeprefix("g")) + 100 * int(index) + j for j in range(start, end)]


def _log_probs(start: int, end: int) -> list[float]:
    return [-(j + 1) / 64 for j in range(start, end)]


class _FakeGenerator:
    """Generator's duck type for partial rollout. Each response has a natural length (`lengths`, by sample id): the
    engine stops there (STOP) or at the request's max_tokens (LENGTH), whichever comes first; tokens and log-probs
    are a function of the position, so a continuation's context is checked against the tokens so far. The reward is
    the number of response tokens scored."""

    sampling_params = Generator.sampling_params
    group_requests = Generator.group_requests
    score_request = Generator.score_request

    def __init__(self, settings: _Settings, lengths: dict[str, int]) -> None:
        self.settings = settings
        self.lengths = lengths
        self.prompts: dict[str, GroupPrompt] = {}
        self._verifiers: list[reward_pb2.VerifierSpec] = []
        self.calls: list[list[rollout_pb2.GenerateRequest]] = []
        self.scored: list[str] = []

    def know(self, prompts: Sequence[GroupPrompt]) -> None:
        self.prompts.update({p.group_id: p for p in prompts})

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)

    def samples_of(self, requests: list[rollout_pb2.GenerateRequest], clock: PhaseClock,
                   interrupt_when=None) -> Iterator[common_pb2.Sample]:
        """Request order; with `interrupt_when`, the engine decodes every response in lockstep (a response ends at
        the step of its length), and once `interrupt_when()` holds after a response ended at step t, the others
        come back INTERRUPTED with their first t tokens."""
        self.calls.append(list(requests))
        items = []
        for q in requests:
            gid, context = q.group.group_id, to_numpy(q.group.prompt_token_ids).tolist()
            for i in range(q.group.n):
                sid = gid.split(CONTINUATION_MARK)[0] if CONTINUATION_MARK in gid else f"{gid}/{i}"
                prompt = self.prompts[sid.rsplit("/", 1)[0]].prompt.tolist()
                so_far = len(context) - len(prompt)
                assert context == prompt + _token_ids(sid, 0, so_far), f"{gid}: wrong context"
                items.append((gid, i, sid, q, context, so_far, min(self.lengths[sid], so_far + q.sampling.max_tokens)))

        def sample(item, end: int, reason: int) -> common_pb2.Sample:
            gid, i, sid, q, context, so_far, _ = item
            return common_pb2.Sample(
                sample_id=f"{gid}/{i}", group_id=gid, index=i, weights_version=q.expected_weights_version,
                response_token_ids=to_proto(np.array(_token_ids(sid, so_far, end), np.int32)),
                response_log_probs=to_proto(np.array(_log_probs(so_far, end), np.float32)),
                finish_reason=reason, prompt_length=len(context), response_length=end - so_far, latency_s=0.25)

        def ended(item) -> common_pb2.Sample:
            return sample(item, item[6], STOP if item[6] == self.lengths[item[2]] else LENGTH)

        if interrupt_when is None:
            yield from (ended(item) for item in items)
            return
        order = sorted(items, key=lambda item: item[6] - item[5])
        for k, item in enumerate(order):
            yield ended(item)
            if interrupt_when():
                step = item[6] - item[5]
                for rest in order[k + 1:]:
                    yield ended(rest) if rest[6] - rest[5] == step else \
                        sample(rest, rest[5] + step, common_pb2.FINISH_REASON_INTERRUPTED)
                return

    def score(self, requests: Iterator[reward_pb2.ScoreRequest]) -> Iterator[reward_pb2.ScoreResponse]:
        for r in requests:
            self.scored.append(r.sample_id)
            yield reward_pb2.ScoreResponse(sample_id=r.sample_id, reward=float(len(r.response.split())))


def _admitted(pool: PartialRollouts, gen: _FakeGenerator, prompts: list[GroupPrompt], name: str) -> _Batch:
    batch = _Batch(name)
    gen.know(prompts)
    pool.admit(prompts, batch)
    return batch


def _by_id(groups) -> dict[str, common_pb2.Sample]:
    return {x.sample_id: x for g in groups for x in g.samples}


def test_generate_round_cuts_long_responses_and_continues_them_at_the_newer_version() -> None:
    s = _Settings()  # max_tokens 8, split 2: chunks of 4
    gen = _FakeGenerator(s, {"g0/0": 3, "g0/1": 4, "g1/0": 6, "g1/1": 10})
    pool = PartialRollouts(n=2, global_batch_size=2)
    batch = _admitted(pool, gen, [_prompt("g0", [1, 2, 3]), _prompt("g1", [4, 5])], "a")
    clock = PhaseClock()

    assert generate_round(gen, pool, 3, clock) == {"continued": 0, "cut": 2}
    (requests,) = gen.calls
    assert [(q.group.group_id, q.group.n, q.sampling.max_tokens, q.expected_weights_version) for q in requests] == \
        [("g0", 2, 4, 3), ("g1", 2, 4, 3)]
    assert requests[0].sampling.temperature == pytest.approx(0.7) and requests[0].sampling.seed == 11
    assert sorted(gen.scored) == ["g0/0", "g0/1"]  # the ended ones (STOP, even at the chunk's end), scored
    assert pool.num_complete() == 1 and pool.fresh() == [] and pool.has_pending()
    cuts = sorted(pool.cuts(), key=lambda c: c.index)
    assert [(c.sample_id, c.index, c.splits) for c in cuts] == [("g1/0", 0, 1), ("g1/1", 1, 1)]
    assert cuts[1].tokens.tolist() == _token_ids("g1/1", 0, 4)
    assert cuts[1].log_probs.tolist() == _log_probs(0, 4)
    assert cuts[1].versions.tolist() == [3] * 4
    assert cuts[1].prompt.group_id == "g1" and cuts[1].first.sample_id == "g1/1"

    assert generate_round(gen, pool, 4, clock) == {"continued": 2, "cut": 0}
    second = sorted(gen.calls[1], key=lambda q: q.group.group_id)
    assert [(q.group.group_id, q.group.n, q.sampling.max_tokens, q.expected_weights_version) for q in second] == \
        [("g1/0@1", 1, 4, 4), ("g1/1@1", 1, 4, 4)]
    assert to_numpy(second[1].group.prompt_token_ids).tolist() == [4, 5] + _token_ids("g1/1", 0, 4)
    assert sorted(gen.scored) == ["g0/0", "g0/1", "g1/0", "g1/1"]  # each once, by its own sample id
    assert pool.num_complete() == 2 and not pool.has_pending() and pool.cuts() == []
    assert clock.spans["rule_reward"]  # the reward stream was timed

    taken = pool.take(2, actor_version=4, bound=1)
    assert [g.group_id for g in taken.groups] == ["g0", "g1"] and taken.batches == [batch]
    out = _by_id(taken.groups)
    assert [(out[i].response_length, out[i].finish_reason, out[i].weights_version) for i in sorted(out)] == \
        [(3, STOP, 3), (4, STOP, 3), (6, STOP, 3), (8, LENGTH, 3)]
    assert _versions(out["g0/0"]) == [3] * 3 and _versions(out["g0/1"]) == [3] * 4
    assert _versions(out["g1/0"]) == [3] * 4 + [4] * 2
    assert _versions(out["g1/1"]) == [3] * 4 + [4] * 4  # its whole budget: ends LENGTH, not cut again
    g1 = out["g1/1"]
    assert to_numpy(g1.response_token_ids).tolist() == _token_ids("g1/1", 0, 8)
    assert to_numpy(g1.response_log_probs).tolist() == _log_probs(0, 8)
    assert (g1.sample_id, g1.group_id, g1.index, g1.prompt_length) == ("g1/1", "g1", 1, 2)
    assert g1.latency_s == pytest.approx(0.5)
    scores = {sc.sample_id: sc.reward for g in taken.groups for sc in g.scores}
    assert scores == {"g0/0": 3.0, "g0/1": 4.0, "g1/0": 6.0, "g1/1": 8.0}  # the whole stitched response scored


def test_generate_round_continuations_respect_max_model_len() -> None:
    s = _Settings(max_model_len=8, n_samples_per_prompt=1)  # prompt of 3: a budget of 5, chunks of 4
    gen = _FakeGenerator(s, {"g0/0": 20})
    pool = PartialRollouts(n=1, global_batch_size=1)
    _admitted(pool, gen, [_prompt("g0", [1, 2, 3])], "a")
    assert generate_round(gen, pool, 1, PhaseClock()) == {"continued": 0, "cut": 1}
    assert gen.calls[0][0].sampling.max_tokens == 4
    assert generate_round(gen, pool, 2, PhaseClock()) == {"continued": 1, "cut": 0}
    assert gen.calls[1][0].sampling.max_tokens == 1  # what max_model_len leaves
    (group,) = pool.take(1, actor_version=2, bound=1).groups
    assert group.samples[0].response_length == 5 and group.samples[0].finish_reason == LENGTH
    assert _versions(group.samples[0]) == [1, 1, 1, 1, 2]


def test_generate_round_three_chunks_carry_three_versions() -> None:
    s = _Settings(max_tokens=9, partial_rollout_max_split=3, n_samples_per_prompt=1)  # chunks of 3
    gen = _FakeGenerator(s, {"g0/0": 8})
    pool = PartialRollouts(n=1, global_batch_size=1)
    _admitted(pool, gen, [_prompt("g0", [1, 2])], "a")
    assert generate_round(gen, pool, 1, PhaseClock()) == {"continued": 0, "cut": 1}
    assert generate_round(gen, pool, 2, PhaseClock()) == {"continued": 1, "cut": 1}
    (cut,) = pool.cuts()
    assert cut.splits == 2 and cut.versions.tolist() == [1, 1, 1, 2, 2, 2]
    assert generate_round(gen, pool, 3, PhaseClock()) == {"continued": 1, "cut": 0}
    assert [q.group.group_id for call in gen.calls for q in call] == ["g0", "g0/0@1", "g0/0@2"]
    assert [q.sampling.max_tokens for call in gen.calls for q in call] == [3, 3, 3]
    (group,) = pool.take(1, actor_version=3, bound=2).groups
    x = group.samples[0]
    assert _versions(x) == [1, 1, 1, 2, 2, 2, 3, 3] and x.weights_version == 1 and x.finish_reason == STOP
    assert to_numpy(x.response_token_ids).tolist() == _token_ids("g0/0", 0, 8)
    assert x.latency_s == pytest.approx(0.75) and x.sample_id == "g0/0" and x.prompt_length == 2
    assert group.scores[0].reward == 8.0


class _Loader:
    """admit_batch for partial_rollout: the next of `batches` into the pool, counting the calls."""

    def __init__(self, pool: PartialRollouts, gen: _FakeGenerator, batches: list[list[GroupPrompt]]) -> None:
        self.pool, self.gen, self.pending = pool, gen, list(batches)
        self.admitted: list[_Batch] = []

    def __call__(self) -> None:
        prompts = self.pending.pop(0)
        self.admitted.append(_admitted(self.pool, self.gen, prompts, f"b{len(self.admitted)}"))


def test_partial_rollout_across_iterations() -> None:
    lengths = {"g0/0": 3, "g0/1": 2, "g1/0": 3, "g1/1": 7, "g2/0": 10, "g2/1": 6, "g3/0": 1, "g3/1": 2,
               "g4/0": 2, "g4/1": 2, "g5/0": 8, "g5/1": 5, "g6/0": 1, "g6/1": 1, "g7/0": 2, "g7/1": 3}
    gen = _FakeGenerator(_Settings(), lengths)  # max_tokens 8, split 2, n 2
    pool = PartialRollouts(n=2, global_batch_size=2)
    loader = _Loader(pool, gen, [[_prompt(f"g{2 * b}"), _prompt(f"g{2 * b + 1}")] for b in range(4)])

    # Iteration 1 at version 3: the pool fills with two batches; one round leaves g0 and g3 complete, 3 responses cut.
    taken, metrics = partial_rollout(gen, pool, loader, 3, PhaseClock(), actor_version=3, bound=1)
    b0, b1 = loader.admitted
    assert len(loader.admitted) == 2 and len(gen.calls) == 1
    assert [g.group_id for g in taken.groups] == ["g0", "g3"] and taken.batches == [b0, b1]
    assert metrics == {"partial_rollout/rounds": 1.0, "partial_rollout/continued_responses": 0.0,
                       "partial_rollout/cut_responses": 3.0, "partial_rollout/groups_in_pool": 2.0,
                       "partial_rollout/stale_groups_dropped": 0.0, "partial_rollout/older_token_fraction": 0.0}
    assert sorted(c.sample_id for c in pool.cuts()) == ["g1/1", "g2/0", "g2/1"]

    # Iteration 2 at version 4: one batch tops the pool up; the cuts continue beside the fresh groups.
    taken, metrics = partial_rollout(gen, pool, loader, 4, PhaseClock(), actor_version=4, bound=1)
    b2 = loader.admitted[2]
    assert len(loader.admitted) == 3 and len(gen.calls) == 2
    assert sorted(q.group.group_id for q in gen.calls[1]) == ["g1/1@1", "g2/0@1", "g2/1@1", "g4", "g5"]
    assert [g.group_id for g in taken.groups] == ["g1", "g2"]  # older than g4, complete too
    assert taken.batches == [b0, b1]
    out = _by_id(taken.groups)
    assert _versions(out["g1/0"]) == [3] * 3
    assert _versions(out["g1/1"]) == [3] * 4 + [4] * 3
    assert _versions(out["g2/0"]) == [3] * 4 + [4] * 4 and out["g2/0"].finish_reason == LENGTH
    assert _versions(out["g2/1"]) == [3] * 4 + [4] * 2
    assert {x.weights_version for x in out.values()} == {3}
    # tokens older than version 4: 3 + 4 + 4 + 4 of 3 + 7 + 8 + 6
    assert metrics == {"partial_rollout/rounds": 1.0, "partial_rollout/continued_responses": 3.0,
                       "partial_rollout/cut_responses": 2.0, "partial_rollout/groups_in_pool": 2.0,
                       "partial_rollout/stale_groups_dropped": 0.0,
                       "partial_rollout/older_token_fraction": pytest.approx(15 / 24)}
    assert pool.batches_in_flight() == [b2]

    # Iteration 3 at version 5 for an update at 6 (bound 1): g4 (version 4) and g5 (from version 4) are past it.
    taken, metrics = partial_rollout(gen, pool, loader, 5, PhaseClock(), actor_version=6, bound=1)
    b3 = loader.admitted[3]
    assert len(loader.admitted) == 4
    assert [g.group_id for g in taken.groups] == ["g6", "g7"] and taken.batches == [b3]
    assert taken.stale_dropped == 2
    assert metrics == {"partial_rollout/rounds": 1.0, "partial_rollout/continued_responses": 2.0,
                       "partial_rollout/cut_responses": 0.0, "partial_rollout/groups_in_pool": 0.0,
                       "partial_rollout/stale_groups_dropped": 2.0, "partial_rollout/older_token_fraction": 0.0}
    assert pool.size() == 0 and pool.batches_in_flight() == []
    assert sorted(gen.scored) == sorted(lengths)  # every response scored exactly once, whole


def test_partial_rollout_runs_rounds_until_enough_groups_are_complete() -> None:
    lengths = {"g0/0": 5, "g0/1": 1, "g1/0": 6, "g1/1": 6, "g2/0": 7, "g2/1": 2, "g3/0": 1, "g3/1": 1}
    gen = _FakeGenerator(_Settings(), lengths)
    pool = PartialRollouts(n=2, global_batch_size=2)
    loader = _Loader(pool, gen, [[_prompt("g0"), _prompt("g1")], [_prompt("g2"), _prompt("g3")]])
    taken, metrics = partial_rollout(gen, pool, loader, 6, PhaseClock(), actor_version=6, bound=1)
    # round 1: only g3 complete (1 < 2), 4 cut; round 2 at the same version finishes them
    assert len(loader.admitted) == 2 and len(gen.calls) == 2
    assert sorted(q.group.group_id for q in gen.calls[1]) == ["g0/0@1", "g1/0@1", "g1/1@1", "g2/0@1"]
    assert [g.group_id for g in taken.groups] == ["g0", "g1"] and taken.batches == [loader.admitted[0]]
    assert metrics == {"partial_rollout/rounds": 2.0, "partial_rollout/continued_responses": 4.0,
                       "partial_rollout/cut_responses": 4.0, "partial_rollout/groups_in_pool": 2.0,
                       "partial_rollout/stale_groups_dropped": 0.0, "partial_rollout/older_token_fraction": 0.0}
    out = _by_id(taken.groups)
    assert _versions(out["g1/1"]) == [6] * 6 and out["g1/1"].response_length == 6
    assert pool.num_complete() == 2 and not pool.has_pending()


def test_a_resumed_pool_leaves_out_the_prompts_trained_before_its_checkpoint() -> None:
    """The journal's trained_past_cursor keys ("b{batch}/p{prompt}", any iteration) are not admitted again."""
    assert prompt_key("it7/b3/p12") == "b3/p12" and batch_of("b3/p12") == 3
    pool = PartialRollouts(n=2, global_batch_size=2)
    pool.trained_before_resume = {"b3/p12"}
    pool.admit([_prompt("it4/b3/p12"), _prompt("it4/b3/p5")], _Batch("b3"))
    assert [p.group_id for p in pool.fresh()] == ["it4/b3/p5"] and pool.size() == 1


def _async_scenario(require_max_age: bool, keep_generating=None) -> tuple[PartialRollouts, _FakeGenerator, list]:
    """n 2, global batch 1, max_tokens 8 in 2 splits, asynchronous engine. Rollout 1 (version 3): g0 ends at steps
    2 and 3, g1's responses (6 and 8 tokens) are interrupted at step 3. Rollout 2 (version 4) admits g2 (1 token
    each)."""
    s = _Settings(async_engine=True, require_max_age_all_finished=require_max_age, n_samples_per_prompt=2)
    gen = _FakeGenerator(s, {"g0/0": 2, "g0/1": 3, "g1/0": 6, "g1/1": 9, "g2/0": 1, "g2/1": 1})
    pool = PartialRollouts(n=2, global_batch_size=1)
    batches = iter([[_prompt("g0"), _prompt("g1")], [_prompt("g2")]])
    taken = []

    def admit() -> None:
        prompts = next(batches)
        _admitted(pool, gen, prompts, prompts[0].group_id)

    for version in (3, 4):
        groups, metrics = partial_rollout(gen, pool, admit, version, PhaseClock(), version, 3, keep_generating)
        taken.append((groups, metrics))
    return pool, gen, taken


def test_the_asynchronous_engine_interrupts_a_round_once_enough_groups_ended() -> None:
    pool, gen, taken = _async_scenario(require_max_age=True)
    (first, m1), (second, m2) = taken
    # Rollout 1: every request asks for the whole budget; g0 complete at step 3, so g1 is interrupted there.
    assert [q.sampling.max_tokens for q in gen.calls[0]] == [8, 8]
    assert [g.group_id for g in first.groups] == ["g0"]
    assert m1["partial_rollout/cut_responses"] == 2 and m1["partial_rollout/rounds"] == 1
    # Rollout 2: g1's responses are at their last split (2 - 1): the interrupt waits for them, though g2 ended at
    # step 1; each continuation asks for the rest of its budget. g1 trains first (admitted first).
    assert [(q.group.group_id, q.sampling.max_tokens) for q in gen.calls[1]] == [("g2", 8), ("g1/0@1", 5),
                                                                               ("g1/1@1", 5)]
    assert [g.group_id for g in second.groups] == ["g1"]
    g1 = _by_id(second.groups)
    assert to_numpy(g1["g1/0"].response_token_versions).tolist() == [3, 3, 3, 4, 4, 4]
    assert to_numpy(g1["g1/1"].response_token_versions).tolist() == [3, 3, 3] + [4] * 5
    assert g1["g1/1"].finish_reason == LENGTH and g1["g1/0"].weights_version == 3
    assert to_numpy(g1["g1/1"].response_token_ids).tolist() == _token_ids("g1/1", 0, 8)
    assert m2["partial_rollout/cut_responses"] == 0 and m2["partial_rollout/continued_responses"] == 2


def test_without_require_max_age_the_interrupt_also_cuts_responses_at_their_last_split() -> None:
    pool, gen, taken = _async_scenario(require_max_age=False)
    (_, _), (second, m2) = taken
    # g2 ends at step 1 and is complete: g1's responses are interrupted again, one more token each at version 4.
    assert [g.group_id for g in second.groups] == ["g2"]
    assert m2["partial_rollout/cut_responses"] == 2
    assert sorted((c.sample_id, c.splits, c.versions.tolist()) for c in pool.cuts()) == [
        ("g1/0", 2, [3, 3, 3, 4]), ("g1/1", 2, [3, 3, 3, 4])]


def test_the_asynchronous_engine_keeps_generating_while_asked_to() -> None:
    """Pipelined: while the update runs, the round is not interrupted (it ends when its responses do)."""
    pool, gen, taken = _async_scenario(require_max_age=True, keep_generating=lambda: True)
    (first, m1), (second, m2) = taken
    assert m1["partial_rollout/cut_responses"] == 0 and [g.group_id for g in first.groups] == ["g0"]
    # g1 ended whole in rollout 1, at version 3: rollout 2 has a complete group already and runs no round.
    assert [g.group_id for g in second.groups] == ["g1"] and m2["partial_rollout/rounds"] == 0
    assert {v for x in second.groups[0].samples for v in to_numpy(x.response_token_versions).tolist()} == {3}


def test_take_hands_over_the_reference_log_probs_of_the_taken_groups_only() -> None:
    """Streamed in the rollout where each response ended, they wait in the pool with their group."""
    pool = PartialRollouts(n=1, global_batch_size=1)
    a = _Batch("a")
    pool.admit([_prompt("g0"), _prompt("g1")], a)
    pool.mark_sent(pool.fresh())
    for gid in ("g0", "g1"):
        x = common_pb2.Sample(sample_id=f"{gid}/0", group_id=gid, index=0, weights_version=3, response_length=2)
        pool.finish(x, _score(x.sample_id))
    pool.ref_log_probs.update({"g0/0": np.array([-1.0, -2.0]), "g1/0": np.array([-3.0, -4.0])})
    taken = pool.take(1, actor_version=3, bound=0)
    assert [g.group_id for g in taken.groups] == ["g0"]
    assert {k: v.tolist() for k, v in taken.ref_log_probs.items()} == {"g0/0": [-1.0, -2.0]}
    assert list(pool.ref_log_probs) == ["g1/0"]
    pool.ref_log_probs.clear()
    # Without a streamed reference nothing is handed over (the iteration computes it over the trained batch).
    last = pool.take(1, actor_version=3, bound=0)
    assert [g.group_id for g in last.groups] == ["g1"] and last.ref_log_probs is None
