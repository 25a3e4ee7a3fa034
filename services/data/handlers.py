"""MindSpeed-RL's instruction handlers: which raw fields of a row become the prompt, answer and system text.

`map_keys` names the raw field feeding each slot (`prompt`, `query`, `response`, `system`); an empty name
leaves the slot unused, and slots it does not mention fall back to the Alpaca names `instruction`, `input`,
`output` when the row has them. A name may be a dotted path into nested objects (`reward_model.ground_truth`).
The user turn is `prompt` and `query` joined by a newline (each only when non-empty).

- `R1AlpacaStyleInstructionHandler` (DeepScaleR: `{prompt: problem, response: answer}`): text fields.
- `Math17kAlpacaStyleInstructionHandler` (DAPO-Math-17k: `{prompt: prompt, response: reward_model}`): also
  takes a chat list as the prompt (the first message's `content`) and an object as the response (its
  `ground_truth`).

A row whose user turn or answer is null (`null_prompt`, `null_response`) or blank (`empty_prompt`,
`empty_response`) is dropped with that reason rather than written with an empty answer that no reward could
ever match. Numbers (some eval sets store
answers as floats) become their decimal text. A field a row lacks is an error naming the row and the fields
it has; so is a value of the wrong shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import DataError
from services.data.readers import Row

DROP_NULL_PROMPT = "null_prompt"  # the prompt field is null (or an optional field is absent)
DROP_EMPTY_PROMPT = "empty_prompt"  # the prompt text is empty or whitespace
DROP_NULL_RESPONSE = "null_response"
DROP_EMPTY_RESPONSE = "empty_response"
DROP_MULTIPLE_RESPONSES = "multiple_responses"  # a response list without exactly one entry
DROP_TOO_LONG = "too_long"  # a field of seq_length tokens or more
DROP_REASONS = (DROP_NULL_PROMPT, DROP_EMPTY_PROMPT, DROP_NULL_RESPONSE, DROP_EMPTY_RESPONSE,
                DROP_MULTIPLE_RESPONSES, DROP_TOO_LONG)

# MindSpeed-RL's defaults for slots map_keys does not set (LlamaFactory's Alpaca column names).
ALPACA_DEFAULT_FIELDS = {"prompt": "instruction", "query": "input", "response": "output", "system": ""}
LABELS_KEY = "labels"

_MISSING = object()


@dataclass(frozen=True)
class RowTexts:
    """The texts one row contributes: the user turn, the ground-truth answer, the system text, extras."""

    index: int
    prompt: str
    response: str
    system: str
    extras: Mapping[str, str]


@dataclass(frozen=True)
class Dropped:
    """A row left out, and why (one of `DROP_REASONS`)."""

    index: int
    reason: str


def _lookup(data: Mapping[str, Any], path: str) -> Any:
    if path in data:
        return data[path]
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _scalar_text(value: Any) -> str | None:
    """Text for a string or a number; None for null; raises TypeError for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise TypeError(type(value).__name__)


