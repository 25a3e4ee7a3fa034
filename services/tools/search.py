"""The search tool: MindSpeed-RL's SearchTool, a client of a retrieval server's `/retrieve` (Search-R1's API).

A call posts {"queries": query_list, "topk": topk, "return_scores": true} and answers with upstream's text: the
JSON object {"result": "..."} whose string lists each query's passages ("Doc 1 (Title: ...)\\ntext"), the
queries' blocks joined by "\\n---\\n"; {"result": "No search results found."} for none; {"result": "Search error:
..."} when the server fails. Upstream's retries kept: a 500/502/503/504 answer, a refused connection or a
timeout is retried up to 10 attempts, 1 s, 2 s, ... apart, while the call's deadline allows. `timeout` bounds
each request.
"""

from __future__ import annotations

import json
import time
from typing import Any

from services.common.config.tools import SearchConfig
from services.tools.http_json import BackendError, post_json
from services.tools.outcome import Deadline, Outcome, Status

_ATTEMPTS = 10
_RETRIED_STATUSES = (500, 502, 503, 504)
_MISSING_QUERIES = "Error: 'query_list' is missing, empty, or not a list in parameters."


def _result(text: str) -> str:
    return json.dumps({"result": text})


def passages_to_string(retrieval: list[dict[str, Any]]) -> str:
    """One query's passages as upstream's `passages2string`: "Doc i (Title: first line)\\nrest", blank-line apart."""
    out = ""
    for i, item in enumerate(retrieval):
        contents = item["document"]["contents"]
        title, _, text = contents.partition("\n")
        out += f"Doc {i + 1} (Title: {title})\n{text}\n\n"
    return out.strip()


class Search:
    """Runs calls of one search tool against its retrieval server."""

    def __init__(self, config: SearchConfig) -> None:
        self.config = config

    @property
    def default_deadline_s(self) -> float:
        return min(3600.0, self.config.timeout + 10)

    def run(self, arguments: dict[str, Any], deadline: Deadline) -> Outcome:
        queries = arguments.get("query_list")
        if not queries or not isinstance(queries, list):
            return Outcome(Status.INVALID_ARGUMENTS, _result(_MISSING_QUERIES), "query_list missing or empty")
        if not all(isinstance(q, str) for q in queries):
            return Outcome(Status.INVALID_ARGUMENTS, _result("Error: every entry of 'query_list' must be a string."),
                           "query_list holds a non-string")
        payload = {"queries": queries, "topk": self.config.topk, "return_scores": True}
        try:
            answer = self._post(payload, deadline)
        except BackendError as e:
            status = Status.TIMEOUT if e.kind == "timeout" else Status.TOOL_ERROR
            return Outcome(status, _result(f"Search error: {e}"), f"retrieval {e.kind}: {e}")
        try:
            results = answer.get("result", []) if isinstance(answer, dict) else None
            if results is None or not isinstance(results, list):
                raise TypeError(f"no `result` list in {str(answer)[:200]}")
            if not results:
                return Outcome(Status.OK, _result("No search results found."))
            return Outcome(Status.OK, _result("\n---\n".join(passages_to_string(r) for r in results)))
        except (KeyError, TypeError, AttributeError) as e:
            return Outcome(Status.TOOL_ERROR, _result(f"Error processing search results: {e}"),
                           f"retrieval answer unreadable: {e}")

    def _post(self, payload: dict[str, Any], deadline: Deadline) -> Any:
        last: BackendError | None = None
        for attempt in range(_ATTEMPTS):
            try:
                return post_json(self.config.retrieval_service_url, payload,
                                 min(float(self.config.timeout), deadline.remaining()))
            except BackendError as e:
                last = e
                retried = e.kind in ("timeout", "unreachable") or e.status in _RETRIED_STATUSES
                delay = attempt + 1.0
                if not retried or deadline.remaining() <= delay + 0.5:
                    raise
                time.sleep(delay)
        assert last is not None
        raise last
