"""What a tool call ends as (`Outcome`), and the deadline every step of a call reads (`Deadline`)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass


class Status(enum.Enum):
    """How a call ended; the values are rlfabric.v1.ToolCallStatus's names without the prefix."""

    OK = "OK"
    TOOL_ERROR = "TOOL_ERROR"
    TIMEOUT = "TIMEOUT"
    INVALID_ARGUMENTS = "INVALID_ARGUMENTS"


@dataclass(frozen=True)
class Outcome:
    """The answer to one call: `text` for the model, `error` (empty when OK) for logs and metrics."""

    status: Status
    text: str
    error: str = ""


class Deadline:
    """A point on the monotonic clock; `remaining()` is never negative."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at
