"""The tools' pure parts as case tables: ReTool's code rewrite, SandboxFusion answers, the arguments check."""

from __future__ import annotations

import pytest

from services.tools.arguments import ArgumentsError, check_arguments, parse_arguments
from services.tools.code_interpreter import read_run_answer, retool_code
from services.tools.outcome import Status
from services.tools.search import passages_to_string


@pytest.mark.parametrize(("code", "expected"), [
    # upstream: the last line's value is printed
    ("x = 6\nx * 7", "x = 6\nprint(x * 7)"),
    # the first ```python block is what runs, stripped
    ("text\n```python\n1 + 1\n```\nmore\n```python\n2\n```", "print(1 + 1)"),
    # a last line that already prints is left alone (upstream: startswith("print"))
    ("print(1)", "print(1)"),
    # trailing blank lines do not hide the last line
    ("1 + 1\n\n", "print(1 + 1)\n\n"),
    # departures, where upstream's rewrite breaks valid code: an assignment (print(x = 5) raises TypeError),
    ("x = 5", "x = 5"),
    # an indented last line (upstream: IndentationError),
    ("for i in range(2):\n    i", "for i in range(2):\n    i"),
    # an expression spanning lines (upstream would wrap only its last line),
    ("max(1,\n    2)", "max(1,\n    2)"),
    # and code that does not parse, which the sandbox reports as it stands
    ("def f(:\n  1", "def f(:\n  1"),
    ("", ""),
])
def test_retool_code(code, expected):
    assert retool_code(code) == expected


def _run(status, stdout="", stderr="", return_code=0):
    return {"status": status, "execution_time": 0.1, "return_code": return_code, "stdout": stdout, "stderr": stderr}


@pytest.mark.parametrize(("answer", "status", "text"), [
    # finished: stdout then stderr, as upstream, whatever the return code
    ({"status": "Success", "run_result": _run("Finished", "1\n")}, Status.OK, "1\n"),
    ({"status": "Failed", "run_result": _run("Finished", "a\n", "Traceback...\n", 1)}, Status.OK, "a\nTraceback...\n"),
    # a compiled language that did not compile: the compiler's output
    ({"status": "Failed", "compile_result": _run("Finished", "", "error: x", 1), "run_result": None},
     Status.OK, "error: x"),
    # past the time limit, compile or run: TIMEOUT with the partial output
    ({"status": "Failed", "run_result": _run("TimeLimitExceeded", "part")}, Status.TIMEOUT,
     "part\nError: execution timed out after 2 s"),
    ({"status": "Failed", "compile_result": _run("TimeLimitExceeded")}, Status.TIMEOUT,
     "Error: execution timed out after 2 s"),
    # the sandbox's own failures
    ({"status": "SandboxError", "message": "boom"}, Status.TOOL_ERROR, "Error: the code sandbox failed to run the code"),
    ({"status": "Success", "run_result": _run("Error")}, Status.TOOL_ERROR,
     "Error: the code sandbox failed to run the code"),
    ({"status": "Success"}, Status.TOOL_ERROR, "Error: the code sandbox gave an unreadable answer"),
    ([1], Status.TOOL_ERROR, "Error: the code sandbox gave an unreadable answer"),
])
def test_read_run_answer(answer, status, text):
    outcome = read_run_answer(answer, 2.0)
    assert (outcome.status, outcome.text) == (status, text)
    assert (outcome.error == "") == (status is Status.OK)


PARAMETERS = {"type": "object", "required": ["n"], "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "flag": {"type": "boolean"}, "mode": {"type": "string",
                                                                                        "enum": ["a", "b"]}}}


@pytest.mark.parametrize(("arguments", "problem"), [
    ({"n": 3}, None),
    ({"n": 3.0, "x": 2, "flag": False, "mode": "a", "other": [1]}, None),  # 3.0 is an integer; extras pass
    ({"n": 3.5}, "argument 'n' must be an integer, got number"),
    ({"n": True}, "argument 'n' must be an integer, got boolean"),  # a bool is not a number
    ({"n": 1, "x": "2"}, "argument 'x' must be a number, got string"),
    ({"n": 1, "mode": "c"}, "argument 'mode' must be one of 'a', 'b', got 'c'"),
    ({}, "missing required argument 'n'"),
])
def test_check_arguments(arguments, problem):
    if problem is None:
        check_arguments(arguments, PARAMETERS)
    else:
        with pytest.raises(ArgumentsError, match=problem):
            check_arguments(arguments, PARAMETERS)


@pytest.mark.parametrize(("text", "problem"), [
    ('{"n": NaN}', "NaN is not a JSON number"),
    ("", None),  # no arguments at all: an empty object
    ('"x"', "arguments must be a JSON object, got str"),
])
def test_parse_arguments(text, problem):
    if problem is None:
        assert parse_arguments(text) == {}
    else:
        with pytest.raises(ArgumentsError, match=problem):
            parse_arguments(text)


def test_passages_as_upstream_formats_them():
    hits = [{"document": {"contents": "\"T1\"\nline one\nline two"}, "score": 2.0},
            {"document": {"contents": "no newline"}, "score": 1.0}]
    assert passages_to_string(hits) == "Doc 1 (Title: \"T1\")\nline one\nline two\n\nDoc 2 (Title: no newline)"
