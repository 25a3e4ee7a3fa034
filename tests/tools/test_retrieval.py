"""The BM25 retrieval server: scores worked out by hand, and Search-R1's /retrieve API over real HTTP."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest

from services.common.errors import DataError
from services.tools.retrieval import BM25Index, read_corpus, tokenize
from tests.tools.conftest import CORPUS


def _post(url: str, body: object) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bm25_scores_by_hand():
    # docs: "a b" (2 tokens), "a a c" (3), "d" (1); avgdl = 2; N = 3; k1 = 0.9, b = 0.4
    index = BM25Index(["a b", "a a c", "d"])
    # idf(a): df 2 -> ln(1 + (3 - 2 + 0.5) / 2.5) = ln(1.6); idf(b): df 1 -> ln(1 + 2.5 / 1.5) = ln(8/3)
    idf_a, idf_b = math.log(1.6), math.log(8 / 3)
    # doc 0, tf(a) = 1, dl 2: norm = 0.9 * (0.6 + 0.4 * 2 / 2) = 0.9 -> 1 / 1.9
    # doc 1, tf(a) = 2, dl 3: norm = 0.9 * (0.6 + 0.4 * 3 / 2) = 1.08 -> 2 / 3.08
    hits = index.search("a b", topk=5)
    assert [h.index for h in hits] == [0, 1]  # doc 2 shares no token: not a hit
    assert hits[0].score == pytest.approx(idf_a / 1.9 + idf_b / 1.9)
    assert hits[1].score == pytest.approx(idf_a * 2 / 3.08)
    assert index.search("A, b!", topk=1) == hits[:1]  # case and punctuation do not matter
    assert index.search("zzz", topk=3) == []


def test_ties_keep_corpus_order_and_topk_cuts():
    index = BM25Index(["x y", "x y", "x y"])
    assert [h.index for h in index.search("x", topk=2)] == [0, 1]


def test_tokenize():
    assert tokenize("Paris, FRANCE's capital") == ["paris", "france", "s", "capital"]


def test_api_with_and_without_scores(retrieval):
    status, answer = _post(retrieval.url, {"queries": ["capital of France", "river Spree"], "topk": 1,
                                           "return_scores": True})
    assert status == 200
    first, second = answer["result"]
    assert [hit["document"] for hit in first] == [CORPUS[0]]
    assert second[0]["document"] == CORPUS[1] and second[0]["score"] > 0
    status, answer = _post(retrieval.url, {"queries": ["Paris"]})  # topk: the server's (2); no scores
    assert status == 200
    assert answer == {"result": [[CORPUS[0], CORPUS[2]]]}


@pytest.mark.parametrize(("body", "detail"), [
    ({"queries": "Paris"}, "`queries` must be a list of strings"),
    ({"queries": ["a"], "topk": -1}, "`topk` must be an integer"),
    ({"queries": ["a"], "return_scores": "yes"}, "`return_scores` must be true or false"),
    (b"{not json", "the body is not JSON"),
])
def test_api_refuses_malformed_requests(retrieval, body, detail):
    status, answer = _post(retrieval.url, body)
    assert status == 422
    assert detail in answer["detail"]


def test_unknown_path_and_health(retrieval):
    status, _ = _post(retrieval.url.replace("/retrieve", "/search"), {"queries": []})
    assert status == 404
    with urllib.request.urlopen(retrieval.url.replace("/retrieve", "/health"), timeout=5) as response:
        assert json.loads(response.read()) == {"status": "ok", "documents": 4}


def test_corpus_errors_name_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "0", "contents": "ok"}\n{"id": "1", "text": "no contents"}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:2: expected an object with a string `contents`"):
        read_corpus(path)
    path.write_text('{"id": "0", "contents": "ok"}\n{oops\n')
    with pytest.raises(DataError, match=r"c\.jsonl:2: not JSON"):
        read_corpus(path)
    with pytest.raises(DataError, match="not found"):
        read_corpus(tmp_path / "missing.jsonl")
