"""Multi-turn tool use in the coordinator (services/coordinator/multi_turn.py): the decision after each turn, the
answers' truncation, the limits, and the stitched sample the trainer gets (tool answers masked out, log-probs 0)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from rlfabric.v1 import common_pb2
from services.common.tensors import to_numpy, to_proto
from services.coordinator.multi_turn import MultiTurn, MultiTurnSettings, Trajectory, truncate, wrap_answers
from services.coordinator.tool_parsers import parse_hermes

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "%s"}}</tool_call>'


@dataclass
class Answer:
    status: str
    text: str
    latency_s: float = 0.01


class Vocabulary:
    """Texts <-> token ids for the test: each distinct text one id (a turn is one token here)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def token(self, text: str) -> int:
        if text not in self.texts:
            self.texts.append(text)
        return 1000 + self.texts.index(text)

    def decode(self, ids) -> str:
        return "".join(self.texts[i - 1000] for i in ids)


def turn(vocab: Vocabulary, sample_id: str, text: str, *, prompt_length: int = 3,
         finish=common_pb2.FINISH_REASON_STOP) -> common_pb2.Sample:
    ids = np.array([vocab.token(text)], np.int32)
    return common_pb2.Sample(sample_id=sample_id, group_id=sample_id.rsplit("/", 1)[0], index=0,
                             response_token_ids=to_proto(ids), response_log_probs=to_proto(np.array([-0.5], np.float32)),
                             prompt_length=prompt_length, response_length=1, finish_reason=finish, weights_version=4)


def multi_turn(vocab: Vocabulary, answers: dict[str, Answer], **overrides) -> MultiTurn:
    settings = MultiTurnSettings(**{"max_tool_calls": 2, "max_parallel_calls": 2, "max_total_response_length": 64,
                                    "max_tool_response_length": 10, **overrides})

    def call_tool(call, call_id, deadline_s):
        return answers[call.arguments["expression"]]

    def observation(texts):  # two tokens per observation: a marker and the joined answers
        return np.array([7, vocab.token(wrap_answers(texts))], np.int32)

    return MultiTurn(settings, parse_hermes, call_tool, vocab.decode, observation)


def test_truncation_keeps_the_configured_side() -> None:
    assert truncate("abcdefghij", 20, "middle") == "abcdefghij"
    assert truncate("abcdefghij", 4, "left") == "abcd...(truncated)..."
    assert truncate("abcdefghij", 4, "right") == "...(truncated)...ghij"
    assert truncate("abcdefghij", 5, "middle") == "ab...(truncated)...hij"


def test_a_call_is_answered_and_the_stitched_sample_masks_the_answer() -> None:
    vocab = Vocabulary()
    mt = multi_turn(vocab, {"6*7": Answer("OK", "42")})
    first = turn(vocab, "g/0", "let me " + CALL % "6*7")
    trajectory = Trajectory(first=first, prompt=np.array([1, 2, 3], np.int32))
    context = mt.next_step(trajectory, first)
    assert context is not None and context[:4].tolist() == [1, 2, 3, vocab.token("let me " + CALL % "6*7")]
    assert vocab.decode(context[5:].tolist()) == "<tool_response>\n42\n</tool_response>"
    assert mt.remaining_tokens(trajectory) == 64 - 3
    second = turn(vocab, "g/0@1/0", "the answer is 42", prompt_length=6)
    assert mt.next_step(trajectory, second) is None  # no call: done
    sample = mt.finish(trajectory)
    assert (sample.sample_id, sample.group_id, sample.prompt_length, sample.response_length) == ("g/0", "g", 3, 4)
    assert to_numpy(sample.response_mask).tolist() == [True, False, False, True]
    assert to_numpy(sample.response_log_probs).tolist() == [-0.5, 0.0, 0.0, -0.5]
    assert to_numpy(sample.response_token_ids)[1] == 7
    metrics = mt.take_metrics()
    assert metrics["tool/calls_per_sample"] == 1 and metrics["tool/turns_per_sample"] == 2
    assert metrics["tool/success_rate"] == 1.0 and metrics["tool/errors"] == 0
    assert metrics["response_length/generated_mean"] == 2 and metrics["response_length/tool_mean"] == 2
    assert mt.take_metrics() == {}  # taken


def test_limits_errors_and_a_turn_without_calls() -> None:
    vocab = Vocabulary()
    answers = {"1": Answer("OK", "x" * 30), "2": Answer("TIMEOUT", "timed out"), "3": Answer("OK", "3")}
    mt = multi_turn(vocab, answers, max_tool_calls=2, max_parallel_calls=2)
    # three calls in one turn: two answered (max_parallel_calls), the long one cut to 10 characters in the middle
    first = turn(vocab, "g/0", CALL % "1" + CALL % "2" + CALL % "3")
    trajectory = Trajectory(first=first, prompt=np.array([1], np.int32))
    context = mt.next_step(trajectory, first)
    observed = vocab.decode(context[-1:].tolist())
    assert "xxxxx...(truncated)...xxxxx" in observed and "timed out" in observed and "\n3\n" not in observed
    # max_tool_calls used up: the next turn's calls are not answered, the trajectory ends
    assert mt.next_step(trajectory, turn(vocab, "g/0@1/0", CALL % "3")) is None
    metrics = mt.finish(trajectory) and mt.take_metrics()
    assert metrics["tool/timeouts"] == 1 and metrics["tool/success_rate"] == 0.5
    # a malformed call is answered with the parse error, which the model sees
    mt = multi_turn(vocab, answers, max_tool_response_length=500)
    bad = turn(vocab, "h/0", "<tool_call>{not json}</tool_call>")
    trajectory = Trajectory(first=bad, prompt=np.array([1], np.int32))
    assert "not valid JSON" in vocab.decode(mt.next_step(trajectory, bad)[-1:].tolist())
    # a sample that failed or a turn cut by the length limit ends the trajectory as it is
    failed = turn(vocab, "k/0", CALL % "1")
    failed.error = "prompt too long"
    assert mt.next_step(Trajectory(first=failed, prompt=np.array([1], np.int32)), failed) is None
    cut = turn(vocab, "m/0", CALL % "1", finish=common_pb2.FINISH_REASON_LENGTH)
    assert mt.next_step(Trajectory(first=cut, prompt=np.array([1], np.int32)), cut) is None


def test_no_room_for_the_answers_ends_the_trajectory() -> None:
    vocab = Vocabulary()
    mt = multi_turn(vocab, {"1": Answer("OK", "1")}, max_total_response_length=3)
    first = turn(vocab, "g/0", CALL % "1")
    trajectory = Trajectory(first=first, prompt=np.array([1], np.int32))
    assert mt.next_step(trajectory, first) is None  # 1 generated + 2 answer tokens leave nothing to generate
    sample = mt.finish(trajectory)
    assert not sample.HasField("response_mask") and sample.response_length == 1


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncation_never_exceeds_the_limit_plus_the_mark(side: str) -> None:
    text = "".join(chr(65 + i % 26) for i in range(97))
    out = truncate(text, 11, side)
    assert len(out) == 11 + len("...(truncated)...")
