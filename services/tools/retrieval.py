"""A small retrieval server for tests and demos: BM25 over a corpus JSONL, speaking Search-R1's `/retrieve` API.

Corpus: one JSON object per line with a string `contents` ("Title\\ntext", Search-R1's wiki-18 layout) and
usually an `id`; the row is what a hit returns as its `document`. API (the one MindSpeed-RL's SearchTool and
verl's search tool call):

    POST /retrieve  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
    200 {"result": [[{"document": {"id": ..., "contents": ...}, "score": 7.1}, ...], ...]}   one list per query
        without return_scores each hit is the document itself; topk null or 0: the server's --topk
    422 {"detail": "..."} for a malformed request (as FastAPI answers), 404 elsewhere; GET /health for probes

Scoring is Lucene's BM25 (what Search-R1's BM25 retriever runs through Pyserini): k1 0.9, b 0.4,
idf = ln(1 + (N - df + 0.5) / (df + 0.5)), per query token (a repeated token counts again), over lower-cased
`\\w+` tokens (no stemming). Only documents sharing a token with the query are hits, best first, ties by corpus
order. Standard library only; the index is built in memory at start.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from services.common.errors import DataError
from services.common.jsonl import json_lines

logger = logging.getLogger(__name__)

_TOKEN = re.compile(r"\w+")
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_TOPK = 1000


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens of `text`."""
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True)
class Hit:
    """A retrieved document: its corpus index and BM25 score."""

    index: int
    score: float


class BM25Index:
    """An in-memory BM25 index over `documents` (see the module doc for the formula)."""

    def __init__(self, documents: list[str], *, k1: float = 0.9, b: float = 0.4) -> None:
        self.k1, self.b = k1, b
        self._postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self._lengths: list[int] = []
        for index, text in enumerate(documents):
            tokens = tokenize(text)
            self._lengths.append(len(tokens))
            for term, tf in Counter(tokens).items():
                self._postings[term].append((index, tf))
        self.size = len(documents)
        self._avgdl = sum(self._lengths) / self.size if self.size else 0.0

    def idf(self, term: str) -> float:
        df = len(self._postings.get(term, ()))
        return math.log(1 + (self.size - df + 0.5) / (df + 0.5))

    def search(self, query: str, topk: int) -> list[Hit]:
        """The `topk` best documents sharing a token with `query`, best first (ties: corpus order)."""
        scores: dict[int, float] = defaultdict(float)
        for term in tokenize(query):
            postings = self._postings.get(term)
            if not postings:
                continue
            idf = self.idf(term)
            for index, tf in postings:
                norm = self.k1 * (1 - self.b + self.b * self._lengths[index] / self._avgdl)
                scores[index] += idf * tf / (tf + norm)
        ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:topk]
        return [Hit(index, score) for index, score in ranked]


def read_corpus(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a corpus JSONL; DataError naming the file and line of a row without a string `contents`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"corpus {path}: not found" + (" (a directory; pass a .jsonl file)" if path.is_dir() else ""))
    rows = []
    for number, row in json_lines(path, "corpus"):
        if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
            raise DataError(f"corpus {path}:{number}: expected an object with a string `contents` "
                            "(\"Title\\ntext\", Search-R1's layout)")
        rows.append(row)
    if not rows:
        raise DataError(f"corpus {path}: no documents")
    return rows


class RequestError(ValueError):
    """A malformed /retrieve request; the message names the field."""


def answer_retrieve(body: Any, index: BM25Index, rows: list[dict[str, Any]], default_topk: int) -> dict[str, Any]:
    """The /retrieve answer to the decoded request `body` (RequestError for a malformed one)."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object {queries, topk, return_scores}")
    queries = body.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError("`queries` must be a list of strings")
    topk = body.get("topk")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or not 0 <= topk <= MAX_TOPK):
        raise RequestError(f"`topk` must be an integer in 0..{MAX_TOPK} or null")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError("`return_scores` must be true or false")
    topk = topk or default_topk  # Search-R1: a missing, null or 0 topk means the server's
    result = []
    for query in queries:
        hits = index.search(query, topk)
        if return_scores:
            result.append([{"document": rows[h.index], "score": h.score} for h in hits])
        else:
            result.append([rows[h.index] for h in hits])
    return {"result": result}


class RetrievalServer:
    """The HTTP server; `start()` serves from a daemon thread, `url` is its /retrieve URL."""

    def __init__(self, corpus: str | Path, *, host: str = "127.0.0.1", port: int = 0, topk: int = 3) -> None:
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"--topk must be in 1..{MAX_TOPK}, got {topk}")
        self.rows = read_corpus(corpus)
        self.index = BM25Index([row["contents"] for row in self.rows])
        self.topk = topk
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/retrieve"

    def start(self) -> RetrievalServer:
        # A short poll keeps stop() quick (shutdown waits for the serving loop's next poll).
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="retrieval",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> RetrievalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler(server: RetrievalServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, doc: dict[str, Any]) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"status": "ok", "documents": server.index.size})
            else:
                self._reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if self.path != "/retrieve":
                self.rfile.read(min(length, MAX_BODY_BYTES))
                self._reply(404, {"detail": "Not Found"})
                return
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                self._reply(413, {"detail": f"body over {MAX_BODY_BYTES} bytes"})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"null")
                self._reply(200, answer_retrieve(body, server.index, server.rows, server.topk))
            except (json.JSONDecodeError, UnicodeDecodeError):
                self._reply(422, {"detail": "the body is not JSON"})
            except RequestError as e:
                self._reply(422, {"detail": str(e)})

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("retrieval %s - %s", self.address_string(), format % args)

    return Handler
