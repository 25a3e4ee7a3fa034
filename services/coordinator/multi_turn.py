"""Multi-turn tool use: a sample's turns and the tool answers between them, stitched into one trajectory.

MindSpeed-RL's multi-turn rollout (`rl_config.multi_turn_enable`, verl's tool agent loop underneath): the model
generates; the calls in its turn are parsed (`tool_parser_format`, services/coordinator/tool_parsers.py); up to
`max_parallel_calls` of them are answered at once by the tool servers (services/coordinator/tool_client.py; a
malformed call is answered with the parse error); each answer is cut to `max_tool_response_length` characters
on `tool_response_truncate_side` (left keeps the head, right the tail, middle both halves) and the answers are
appended in the chat template's observation format; the model continues from there. A trajectory ends when a
turn makes no call, when a turn stops at its token budget, when `max_tool_calls` calls were answered over its
turns, or when the response (generated and tool tokens together) would pass `max_total_response_length`.

Here the coordinator drives the turns, so rollout replicas stay single-turn engines: each continuation is a
one-sample group whose prompt is the whole context so far (the prompt, every turn, every answer; a replica's
prefix cache makes that cheap), under the group id `{sample_id}@{turn}`. What the trainer gets is one sample:
the turns and answers as one response, with `response_mask` false on the answers (context the model attends
to, never trained on) and their log-probs 0.

`Trajectory` holds one sample's parts; `MultiTurn` decides each step and answers the calls; the Generator
(generation.py) sends the continuations and hands on finished trajectories as ordinary samples.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from rlfabric.v1 import common_pb2
from services.common.tensors import to_numpy, to_proto
from services.coordinator.tool_parsers import ParsedCall, ToolCall, ToolCallParseError

TRUNCATE_SIDES = ("left", "right", "middle")
# Marks a cut in a tool's answer, as verl's tool agent loop writes it.
_CUT = "...(truncated)..."


@dataclass(frozen=True)
class MultiTurnSettings:
    """The `rl_config` multi-turn keys (validated when the config loaded)."""

    max_tool_calls: int  # answered calls per sample, over all its turns
    max_parallel_calls: int  # calls answered per turn (the rest of a turn's calls are not answered)
    max_total_response_length: int  # response tokens of a sample: every turn and every answer
    max_tool_response_length: int  # characters of one tool answer
    truncate_side: str = "middle"
    tool_parser_format: str = "hermes"
    tool_config_path: str = ""  # the tool YAML the tool servers host (`rlfabric tools serve --tool-config`)
    tool_deadline_s: float = 0.0  # per call; 0: the tool's own default


def truncate(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters (plus the cut mark) on `side`: left keeps the head, right the tail."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + _CUT
    if side == "right":
        return _CUT + text[-limit:]
    half = limit // 2
    return text[:half] + _CUT + text[len(text) - (limit - half):]


@dataclass
class ToolStats:
    """Tool use of the samples finished since the last `take` (the iteration's `tool/*` metrics)."""

    samples: int = 0
    turns: int = 0
    calls: int = 0
    errors: int = 0  # answered with an error: a tool error, invalid arguments, a parse error
    timeouts: int = 0
    latency_s: float = 0.0
    generated_tokens: int = 0
    tool_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        if not self.samples:
            return {}
        n = float(self.samples)
        return {"tool/calls_per_sample": self.calls / n, "tool/turns_per_sample": self.turns / n,
                "tool/success_rate": (self.calls - self.errors - self.timeouts) / self.calls if self.calls else 0.0,
                "tool/errors": float(self.errors), "tool/timeouts": float(self.timeouts),
                "tool/latency_s_mean": self.latency_s / self.calls if self.calls else 0.0,
                "response_length/generated_mean": self.generated_tokens / n,
                "response_length/tool_mean": self.tool_tokens / n}


@dataclass
class Trajectory:
    """One sample's turns so far: the first turn's identity, and each part of its response."""

    first: common_pb2.Sample  # the first turn (its sample id, group, index and prompt length are the sample's)
    prompt: np.ndarray  # int32 prompt token ids
    tokens: list[np.ndarray] = field(default_factory=list)
    log_probs: list[np.ndarray] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)  # per part: the model's turn (True) or a tool answer
    turns: int = 0
    calls: int = 0
    last: common_pb2.Sample | None = None

    @property
    def response_length(self) -> int:
        return sum(len(t) for t in self.tokens)

    def context(self) -> np.ndarray:
        return np.concatenate([self.prompt, *self.tokens]).astype(np.int32)

    def add_turn(self, sample: common_pb2.Sample) -> np.ndarray:
        tokens = to_numpy(sample.response_token_ids).astype(np.int32) if sample.response_length else np.zeros(0, np.int32)
        lp = to_numpy(sample.response_log_probs).astype(np.float32) if sample.response_length else np.zeros(0, np.float32)
        self.tokens.append(tokens.reshape(-1))
        self.log_probs.append(lp.reshape(-1))
        self.generated.append(True)
        self.turns += 1
        self.last = sample
        return tokens

    def add_answers(self, tokens: np.ndarray) -> None:
        self.tokens.append(np.asarray(tokens, np.int32).reshape(-1))
        self.log_probs.append(np.zeros(len(tokens), np.float32))
        self.generated.append(False)

    def stitched(self) -> common_pb2.Sample:
        """The whole trajectory as one sample (the first turn's ids, the last turn's finish and error)."""
        assert self.last is not None
        out = common_pb2.Sample()
        out.CopyFrom(self.first)
        if self.turns == 1:  # a single turn is the rollout's sample as it came
            return out
        tokens = np.concatenate(self.tokens).astype(np.int32)
        mask = np.concatenate([np.full(len(t), g, np.bool_) for t, g in zip(self.tokens, self.generated,
                                                                           strict=True)])
        out.response_token_ids.CopyFrom(to_proto(tokens))
        out.response_log_probs.CopyFrom(to_proto(np.concatenate(self.log_probs).astype(np.float32)))
        out.response_mask.CopyFrom(to_proto(mask))
        out.response_length = len(tokens)
        out.finish_reason = self.last.finish_reason
        out.error = self.last.error
        return out


