"""Status messages that quote what a client sent: how much of a client's value is echoed back.

A gRPC status message travels in the call's trailing metadata, which a client accepts up to 8 KiB (its soft
limit; 16 KiB hard) by default, percent-encoded, so a non-ASCII character costs up to 9 bytes; a longer one
makes the client report RESOURCE_EXHAUSTED instead of the real code. So every servicer quotes a client's
value through `echo` (its repr, cut to ECHO_CHARS characters), and ends calls through `abort`, which also
caps the whole message at MAX_STATUS_CHARS as a last resort (library messages can quote values too).
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

ECHO_CHARS = 80
MAX_STATUS_CHARS = 800


def echo(value: Any) -> str:
    """`repr(value)`, cut to ECHO_CHARS characters with the full length said, for quoting client input."""
    text = repr(value)
    if len(text) <= ECHO_CHARS:
        return text
    return f"{text[:ECHO_CHARS]}... ({len(text)} characters)"


def clip_status(message: str) -> str:
    """`message` cut to MAX_STATUS_CHARS characters."""
    if len(message) <= MAX_STATUS_CHARS:
        return message
    return f"{message[:MAX_STATUS_CHARS]}... (message cut from {len(message)} characters)"


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """`context.abort` with the message capped (see module docstring)."""
    context.abort(code, clip_status(message))
    raise AssertionError("unreachable: context.abort raises")  # for type checkers
