"""Partial rollout, as MindSpeed-RL defines it (`rl_config.partial_rollout_max_split: N`, N > 1).

A response is generated in chunks of `max_tokens // N` tokens. Each iteration's rollout runs rounds: every
response in flight gets its next chunk (a fresh group its n samples, a cut response its continuation: the prompt
and the response so far, as a one-sample group `{sample_id}@{split}`), at the version the replicas hold; rounds go
on until at least `global_batch_size` groups have every sample finished. Those groups train, oldest first; a
response cut at a chunk stays in the pool (`PartialRollouts`) and is continued in the next iteration with the newer
weights, so a long response no longer holds its whole batch back and the engine's batch stays full. A response
ends at its stop token, its error, or its full length (max_tokens, or what max_model_len leaves), hence within N
chunks: at most N - 1 versions older than the iteration that takes it (the fence: weight_version.staleness_bound).

The asynchronous engine (`rl_config.async_engine`, upstream's other scheme) asks for each response's whole budget
and interrupts the round (`GenerateRequest.interrupt`) once `global_batch_size` groups have ended and, with
`require_max_age_all_finished`, every response at its last split: the interrupted ones are cut where they stand.

The pool holds up to twice `global_batch_size` groups, as upstream's TransferDock does: each rollout first tops it
up with whole prompt batches. A checkpoint's data cursor is the first batch with a group still in the pool (or
taken and not trained yet), and it journals the prompts of later batches that did train: a resumed run generates
those batches again without them (`trained_before_resume`), so no prompt trains twice and none is skipped.
Each finished response is one stitched `Sample`: its tokens and log-probs in order, `response_token_versions`
naming the version of each token, `weights_version` the oldest; the log-probs are each token's behaviour policy,
which the trainer's truncated importance ratio corrects per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfabric.v1 import common_pb2, reward_pb2, rollout_pb2
from services.common.tensors import to_numpy, to_proto
from services.common.weight_version import outside_fence
from services.coordinator.continuations import with_max_tokens
from services.coordinator.errors import IterationError
from services.coordinator.generation import Group, GroupPrompt, RequestStream
from services.coordinator.iteration_metrics import PhaseClock

CONTINUATION_MARK = "@"  # a continuation's group id: "{sample_id}@{split}"


def prompt_key(group_id: str) -> str:
    """A group's prompt across runs and resumes: "b{batch}/p{prompt}" of its id "it{iteration}/b{batch}/p{prompt}"."""
    return group_id.split("/", 1)[1]


def batch_of(key: str) -> int:
    """The prompt batch of a `prompt_key`."""
    return int(key.split("/", 1)[0][1:])


@dataclass
class Cut:
    """A response cut at a chunk's end (or interrupted): what it holds so far, and the prompt it continues."""

    prompt: GroupPrompt
    index: int  # its sample index in its group
    tokens: np.ndarray  # int32 [length]
    log_probs: np.ndarray  # float32 [length]
    versions: np.ndarray  # int64 [length]
    splits: int  # rounds it was generated in so far (its age)
    # The response so far as one Sample: its ids, prompt length and latency, which the next part keeps (its
    # tensors hold what the arrays above hold, decoded once here for the continuation and the stitching).
    first: common_pb2.Sample

    @property
    def sample_id(self) -> str:
        return self.first.sample_id


def chunk_tokens(settings: Any) -> int:
    """A chunk's length: max_tokens // partial_rollout_max_split (the config check makes it divide)."""
    return settings.max_tokens // settings.partial_rollout_max_split


def continuation(cut: Cut, sampling: common_pb2.SamplingParams, budget: int, version: int,
                 chunk: int) -> rollout_pb2.GenerateRequest:
    """The request for `cut`'s next chunk: its context as the prompt, at most a chunk or what is left of `budget`."""
    context = np.concatenate([np.asarray(cut.prompt.prompt, np.int32), cut.tokens])
    group = common_pb2.PromptGroup(group_id=f"{cut.sample_id}{CONTINUATION_MARK}{cut.splits}",
                                   prompt_token_ids=to_proto(context), n=1)
    return rollout_pb2.GenerateRequest(group=group, expected_weights_version=version,
                                       sampling=with_max_tokens(sampling, min(chunk, budget - len(cut.tokens))))