class MultiTurn:
    """Decides each step of the trajectories of one run and answers their calls (see module docstring).

    Args:
        settings: the multi-turn keys.
        parse: the tool-call parser (`tool_parsers.get_tool_parser(tool_parser_format)`).
        call_tool: (call, call id, deadline_s) -> an object with `status`, `text`, `latency_s` (ToolClient.call).
        decode: token ids -> text (the run's detokenizer, without special tokens).
        observation: the answers' texts -> the token ids appended after the turn (the chat template's observation
            format, tokenised).
    """

    def __init__(self, settings: MultiTurnSettings, parse: Callable[[str], list[ParsedCall]],
                 call_tool: Callable[[ToolCall, str, float], object], decode: Callable[[Sequence[int]], str],
                 observation: Callable[[list[str]], np.ndarray]) -> None:
        self.settings = settings
        self._parse = parse
        self._call_tool = call_tool
        self._decode = decode
        self._observation = observation
        self._pool = ThreadPoolExecutor(max_workers=max(1, settings.max_parallel_calls) * 8,
                                        thread_name_prefix="tool-call")
        self._lock = threading.Lock()
        self._stats = ToolStats()

    def next_step(self, trajectory: Trajectory, sample: common_pb2.Sample) -> np.ndarray | None:
        """Adds the turn `sample`; returns the context to continue from, or None when the trajectory is done.

        Blocks while the turn's calls are answered: call it off the thread that receives samples.
        """
        s = self.settings
        tokens = trajectory.add_turn(sample)
        # A turn cut by its token budget ends the trajectory (as verl ends one at the response length).
        if sample.error or sample.finish_reason == common_pb2.FINISH_REASON_LENGTH or trajectory.calls >= s.max_tool_calls:
            return None
        calls = self._parse(self._decode(tokens.tolist()))[:min(s.max_parallel_calls, s.max_tool_calls - trajectory.calls)]
        if not calls:
            return None
        texts = self._answer(trajectory, calls)
        answers = np.asarray(self._observation(texts), np.int32)
        if trajectory.response_length + len(answers) >= s.max_total_response_length:
            return None  # no room left to generate after the answers
        trajectory.add_answers(answers)
        return trajectory.context()

    def remaining_tokens(self, trajectory: Trajectory) -> int:
        """Response tokens the next turn may generate."""
        return self.settings.max_total_response_length - trajectory.response_length

    def finish(self, trajectory: Trajectory) -> common_pb2.Sample:
        out = trajectory.stitched()
        generated = sum(len(t) for t, g in zip(trajectory.tokens, trajectory.generated, strict=True) if g)
        with self._lock:
            st = self._stats
            st.samples += 1
            st.turns += trajectory.turns
            st.generated_tokens += generated
            st.tool_tokens += trajectory.response_length - generated
        return out

    def take_metrics(self) -> dict[str, float]:
        with self._lock:
            out, self._stats = self._stats.metrics(), ToolStats()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _answer(self, trajectory: Trajectory, calls: list[ParsedCall]) -> list[str]:
        """Each call's answer text, in call order (parse errors answered with their message)."""
        s = self.settings
        base = trajectory.calls
        trajectory.calls += len(calls)
        futures = [None if isinstance(c, ToolCallParseError) else
                   self._pool.submit(self._call_tool, c, f"{trajectory.first.sample_id}#{base + i}", s.tool_deadline_s)
                   for i, c in enumerate(calls)]
        texts = []
        errors = timeouts = 0
        latency = 0.0
        for call, future in zip(calls, futures, strict=True):
            if future is None:
                texts.append(call.message)
                errors += 1
                continue
            result = future.result()
            latency += float(result.latency_s)
            errors += result.status in ("TOOL_ERROR", "INVALID_ARGUMENTS")
            timeouts += result.status == "TIMEOUT"
            texts.append(result.text)
        with self._lock:
            self._stats.calls += len(calls)
            self._stats.errors += errors
            self._stats.timeouts += timeouts
            self._stats.latency_s += latency
        return [truncate(t, s.max_tool_response_length, s.truncate_side) for t in texts]


