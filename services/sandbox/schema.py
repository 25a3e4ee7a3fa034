"""SandboxFusion's `/run_code` wire format: the request checked field by field, the response built.

Field names and meanings are SandboxFusion's (`sandbox/server/sandbox_api.py` `RunCodeRequest`,
`RunCodeResponse`; `sandbox/runners/types.py` `CommandRunResult`), so its clients (MindSpeed-RL's ReTool, verl's
sandbox_fusion tool) talk to this server unchanged, and our client talks to a real SandboxFusion the same way:

    request   {code, language, compile_timeout=10, run_timeout=10, memory_limit_MB=-1, stdin=null,
               files={path: base64 | null}, fetch_files=[path], args=[]}
    response  {status: Success | Failed | SandboxError, message, compile_result, run_result, executor_pod_name,
               files={path: base64}}
    run_result {status: Finished | TimeLimitExceeded | Error, execution_time (s), return_code, stdout, stderr}

Departures, each stricter: a key SandboxFusion does not define, a wrong type, a non-positive timeout or a file path
that is absolute or climbs out with `..` is refused (HTTP 422 naming it) where SandboxFusion would ignore the key
or write outside its folder. The overall status follows SandboxFusion's `parse_run_status`: SandboxError when a
step could not run, Failed on a time-out or a non-zero return code, else Success.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any

# SandboxFusion's `Language` literal: a name outside it is a malformed request (422), as there; a name inside it
# that this server does not run is answered with status SandboxError naming the supported ones.
UPSTREAM_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust", "cuda",
    "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest", "verilog",
    "python_gpu", "lean", "swift", "racket",
)
SUPPORTED_LANGUAGES = ("python",)

# Overall statuses (SandboxFusion's RunStatus) and per-command statuses (its CommandRunStatus).
SUCCESS, FAILED, SANDBOX_ERROR = "Success", "Failed", "SandboxError"
FINISHED, TIME_LIMIT_EXCEEDED, ERROR = "Finished", "TimeLimitExceeded", "Error"


class RequestError(ValueError):
    """A malformed request: answered with HTTP 422 and this message (which names the field)."""


@dataclass(frozen=True)
class RunCodeRequest:
    """One `/run_code` request, checked. Units: seconds and MiB, as upstream."""

    code: str
    language: str
    compile_timeout: float = 10.0  # compiled languages only; python has no compile step, as upstream
    run_timeout: float | None = None  # not sent: SandboxFusion's 10 s, or the server's limit when that is lower
    memory_limit_MB: int = -1  # noqa: N815 (the wire name). -1: no per-request limit; --max-memory-mb applies
    stdin: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)  # decoded; null entries dropped, as upstream
    fetch_files: tuple[str, ...] = ()
    args: tuple[str, ...] = ()  # pytest's extra arguments upstream; python ignores them, as upstream


_FIELDS = ("code", "language", "compile_timeout", "run_timeout", "memory_limit_MB", "stdin", "files", "fetch_files",
           "args")


def parse_run_code_request(doc: Any) -> RunCodeRequest:
    """Checks a decoded JSON body; raises RequestError naming the first bad field."""
    if not isinstance(doc, dict):
        raise RequestError(f"the body must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(_FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; /run_code takes {', '.join(_FIELDS)}")
    for key in ("code", "language"):
        if key not in doc:
            raise RequestError(f"field {key!r} is required")
    code, language = doc["code"], doc["language"]
    if not isinstance(code, str):
        raise RequestError(f"field 'code' must be a string, got {type(code).__name__}")
    if language not in UPSTREAM_LANGUAGES:
        raise RequestError(f"field 'language': {str(language)[:40]!r} is not a SandboxFusion language "
                           f"({', '.join(UPSTREAM_LANGUAGES)})")
    stdin = doc.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise RequestError(f"field 'stdin' must be a string or null, got {type(stdin).__name__}")
    return RunCodeRequest(
        code=code, language=language,
        compile_timeout=_seconds(doc, "compile_timeout", 10.0),
        run_timeout=_seconds(doc, "run_timeout", 10.0) if "run_timeout" in doc else None,
        memory_limit_MB=_memory(doc), stdin=stdin, files=_files(doc.get("files", {})),
        fetch_files=tuple(_paths(doc.get("fetch_files", []), "fetch_files")),
        args=tuple(_strings(doc.get("args", []), "args")),
    )


def _seconds(doc: dict, key: str, default: float) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise RequestError(f"field {key!r} must be a positive number of seconds, got {value!r}")
    return float(value)


def _memory(doc: dict) -> int:
    value = doc.get("memory_limit_MB", -1)
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and value != -1):
        raise RequestError(f"field 'memory_limit_MB' must be a positive integer or -1 (no limit), got {value!r}")
    return value


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(f"field {key!r} must be a list of strings")
    return value


def _paths(value: Any, key: str) -> list[str]:
    paths = _strings(value, key)
    for path in paths:
        check_relative_path(path, key)
    return paths


def check_relative_path(path: str, key: str) -> None:
    """Refuses a path that could name anything outside the run's folder."""
    parts = path.replace("\\", "/").split("/")
    if not path or path.startswith("/") or ".." in parts or "\0" in path:
        raise RequestError(f"field {key!r}: {path[:80]!r} must be a relative path inside the run's folder "
                           "(no leading '/', no '..')")


def _files(value: Any) -> dict[str, bytes]:
    if not isinstance(value, dict):
        raise RequestError("field 'files' must be an object {path: base64 content or null}")
    files: dict[str, bytes] = {}
    for path, content in value.items():
        check_relative_path(path, "files")
        if content is None:  # upstream skips null entries
            continue
        if not isinstance(content, str):
            raise RequestError(f"field 'files'[{path[:80]!r}] must be base64 text or null")
        try:
            files[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RequestError(f"field 'files'[{path[:80]!r}] is not valid base64: {e}") from None
    return files


def command_result(status: str, *, execution_time: float | None = None, return_code: int | None = None,
                   stdout: str | None = None, stderr: str | None = None) -> dict[str, Any]:
    """SandboxFusion's CommandRunResult."""
    return {"status": status, "execution_time": execution_time, "return_code": return_code, "stdout": stdout,
            "stderr": stderr}


def overall_status(run_result: dict[str, Any] | None) -> str:
    """SandboxFusion's `parse_run_status` for a run without a compile step."""
    if run_result is None or run_result["status"] == ERROR:
        return SANDBOX_ERROR
    if run_result["status"] == TIME_LIMIT_EXCEEDED or run_result["return_code"] != 0:
        return FAILED
    return SUCCESS


def run_code_response(*, run_result: dict[str, Any] | None, message: str = "",
                      files: dict[str, str] | None = None, status: str | None = None) -> dict[str, Any]:
    """SandboxFusion's RunCodeResponse; `status` defaults to what `run_result` implies."""
    return {"status": status or overall_status(run_result), "message": message, "compile_result": None,
            "run_result": run_result, "executor_pod_name": None, "files": files or {}}


def sandbox_error(message: str) -> dict[str, Any]:
    """A request this server could not run (unsupported language, a limit it does not grant, a full queue)."""
    return run_code_response(run_result=None, message=message, status=SANDBOX_ERROR)