class InstructionHandler:
    """Shared field mapping; subclasses say which value shapes they accept for prompt and response."""

    name = "InstructionHandler"
    accepts_chat_prompt = False
    accepts_object_response = False

    def __init__(self, map_keys: Mapping[str, str] | None, additional_keys: Sequence[str] = ()) -> None:
        given = dict(map_keys or {})
        self.fields = {slot: given.get(slot, default) for slot, default in ALPACA_DEFAULT_FIELDS.items()}
        # Only names the user wrote must exist in every row; the Alpaca fallbacks are optional.
        self.required = {slot for slot, name in given.items() if name}
        self.extra_keys = [k for k in additional_keys if k != LABELS_KEY]

    def _field(self, row: Row, slot: str) -> Any:
        name = self.fields[slot]
        if not name:
            return None
        value = _lookup(row.data, name)
        if value is _MISSING:
            if slot in self.required:
                raise DataError(f"{row.where}: field {name!r} (map_keys.{slot}) not found; "
                                f"the row has fields {sorted(row.data)}")
            return None
        return value

    def _text(self, row: Row, slot: str, value: Any, hint: str = "") -> str | None:
        try:
            return _scalar_text(value)
        except TypeError as exc:
            raise DataError(f"{row.where}: field {self.fields[slot]!r} (map_keys.{slot}) is a {exc}, "
                            f"{self.name} expects text{hint}") from exc

    def _prompt_text(self, row: Row, value: Any) -> str | None:
        if self.accepts_chat_prompt and isinstance(value, list):
            first = value[0] if value else None
            if not isinstance(first, Mapping) or "content" not in first:
                raise DataError(f"{row.where}: field {self.fields['prompt']!r} (map_keys.prompt) must be a "
                                f"list of chat messages with `content`, got {value!r:.200}")
            return self._text(row, "prompt", first["content"])
        return self._text(row, "prompt", value, hint=(
            "; for a chat-message list use Math17kAlpacaStyleInstructionHandler" if isinstance(value, list)
            else ""))

    def _response_text(self, row: Row, value: Any) -> str | None | Dropped:
        if self.accepts_object_response and isinstance(value, Mapping):
            if "ground_truth" not in value:
                raise DataError(f"{row.where}: field {self.fields['response']!r} (map_keys.response) is an "
                                f"object without `ground_truth`; it has {sorted(value)}")
            value = value["ground_truth"]
        if isinstance(value, list):
            # Upstream treats anything but exactly one response as an invalid sample.
            if len(value) != 1:
                return Dropped(row.index, DROP_MULTIPLE_RESPONSES)
            value = value[0]
        return self._text(row, "response", value, hint=(
            "; name the nested field with a dotted path such as reward_model.ground_truth"
            if isinstance(value, Mapping) else ""))

    def extract(self, row: Row) -> RowTexts | Dropped:
        """The texts of `row`, or why it is dropped; raises `DataError` for missing or malformed fields."""
        parts = [self._prompt_text(row, self._field(row, "prompt")),
                 self._text(row, "query", self._field(row, "query"))]
        prompt = "\n".join(p for p in parts if p)
        response = self._response_text(row, self._field(row, "response"))
        system = self._text(row, "system", self._field(row, "system")) or ""
        if not prompt.strip():
            return Dropped(row.index, DROP_NULL_PROMPT if all(p is None for p in parts) else DROP_EMPTY_PROMPT)
        if isinstance(response, Dropped):
            return response
        if response is None:
            return Dropped(row.index, DROP_NULL_RESPONSE)
        if not response.strip():
            return Dropped(row.index, DROP_EMPTY_RESPONSE)
        extras = {}
        for key in self.extra_keys:
            value = _lookup(row.data, key)
            if value is _MISSING:
                raise DataError(f"{row.where}: field {key!r} (dataset_additional_keys) not found; "
                                f"the row has fields {sorted(row.data)}")
            try:
                extras[key] = _scalar_text(value) or ""
            except TypeError as exc:
                raise DataError(f"{row.where}: field {key!r} (dataset_additional_keys) is a {exc}; "
                                f"only text or numbers can be tokenised") from exc
        return RowTexts(row.index, prompt, response, system, extras)


class R1AlpacaStyleInstructionHandler(InstructionHandler):
    """DeepScaleR-style rows: text prompt and text answer fields."""

    name = "R1AlpacaStyleInstructionHandler"


class Math17kAlpacaStyleInstructionHandler(InstructionHandler):
    """DAPO-Math-17k rows: chat-list prompt (first message) and `reward_model` object answer."""

    name = "Math17kAlpacaStyleInstructionHandler"
    accepts_chat_prompt = True
    accepts_object_response = True


HANDLERS: dict[str, type[InstructionHandler]] = {
    cls.name: cls for cls in (R1AlpacaStyleInstructionHandler, Math17kAlpacaStyleInstructionHandler)
}


def get_handler(name: str, map_keys: Mapping[str, str] | None,
                additional_keys: Sequence[str] = ()) -> InstructionHandler:
    """The handler called `name`; an unknown name raises with the valid names."""
    cls = HANDLERS.get(name.strip())
    if cls is None:
        raise DataError(f"unknown handler_name {name!r}; valid names: {', '.join(sorted(HANDLERS))}")
    return cls(map_keys, additional_keys)