def wrap_answers(texts: Sequence[str]) -> str:
    """The tool answers of one turn as one observation's content: each in a hermes `<tool_response>` block."""
    return "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)


def chat_template_observation(tokenizer, texts: Sequence[str]) -> list[int]:
    """The answers as the tokenizer's own chat template renders tool messages after a turn (verl's tool agent loop,
    which MindSpeed-RL's multi-turn rollout runs): tool messages with the generation prompt, rendered after a
    system message whose rendering is then cut off."""
    base = [{"role": "system", "content": "."}]
    full = tokenizer.apply_chat_template([*base, *({"role": "tool", "content": t} for t in texts)],
                                         add_generation_prompt=True, tokenize=False)
    prefix = tokenizer.apply_chat_template(base, add_generation_prompt=False, tokenize=False)
    if not full.startswith(prefix):
        raise ValueError("the tokenizer's chat template renders a system message differently before tool messages; "
                         "set megatron_training.prompt_type to a template with format_observation")
    return tokenizer.encode(full[len(prefix):], add_special_tokens=False)


def build_multi_turn(settings: MultiTurnSettings, *, tokenizer, template, tool_client, decode) -> MultiTurn:
    """The run's MultiTurn: the registered parser, the tool servers through `tool_client`, and the answers in the
    `template`'s observation format (services/data/templates.py `encode_observation`, each answer in a hermes
    `<tool_response>` block), or, with no template, as the tokenizer's chat template renders tool messages."""
    from services.coordinator.tool_parsers import get_tool_parser

    def call_tool(call: ToolCall, call_id: str, deadline_s: float):
        return tool_client.call(call.name, call.arguments_json(), deadline_s=deadline_s, call_id=call_id)

    def observation(texts: list[str]) -> np.ndarray:
        if template is None:
            return np.asarray(chat_template_observation(tokenizer, texts), np.int32)
        return np.asarray(template.encode_observation(tokenizer, wrap_answers(texts)), np.int32)

    return MultiTurn(settings, get_tool_parser(settings.tool_parser_format), call_tool, decode, observation)
