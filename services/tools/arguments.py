"""A tool call's arguments: JSON text in, a dict out, checked against the tool's schema. Pure functions.

The schemas are MindSpeed-RL's (`OpenAIFunctionToolSchema`): an object with `properties` (each a `type`, maybe an
`enum`) and `required`. Only that subset is checked, with messages written for the model that made the call
(it sees them as the tool's answer): which argument, what was expected, what it sent. Properties the schema does
not list are let through, as JSON Schema does by default (ReTool reads `timeout` and `language` that way).
"""

from __future__ import annotations

import json
import math
from typing import Any

# JSON Schema type name -> the Python types json.loads gives for it (bool is not a number; an integral float is
# an integer, as JSON Schema draft 4+ counts it).
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "number": (int, float), "integer": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


class ArgumentsError(ValueError):
    """Arguments the tool cannot take; the message is written for the model."""


def _refuse_constant(name: str) -> Any:
    raise ArgumentsError(f"arguments must be valid JSON; {name} is not a JSON number")


def parse_arguments(arguments_json: str) -> dict[str, Any]:
    """The arguments object of `arguments_json`; ArgumentsError saying what is wrong otherwise."""
    try:
        value = json.loads(arguments_json or "{}", parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ArgumentsError(f"arguments are not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    if not isinstance(value, dict):
        raise ArgumentsError(f"arguments must be a JSON object, got {type(value).__name__}")
    return value


def _type_matches(value: Any, type_name: str) -> bool:
    kinds = _TYPES.get(type_name)
    if kinds is None:  # a type JSON Schema does not define: nothing to check against
        return True
    if isinstance(value, bool) and type_name not in ("boolean",):
        return False
    if not isinstance(value, kinds):
        return False
    if type_name == "integer" and isinstance(value, float):
        return math.isfinite(value) and value.is_integer()
    return True


def check_arguments(arguments: dict[str, Any], parameters: dict[str, Any]) -> None:
    """Raises ArgumentsError when `arguments` break `parameters` (required, type, enum of each property)."""
    properties = parameters.get("properties") or {}
    missing = [name for name in parameters.get("required") or [] if name not in arguments]
    if missing:
        raise ArgumentsError(f"missing required argument{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(repr(m) for m in missing)}")
    for name, spec in properties.items():
        if name not in arguments or not isinstance(spec, dict):
            continue
        value = arguments[name]
        type_name = spec.get("type")
        if isinstance(type_name, str) and not _type_matches(value, type_name):
            raise ArgumentsError(f"argument {name!r} must be a{'n' if type_name[0] in 'aeiou' else ''} "
                                 f"{type_name}, got {_json_type(value)}")
        enum = spec.get("enum")
        if isinstance(enum, list) and value not in enum:
            raise ArgumentsError(f"argument {name!r} must be one of {', '.join(map(repr, enum))}, got {value!r}")


def _json_type(value: Any) -> str:
    for name, kinds in _TYPES.items():
        if isinstance(value, bool):
            return "boolean"
        if name != "integer" and isinstance(value, kinds):
            return name
    return type(value).__name__