def stitched(cut: Cut | None, part: common_pb2.Sample) -> common_pb2.Sample:
    """The whole response so far: `cut`'s tokens then `part`'s (a fresh response: `part` itself, tagged)."""
    tokens = to_numpy(part.response_token_ids).astype(np.int32).reshape(-1) if part.response_length else \
        np.zeros(0, np.int32)
    log_probs = to_numpy(part.response_log_probs).astype(np.float32).reshape(-1) if part.response_length else \
        np.zeros(0, np.float32)
    if log_probs.shape[0] != tokens.shape[0]:  # a failed chunk: nothing of it trains
        log_probs = np.zeros(tokens.shape[0], np.float32)
    versions = np.full(tokens.shape[0], int(part.weights_version), np.int64)
    out = common_pb2.Sample()
    if cut is None:
        out.CopyFrom(part)
    else:
        out.CopyFrom(cut.first)
        tokens = np.concatenate([cut.tokens, tokens])
        log_probs = np.concatenate([cut.log_probs, log_probs])
        versions = np.concatenate([cut.versions, versions])
        out.finish_reason, out.error = part.finish_reason, part.error
        out.latency_s = cut.first.latency_s + part.latency_s
        out.weights_version = int(versions.min()) if versions.size else int(part.weights_version)
        out.ClearField("routed_experts")  # routing replay is refused with partial rollout (the config check)
    out.response_token_ids.CopyFrom(to_proto(tokens))
    out.response_log_probs.CopyFrom(to_proto(log_probs))
    out.response_token_versions.CopyFrom(to_proto(versions))
    out.response_length = int(tokens.shape[0])
    return out


def is_cut(sample: common_pb2.Sample, budget: int) -> bool:
    """Whether a stitched response stopped at a chunk's end (or was interrupted) with room left: it continues in a
    later round."""
    return (sample.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_INTERRUPTED)
            and not sample.error and sample.response_length < budget)


@dataclass
class _Slot:
    """One group in the pool: its prompt batch, its finished samples (with scores) and its cut responses."""

    prompt: GroupPrompt
    batch: Any
    order: int  # admission order: the oldest complete groups train first
    sent: bool = False  # its fresh request went out (its n samples are finished or cut since)
    done: dict[int, tuple[common_pb2.Sample, reward_pb2.ScoreResponse]] = field(default_factory=dict)
    cuts: dict[int, Cut] = field(default_factory=dict)


@dataclass
class TakenGroups:
    """What `PartialRollouts.take` hands to training."""

    groups: list[Group]
    batches: list[Any]  # the prompt batches of `groups`, each once
    # The reference's log-probs of their trainable responses, by sample id, when the rollouts streamed them.
    ref_log_probs: dict[str, np.ndarray] | None
    stale_dropped: int  # complete groups past the version fence, dropped (their samples are lost, the run goes on)


