"""Handlers: which raw fields become prompt, answer and system text, and which rows are dropped."""

from __future__ import annotations

import pytest

from services.common.errors import DataError
from services.data.handlers import Dropped, RowTexts, get_handler
from services.data.readers import Row

DEEPSCALER_KEYS = {"prompt": "problem", "query": "", "response": "answer", "system": ""}
MATH17K_KEYS = {"prompt": "prompt", "query": "", "response": "reward_model", "system": ""}


def _extract(handler_name, map_keys, data, additional=("labels",)):
    return get_handler(handler_name, map_keys, additional).extract(Row(7, data, "in.json row 7"))


@pytest.mark.parametrize(("handler", "map_keys", "data", "expected"), [
    # DeepScaleR: problem -> prompt, answer -> response; extra fields ignored.
    ("R1AlpacaStyleInstructionHandler", DEEPSCALER_KEYS,
     {"problem": "P", "solution": "S", "answer": "A", "difficulty": 1.0}, ("P", "A", "")),
    # query is joined to the prompt with a newline; system comes through.
    ("R1AlpacaStyleInstructionHandler", {"prompt": "q", "query": "x", "response": "a", "system": "s"},
     {"q": "Q", "x": "X", "a": "A", "s": "SYS"}, ("Q\nX", "A", "SYS")),
    # No map_keys: the Alpaca names instruction/input/output, each optional except as data has them.
    ("R1AlpacaStyleInstructionHandler", None, {"instruction": "I", "output": "O"}, ("I", "O", "")),
    # Numbers become text (AMC answers are floats).
    ("R1AlpacaStyleInstructionHandler", DEEPSCALER_KEYS, {"problem": "P", "answer": 27.0}, ("P", "27.0", "")),
    # A one-element answer list is that answer.
    ("R1AlpacaStyleInstructionHandler", DEEPSCALER_KEYS, {"problem": "P", "answer": ["4"]}, ("P", "4", "")),
    # DAPO-Math-17k: first chat message's content, reward_model.ground_truth.
    ("Math17kAlpacaStyleInstructionHandler", MATH17K_KEYS,
     {"prompt": [{"content": "C", "role": "user"}], "reward_model": {"ground_truth": "-3", "style": "rule"}},
     ("C", "-3", "")),
    # Dotted paths reach nested fields with either handler.
    ("R1AlpacaStyleInstructionHandler", {"prompt": "extra.q", "response": "reward_model.ground_truth"},
     {"extra": {"q": "Q"}, "reward_model": {"ground_truth": "9"}}, ("Q", "9", "")),
])
def test_field_mapping(handler, map_keys, data, expected):
    out = _extract(handler, map_keys, data)
    assert isinstance(out, RowTexts)
    assert (out.prompt, out.response, out.system) == expected
    assert out.index == 7


@pytest.mark.parametrize(("data", "reason"), [
    ({"problem": "P", "answer": None}, "null_response"),
    ({"problem": "P", "answer": ""}, "empty_response"),
    ({"problem": "P", "answer": "  \n"}, "empty_response"),
    ({"problem": None, "answer": "A"}, "null_prompt"),
    ({"problem": " ", "answer": "A"}, "empty_prompt"),
    ({"problem": "P", "answer": ["1", "2"]}, "multiple_responses"),
])
def test_dropped_rows(data, reason):
    assert _extract("R1AlpacaStyleInstructionHandler", DEEPSCALER_KEYS, data) == Dropped(7, reason)


def test_missing_field_names_row_and_existing_fields():
    with pytest.raises(DataError, match=r"in.json row 7: field 'answer' \(map_keys.response\) not found; "
                                        r"the row has fields \['problem', 'solution'\]"):
        _extract("R1AlpacaStyleInstructionHandler", DEEPSCALER_KEYS, {"problem": "P", "solution": "S"})


@pytest.mark.parametrize(("handler", "map_keys", "data", "match"), [
    # R1 expects text; a chat list points at the Math17k handler.
    ("R1AlpacaStyleInstructionHandler", MATH17K_KEYS,
     {"prompt": [{"content": "C"}], "reward_model": "1"}, "is a list.*use Math17kAlpacaStyleInstructionHandler"),
    # an object answer points at the dotted path.
    ("R1AlpacaStyleInstructionHandler", MATH17K_KEYS,
     {"prompt": "C", "reward_model": {"ground_truth": "1"}}, "reward_model.ground_truth"),
    ("Math17kAlpacaStyleInstructionHandler", MATH17K_KEYS,
     {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}, "list of chat messages with `content`"),
    ("Math17kAlpacaStyleInstructionHandler", MATH17K_KEYS,
     {"prompt": "C", "reward_model": {"style": "rule"}}, "without `ground_truth`; it has \\['style'\\]"),
])
def test_wrong_shapes_are_errors(handler, map_keys, data, match):
    with pytest.raises(DataError, match=match):
        _extract(handler, map_keys, data)


def test_additional_keys_besides_labels_are_text_fields():
    out = _extract("R1AlpacaStyleInstructionHandler", DEEPSCALER_KEYS, {"problem": "P", "answer": "A", "hint": "H"},
                   additional=("labels", "hint"))
    assert out.extras == {"hint": "H"}
    with pytest.raises(DataError, match=r"field 'hint' \(dataset_additional_keys\) not found"):
        _extract("R1AlpacaStyleInstructionHandler", DEEPSCALER_KEYS, {"problem": "P", "answer": "A"},
                 additional=("labels", "hint"))


def test_unknown_handler_lists_valid_names():
    with pytest.raises(DataError, match="unknown handler_name 'AlpacaHandler'; valid names: "
                                        "Math17kAlpacaStyleInstructionHandler, R1AlpacaStyleInstructionHandler"):
        get_handler("AlpacaHandler", None)
