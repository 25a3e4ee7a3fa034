"""POST a JSON body, read a JSON answer: the one HTTP client of the tools (standard library only).

Every failure is a `BackendError` with a `kind` the tools turn into a status: "timeout" (no answer in time),
"unreachable" (no connection), "http" (an error status, `status` set), "bad_response" (not JSON). Nothing else
escapes, so a backend that misbehaves in any way costs one call, never the server.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

# Most bytes read from a backend's answer: a sandbox that returns a flood of output must not exhaust memory.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024


class BackendError(Exception):
    """A backend call that failed; `kind` says how, `status` is the HTTP status of an "http" failure."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


def post_json(url: str, payload: dict[str, Any], timeout_s: float) -> Any:
    """POSTs `payload` as JSON to `url` and returns the decoded JSON answer.

    `timeout_s` bounds the connection and every read (the callers also bound the whole call: host.py).
    """
    if timeout_s <= 0:
        raise BackendError("timeout", "no time left for the request")
    body = json.dumps(payload).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as e:
        detail = ""
        try:
            detail = e.read(2000).decode("utf-8", errors="replace").strip()
        except OSError:
            pass
        raise BackendError("http", f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else ""), e.code) from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise BackendError("timeout", f"no answer within {timeout_s:.1f} s") from e
        raise BackendError("unreachable", f"cannot reach {url}: {e.reason}") from e
    except TimeoutError as e:
        raise BackendError("timeout", f"no answer within {timeout_s:.1f} s") from e
    except (OSError, ValueError) as e:  # a reset connection, a malformed answer line
        raise BackendError("unreachable", f"connection to {url} failed: {e}") from e
    if len(raw) > MAX_RESPONSE_BYTES:
        raise BackendError("bad_response", f"answer larger than {MAX_RESPONSE_BYTES} bytes")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BackendError("bad_response", f"answer is not JSON: {raw[:200]!r}") from e