class PartialRollouts:
    """The pool of groups in flight across iterations (see module docstring).

    Args:
        n: samples per prompt.
        global_batch_size: groups per update.
    """

    def __init__(self, n: int, global_batch_size: int) -> None:
        self.n = n
        self.global_batch_size = global_batch_size
        self.capacity = 2 * global_batch_size
        self._slots: dict[str, _Slot] = {}
        self._admitted = 0
        # Prompts (prompt_key) a resumed run trained before its checkpoint, in batches its data cursor gives again:
        # admitting them would train them twice.
        self.trained_before_resume: set[str] = set()
        # The reference's log-probs of ended responses still in the pool (streamed in the rollout they ended in).
        self.ref_log_probs: dict[str, np.ndarray] = {}

    # -- what is in flight ------------------------------------------------------------------------------------

    def has_room_for_batch(self) -> bool:
        """Whether a whole prompt batch fits under the pool's capacity."""
        return len(self._slots) + self.global_batch_size <= self.capacity

    def admit(self, prompts: Iterable[GroupPrompt], batch: Any) -> None:
        for p in prompts:
            if not (self.trained_before_resume and prompt_key(p.group_id) in self.trained_before_resume):
                self._slots[p.group_id] = _Slot(p, batch, self._admitted)
                self._admitted += 1

    def fresh(self) -> list[GroupPrompt]:
        """Groups not sent yet (their n samples go out as one group)."""
        return [s.prompt for s in self._slots.values() if not s.sent]

    def cuts(self) -> list[Cut]:
        return [c for s in self._slots.values() for c in s.cuts.values()]

    def has_pending(self) -> bool:
        return any(not s.sent or s.cuts for s in self._slots.values())

    def size(self) -> int:
        """Groups in the pool: sent or not, complete or not."""
        return len(self._slots)

    def done_counts(self) -> dict[str, int]:
        """Ended (and scored) responses of each group in the pool, by group id."""
        return {g: len(s.done) for g, s in self._slots.items()}

    def num_complete(self) -> int:
        return sum(1 for s in self._slots.values() if len(s.done) == self.n)

    def batches_in_flight(self) -> list[Any]:
        """The prompt batches that still have a group in the pool (not trained yet), in admission order."""
        seen: dict[int, Any] = {}
        for s in sorted(self._slots.values(), key=lambda s: s.order):
            seen.setdefault(id(s.batch), s.batch)
        return list(seen.values())

    # -- a round's outcome ------------------------------------------------------------------------------------

    def mark_sent(self, prompts: Sequence[GroupPrompt]) -> None:
        for p in prompts:
            self._slots[p.group_id].sent = True

    def finish(self, sample: common_pb2.Sample, score: reward_pb2.ScoreResponse) -> None:
        """A response ended (stop, error or full length), scored."""
        slot = self._slots[sample.group_id]
        slot.cuts.pop(sample.index, None)
        slot.done[sample.index] = (sample, score)

    def cut(self, cut: Cut) -> None:
        self._slots[cut.prompt.group_id].cuts[cut.index] = cut

    # -- training -------------------------------------------------------------------------------------------

    def take(self, k: int, actor_version: int, bound: int) -> TakenGroups:
        """Up to `k` complete groups, oldest first, leaving the pool. A complete group with a sample more than
        `bound` versions behind `actor_version` (it waited too long in the pool) is dropped, never trained."""
        complete = sorted((s for s in self._slots.values() if len(s.done) == self.n), key=lambda s: s.order)
        groups, batches, dropped, ref = [], {}, 0, {}
        for slot in complete:
            if len(groups) == k:
                break
            del self._slots[slot.prompt.group_id]
            group = Group(slot.prompt, [slot.done[i][0] for i in range(self.n)], [slot.done[i][1] for i in range(self.n)])
            own_ref = {x.sample_id: self.ref_log_probs.pop(x.sample_id) for x in group.samples
                       if x.sample_id in self.ref_log_probs}
            if outside_fence((x.weights_version for x in group.trainable()), actor_version, bound):
                dropped += 1
                continue
            groups.append(group)
            batches.setdefault(id(slot.batch), slot.batch)
            ref.update(own_ref)
        return TakenGroups(groups, list(batches.values()), ref or None, dropped)


def generate_round(generator: Any, pool: PartialRollouts, version: int, clock: PhaseClock,
                   keep_generating: Callable[[], bool] | None = None, reference: Any = None) -> dict[str, int]:
    """One round at `version`: the next chunk of every response in flight (asynchronous engine: the rest of it,
    until interrupted); ended ones are scored and finish, cut ones stay in the pool. Returns how many responses were
    continued and how many were cut. `reference` (a LogProbStream) gets every trainable response that ended."""
    s = generator.settings
    chunk, sampling = chunk_tokens(s), generator.sampling_params()
    fresh, cuts = pool.fresh(), pool.cuts()
    requests = generator.group_requests(fresh, version, sampling, cap=None if s.async_engine else chunk)
    by_continuation: dict[str, Cut] = {}
    for c in cuts:
        budget = s.response_budget(len(c.prompt.prompt))
        request = continuation(c, sampling, budget, version, budget if s.async_engine else chunk)
        by_continuation[request.group.group_id] = c
        requests.append(request)
    by_group = {p.group_id: p for p in fresh}
    pool.mark_sent(fresh)
    scores: dict[str, reward_pb2.ScoreResponse] = {}
    ended: list[common_pb2.Sample] = []
    num_cut = 0
    reward = RequestStream("rule_reward", generator.score, lambda r: scores.__setitem__(r.sample_id, r), clock)
    stop = _interrupt_rule(pool, cuts, ended, s, keep_generating) if s.async_engine else None
    try:
        for part in generator.samples_of(requests, clock, stop):
            before = by_continuation.get(part.group_id)
            prompt = before.prompt if before is not None else by_group[part.group_id]
            whole = stitched(before, part)
            if is_cut(whole, s.response_budget(len(prompt.prompt))):
                num_cut += 1
                pool.cut(Cut(prompt, whole.index, to_numpy(whole.response_token_ids).astype(np.int32).reshape(-1),
                             to_numpy(whole.response_log_probs).astype(np.float32).reshape(-1),
                             to_numpy(whole.response_token_versions).astype(np.int64).reshape(-1),
                             (before.splits if before is not None else 0) + 1, whole))
            else:
                ended.append(whole)
                reward.put(generator.score_request(whole, prompt.answer))
                if reference is not None and whole.response_length and not whole.error:
                    reference.add(whole, prompt.prompt, version)
    finally:
        reward.close()
    reward.join()
    missing = [x.sample_id for x in ended if x.sample_id not in scores]
    if missing:
        raise IterationError(f"reward: no score for {len(missing)} samples (first: {missing[:3]})")
    for x in ended:
        pool.finish(x, scores[x.sample_id])
    return {"continued": len(cuts), "cut": num_cut}


