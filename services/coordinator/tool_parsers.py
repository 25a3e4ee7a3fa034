"""Tool-call parsers: a model's text -> the tool calls it makes, under `rl_config.tool_parser_format`.

One pure function per format in `TOOL_PARSERS` (MindSpeed-RL's `ToolParser` registry names): text in, a list of
`ToolCall` and `ToolCallParseError` out, in the order they appear, so that the rollout answers each call in turn
and a malformed one with an error the model reads (upstream logs it and drops it, so the model never learns why
its call went unanswered).

`hermes` (Qwen2.5/Qwen3 and NousResearch Hermes templates): each call is
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`. As upstream, a block is the text between a
`<tool_call>` and the next `</tool_call>`, JSON-decoded, and needs a `name` and an `arguments` object (extra
keys are ignored). Beyond upstream: a block that is not JSON, lacks either key, has non-object arguments or
uses NaN/Infinity is a `ToolCallParseError` rather than nothing, and so is a `<tool_call>` left unclosed at the
end of the text (the caller may ignore that one when generation stopped at the length limit).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_START) + r"(.*?)" + re.escape(HERMES_END), re.DOTALL)
# How much of a malformed block an error quotes back to the model.
_QUOTE_CHARS = 200


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        """The arguments as JSON text (what rlfabric.v1.ToolCallRequest.arguments_json carries)."""
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallParseError:
    """A call the model meant to make but wrote wrongly; `message` is written for the model."""

    message: str
    raw: str  # the block's text as written


ParsedCall = ToolCall | ToolCallParseError


def _quote(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _QUOTE_CHARS else f"{text[:_QUOTE_CHARS]}..."


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_HERMES_FORMAT = f'{HERMES_START}{{"name": <tool name>, "arguments": {{...}}}}{HERMES_END}'


def _hermes_block(raw: str) -> ParsedCall:
    try:
        call = json.loads(raw, parse_constant=_refuse_constant)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        reason = f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        return ToolCallParseError(f"Error: the tool call is not valid JSON ({reason}): {_quote(raw)}. "
                                  f"Write {_HERMES_FORMAT}.", raw)
    if not isinstance(call, dict):
        return ToolCallParseError(f"Error: the tool call must be a JSON object, got {_quote(raw)}. "
                                  f"Write {_HERMES_FORMAT}.", raw)
    name, arguments = call.get("name"), call.get("arguments")
    if not isinstance(name, str) or not name:
        return ToolCallParseError(f"Error: the tool call has no \"name\" string: {_quote(raw)}. "
                                  f"Write {_HERMES_FORMAT}.", raw)
    if "arguments" not in call:
        return ToolCallParseError(f"Error: the call to {name!r} has no \"arguments\": {_quote(raw)}. "
                                  f"Write {_HERMES_FORMAT}.", raw)
    if not isinstance(arguments, dict):
        return ToolCallParseError(f"Error: the arguments of the call to {name!r} must be a JSON object, got "
                                  f"{_quote(json.dumps(arguments))}.", raw)
    return ToolCall(name, arguments)


def parse_hermes(text: str) -> list[ParsedCall]:
    """The hermes-format tool calls in `text`, in order (see the module doc)."""
    out: list[ParsedCall] = []
    end = 0
    for match in _HERMES_BLOCK.finditer(text):
        out.append(_hermes_block(match.group(1)))
        end = match.end()
    tail = text.find(HERMES_START, end)
    if tail >= 0:
        raw = text[tail + len(HERMES_START):]
        out.append(ToolCallParseError(f"Error: the tool call is not closed with {HERMES_END}: "
                                      f"{_quote(raw)}.", raw))
    return out


TOOL_PARSERS: dict[str, Callable[[str], list[ParsedCall]]] = {
    "hermes": parse_hermes,
}


def get_tool_parser(name: str) -> Callable[[str], list[ParsedCall]]:
    """The parser of `tool_parser_format` `name`; ValueError listing the supported formats otherwise."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"Unsupported tool_parser_format: {name!r}. Supported formats are: {sorted(TOOL_PARSERS)}")
    return parser
