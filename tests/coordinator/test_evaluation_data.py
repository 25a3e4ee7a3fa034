"""Eval sets: the named files resolve, answers of every shape become one ground-truth text, prompts use the
template, and bad rows are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import DataError
from services.coordinator.evaluation_data import EVAL_SETS, answer_text, load_problems, resolve_dataset


@pytest.mark.parametrize(("value", "expected"), [
    (" 42 ", "42"),                          # text, stripped
    (27.0, "27"),                            # AMC's floats with an integral value
    (2.5, "2.5"),
    (7, "7"),
    (["\\frac{1}{2}"], "\\frac{1}{2}"),      # Minerva: a list of one answer
    (["3", "5"], "3, 5"),                    # OlympiadBench: several answers, listed
])
def test_answer_text(value: object, expected: str) -> None:
    assert answer_text(value, "row 0") == expected


@pytest.mark.parametrize("value", [None, True, [], {"a": 1}])
def test_answer_text_refuses_other_shapes(value: object) -> None:
    with pytest.raises(DataError, match="row 3"):
        answer_text(value, "row 3")


def test_every_named_eval_set_resolves_and_loads(shared_data: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for name in EVAL_SETS:
        resolved, path = resolve_dataset(name, shared_data / "eval")
        problems, too_long = load_problems(resolved, path, tok, "qwen_r1", limit=3)
        assert resolved == name and len(problems) == 3 and too_long == 0
        assert all(p.answer and p.problem for p in problems)
        # The qwen_r1 frame: ChatML user turn, the problem inside it, the assistant turn opened.
        text = tok.decode(problems[0].prompt_ids.tolist())
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert problems[0].problem[:40] in text


def test_unknown_dataset_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="math500"):
        resolve_dataset("math-5000", tmp_path)


def test_a_file_and_its_row_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps({"problem": "1+2=", "answer": 3}) + "\n" + json.dumps({"problem": "x" * 400,
                                                                                         "answer": "1"}) + "\n")
    name, path = resolve_dataset(str(good))
    problems, too_long = load_problems(name, path, tok, "empty", max_prompt_length=50)
    assert name == "mine" and [p.answer for p in problems] == ["3"] and too_long == 1
    assert tok.decode(problems[0].prompt_ids.tolist()) == "1+2="
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+2=", "answer": 3}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl.*'problem'"):
        load_problems("bad", bad, tok, "empty")
