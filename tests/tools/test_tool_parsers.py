"""The hermes tool-call parser: a case table, one comment per case."""

from __future__ import annotations

import pytest

from services.coordinator.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    ToolCallParseError,
    get_tool_parser,
    parse_hermes,
)

CODE = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "expected"), [
    # no call at all
    ("The answer is \\boxed{4}.", []),
    # Qwen2.5's layout: newlines around the JSON
    (f"Let me compute.\n{CODE}", [ToolCall("code_interpreter", {"code": "print(1)"})]),
    # two calls in one turn, in order; an integer past 2^53 survives
    ('<tool_call>{"name": "a", "arguments": {"n": 12345678901234567890}}</tool_call> and '
     '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
     [ToolCall("a", {"n": 12345678901234567890}), ToolCall("b", {})]),
    # extra keys beside name and arguments are ignored
    ('<tool_call>{"name": "a", "arguments": {"x": 1}, "id": "call_0"}</tool_call>', [ToolCall("a", {"x": 1})]),
    # a stray closing tag without an opening one is text
    ("done </tool_call>", []),
])
def test_well_formed(text, expected):
    assert parse_hermes(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    # not JSON: the model is told where and how to write it
    ("<tool_call>{name: a}</tool_call>",
     'Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2): '
     '{name: a}. Write <tool_call>{"name": <tool name>, "arguments": {...}}</tool_call>.'),
    # a JSON list, not an object
    ("<tool_call>[1]</tool_call>", "Error: the tool call must be a JSON object, got [1]."),
    # no name
    ('<tool_call>{"arguments": {}}</tool_call>', 'Error: the tool call has no "name" string'),
    # no arguments (upstream drops the call with a KeyError logged)
    ('<tool_call>{"name": "a"}</tool_call>', "Error: the call to 'a' has no \"arguments\""),
    # arguments as a JSON string of an object: not an object
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>',
     "Error: the arguments of the call to 'a' must be a JSON object, got \"{\\\"x\\\": 1}\"."),
    # NaN is not JSON
    ('<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>',
     "Error: the tool call is not valid JSON (NaN is not valid JSON)"),
    # opened and never closed
    ('<tool_call>{"name": "a", "arguments": {', 'Error: the tool call is not closed with </tool_call>: '
                                                '{"name": "a", "arguments": {.'),
])
def test_malformed_calls_are_errors_the_model_sees(text, message):
    (error,) = parse_hermes(text)
    assert isinstance(error, ToolCallParseError)
    assert error.message.startswith(message), error.message


def test_good_and_bad_calls_keep_their_order():
    text = f'{CODE}<tool_call>oops</tool_call>{CODE}<tool_call>{{"name": "x"'
    kinds = [type(c).__name__ for c in parse_hermes(text)]
    assert kinds == ["ToolCall", "ToolCallParseError", "ToolCall", "ToolCallParseError"]


def test_a_long_malformed_block_is_quoted_short():
    (error,) = parse_hermes("<tool_call>" + "x" * 1000 + "</tool_call>")
    assert len(error.message) < 400 and error.raw == "x" * 1000


def test_arguments_json_round_trips():
    (call,) = parse_hermes('<tool_call>{"name": "s", "arguments": {"q": "café", "n": 2}}</tool_call>')
    assert call.arguments_json() == '{"q": "café", "n": 2}'


def test_registry():
    assert TOOL_PARSERS == {"hermes": parse_hermes}
    assert get_tool_parser("hermes") is parse_hermes
    with pytest.raises(ValueError, match=r"Unsupported tool_parser_format: 'qwen'\. Supported formats are: "
                                         r"\['hermes'\]"):
        get_tool_parser("qwen")