def _interrupt_rule(pool: PartialRollouts, cuts: list[Cut], ended: list[common_pb2.Sample], settings: Any,
                    keep_generating: Callable[[], bool] | None) -> Callable[[], bool]:
    """The asynchronous engine's stop signal (upstream's `get_update_ready`): `global_batch_size` groups complete,
    counting the responses `ended` so far in this round; with `require_max_age_all_finished`, every response at its
    last split ended too; and no update running that the rollout should keep generating beside (pipelined)."""
    n, done = settings.n_samples_per_prompt, pool.done_counts()
    waiting = {c.sample_id for c in cuts if c.splits >= settings.partial_rollout_max_split - 1} \
        if settings.require_max_age_all_finished else set()
    complete = sum(1 for k in done.values() if k == n)
    counted = 0  # `ended` grows as the round goes; each response is counted once

    def stop() -> bool:
        nonlocal complete, counted
        for x in ended[counted:]:
            done[x.group_id] += 1
            complete += done[x.group_id] == n
            waiting.discard(x.sample_id)
        counted = len(ended)
        return (complete >= pool.global_batch_size and not waiting
                and not (keep_generating is not None and keep_generating()))

    return stop


def partial_rollout(generator: Any, pool: PartialRollouts, admit_batch: Callable[[], None], version: int,
                    clock: PhaseClock, actor_version: int, bound: int,
                    keep_generating: Callable[[], bool] | None = None, reference: Any = None,
                    on_generated: Callable[[], None] | None = None) -> tuple[TakenGroups, dict[str, float]]:
    """One iteration's rollout: tops the pool up with whole prompt batches (`admit_batch` takes the loader's next
    one into it), runs rounds at `version` until `global_batch_size` groups are complete, and takes them for an
    update at `actor_version` (fence `bound`). With the asynchronous engine, a round is interrupted once its stop
    signal holds (`keep_generating`: while true, it goes on). `reference` (a LogProbStream) computes the reference's
    log-probs of the responses as they end; they wait in the pool with their groups. `on_generated` is called once
    the last round ended, before the reference's last log-probs are in. Returns the groups and the
    `partial_rollout/*` metrics."""
    while pool.has_room_for_batch():
        admit_batch()
    rounds = continued = cut = 0
    while pool.num_complete() < pool.global_batch_size:
        if not pool.has_pending():  # every group in the pool complete, and still too few
            admit_batch()
        counts = generate_round(generator, pool, version, clock, keep_generating, reference)
        rounds += 1
        continued += counts["continued"]
        cut += counts["cut"]
    if on_generated is not None:
        on_generated()
    if reference is not None:
        reference.flush(version)
        pool.ref_log_probs.update(reference.join())
    taken = pool.take(pool.global_batch_size, actor_version, bound)
    trained = [x for g in taken.groups for x in g.trainable()]
    stitched_tokens = sum(int((to_numpy(x.response_token_versions) != version).sum()) for x in trained)
    total_tokens = sum(x.response_length for x in trained)
    return taken, {"partial_rollout/rounds": float(rounds),
                   "partial_rollout/continued_responses": float(continued),
                   "partial_rollout/cut_responses": float(cut),
                   "partial_rollout/groups_in_pool": float(pool.size()),
                   "partial_rollout/stale_groups_dropped": float(taken.stale_dropped),
                   "partial_rollout/older_token_fraction": stitched_tokens / total_tokens if total_tokens else 0.0}
