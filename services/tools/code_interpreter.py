"""The code interpreter: MindSpeed-RL's ReTool / SandboxFusionTool, a client of a SandboxFusion `/run_code` server.

A call posts {code, language, compile_timeout, run_timeout, memory_limit_MB, stdin, files, fetch_files} to
`sandbox_fusion_url` and answers with the run's stdout + stderr, as upstream. Upstream's choices kept:
- `timeout` and `language` may come in the call's arguments (beside `code`), else `default_timeout` and
  `default_language`; compile and run each get the timeout;
- a Gateway Timeout (504) is retried, up to 3 attempts, 1 s then 2 s apart;
- ReTool runs the first ```python block of `code` when there is one, and prints the value of a last line that is
  not a print (`retool_code`).
Departures, each because upstream's answer hides what happened from the model or breaks valid code:
- a run past its time limit answers TIMEOUT with its partial output, and a sandbox failure answers TOOL_ERROR
  naming it (upstream answers "no stdout here" to both);
- ReTool's print wrapper applies only when the last line is a top-level expression (upstream wraps any last line,
  so `x = 5` became `print(x = 5)` and an indented last line an IndentationError);
- the run's time limit is cut to what is left of the call's deadline, so the sandbox, not the caller, stops it.
"""

from __future__ import annotations

import ast
import math
import re
import time
from typing import Any

from services.common.config.tools import SANDBOX_LANGUAGES, CodeInterpreterConfig
from services.tools.http_json import BackendError, post_json
from services.tools.outcome import Deadline, Outcome, Status

_PYTHON_BLOCK = re.compile(r"```python(.*?)```", re.DOTALL)
# Seconds of a call's deadline kept for the HTTP exchange around the sandbox's run.
_EXCHANGE_MARGIN_S = 0.5
_RETRIES_504 = 3


def retool_code(code: str) -> str:
    """ReTool's rewrite of `code`: its first ```python block if any, and `print(...)` around a last line that is
    a top-level expression and not already a print."""
    blocks = _PYTHON_BLOCK.findall(code)
    if blocks:
        code = blocks[0].strip()
    lines = code.split("\n")
    last = next((i for i in range(len(lines) - 1, -1, -1) if lines[i] != ""), None)
    if last is None or lines[last].startswith("print"):
        return code
    try:
        body = ast.parse(code).body
    except SyntaxError:
        return code  # the sandbox reports the error as it stands
    tail = body[-1] if body else None
    if isinstance(tail, ast.Expr) and tail.lineno == tail.end_lineno == last + 1 and tail.col_offset == 0:
        lines[last] = f"print({lines[last]})"
    return "\n".join(lines)


class CodeInterpreter:
    """Runs calls of one code-interpreter tool against its SandboxFusion server."""

    def __init__(self, config: CodeInterpreterConfig, *, retool: bool) -> None:
        self.config = config
        self.retool = retool

    @property
    def default_deadline_s(self) -> float:
        # Upstream's request timeout: compile + run + 10 s for the API.
        return min(3600.0, 2 * self.config.default_timeout + 10)

    def run(self, arguments: dict[str, Any], deadline: Deadline) -> Outcome:
        code = arguments.get("code", "")
        code = code if isinstance(code, str) else str(code)
        if self.retool:
            code = retool_code(code)
        timeout = arguments.get("timeout", self.config.default_timeout)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) \
                or timeout <= 0:
            return Outcome(Status.INVALID_ARGUMENTS, f"Error: argument 'timeout' must be a positive number of "
                                                     f"seconds, got {timeout!r}", "bad timeout argument")
        language = arguments.get("language", self.config.default_language)
        if language not in SANDBOX_LANGUAGES:
            return Outcome(Status.INVALID_ARGUMENTS, f"Error: unsupported language {language!r}; supported: "
                                                     f"{', '.join(SANDBOX_LANGUAGES)}", "unsupported language")
        limit = min(float(timeout), deadline.remaining() - _EXCHANGE_MARGIN_S)
        if limit <= 0:
            return Outcome(Status.TIMEOUT, "Error: no time was left to run the code", "deadline before the run")
        payload = {
            "compile_timeout": limit, "run_timeout": limit, "code": code, "stdin": None,
            "memory_limit_MB": self.config.memory_limit_mb, "language": language, "files": {}, "fetch_files": [],
        }
        try:
            answer = self._post(payload, deadline)
        except BackendError as e:
            if e.kind == "timeout":
                return Outcome(Status.TIMEOUT, f"Error: the code sandbox did not answer within {limit:g} s",
                               f"sandbox timeout: {e}")
            return Outcome(Status.TOOL_ERROR, "Error: the code sandbox failed; the code was not run",
                           f"sandbox {e.kind}: {e}")
        return read_run_answer(answer, limit)

    def _post(self, payload: dict[str, Any], deadline: Deadline) -> Any:
        for attempt in range(_RETRIES_504):
            try:
                return post_json(self.config.sandbox_fusion_url, payload, deadline.remaining())
            except BackendError as e:
                delay = attempt + 1.0
                if e.status != 504 or attempt == _RETRIES_504 - 1 or deadline.remaining() <= delay + 1.0:
                    raise
                time.sleep(delay)
        raise AssertionError("unreachable")


def _output(result: dict[str, Any]) -> str:
    return f"{result.get('stdout') or ''}{result.get('stderr') or ''}"


def read_run_answer(answer: Any, limit_s: float) -> Outcome:
    """The Outcome of a SandboxFusion RunCodeResponse (`status`, `message`, `compile_result`, `run_result`, each
    result holding `status` Finished|Error|TimeLimitExceeded, `return_code`, `stdout`, `stderr`)."""
    if not isinstance(answer, dict):
        return Outcome(Status.TOOL_ERROR, "Error: the code sandbox gave an unreadable answer",
                       f"sandbox answer is not an object: {str(answer)[:200]}")
    compiled, run = answer.get("compile_result"), answer.get("run_result")
    compiled = compiled if isinstance(compiled, dict) else None
    run = run if isinstance(run, dict) else None
    for result in (compiled, run):
        if result is not None and result.get("status") == "TimeLimitExceeded":
            partial = _output(result)
            if partial and not partial.endswith("\n"):
                partial += "\n"
            return Outcome(Status.TIMEOUT, f"{partial}Error: execution timed out after {limit_s:g} s",
                           "code ran past its time limit")
    if answer.get("status") == "SandboxError" or any(r is not None and r.get("status") == "Error"
                                                     for r in (compiled, run)):
        message = str(answer.get("message") or "")[:500]
        return Outcome(Status.TOOL_ERROR, "Error: the code sandbox failed to run the code",
                       f"sandbox error: {message or 'no message'}")
    if run is None and compiled is not None:  # compilation failed: the compiler's output is the answer
        return Outcome(Status.OK, _output(compiled))
    if run is None or run.get("status") != "Finished":
        return Outcome(Status.TOOL_ERROR, "Error: the code sandbox gave an unreadable answer",
                       f"sandbox answer without a finished run: {str(answer)[:200]}")
    return Outcome(Status.OK, _output(run))
