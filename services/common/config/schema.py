"""How a config section is declared and how raw YAML values are checked against it.

Owns four things:
- `setting(default, help, status)`: the one way a section field declares its default, its help text
  and its status (`read`, `refused` or `inert`, see `KeyStatus`): no key is accepted silently;
- `coerce(value, annotation)`: strict type checking of one YAML value against a field's type hint,
  with the few conversions YAML forces on us (PyYAML reads `1e-6` as a string, `0` as an int);
- `parse_section(cls, raw, ...)`: turn one YAML mapping into keyword arguments for a section
  dataclass, collecting every unknown key and type error instead of stopping at the first.

Choices: dashes in keys read as underscores (as MindSpeed-RL does); an unknown key is reported with
the closest valid key (difflib) and, when the key belongs to another section, with that section.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from services.common.config.errors import ConfigIssue

# A float written the YAML 1.2 way (`1e-6`, `.5`, `1_000.0`), which PyYAML (YAML 1.1) leaves as str.
_FLOAT_RE = re.compile(r"^[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?$")


READ, REFUSED, INERT = "read", "refused", "inert"


@dataclasses.dataclass(frozen=True)
class KeyStatus:
    """What rlfabric does with a key. Declared once, next to the field; docs/config.md shows the table.

    Attributes:
        kind: READ (code uses it), REFUSED (a value other than `allowed` is an error) or INERT (accepted,
            changes nothing here; `reason` says why).
        modules: READ: the source files that read it (tests/common/test_config_keys.py checks each one does).
        reason: REFUSED / INERT: why; a READ key's optional note.
        feature: REFUSED: the feature it belongs to; a config using a feature is refused with one message.
        allowed: REFUSED: the accepted values; None means only the field's default.
        platform: READ: the only platform where it takes effect ("ascend": vllm-ascend reads it).
    """

    kind: str
    modules: tuple[str, ...] = ()
    reason: str = ""
    feature: str | None = None
    allowed: tuple[Any, ...] | None = None
    platform: str | None = None


def read(*modules: str, note: str = "", platform: str | None = None) -> KeyStatus:
    """READ by `modules` (paths from the repository root)."""
    return KeyStatus(READ, modules=modules, reason=note, platform=platform)


def refused(reason: str, *, feature: str | None = None, allowed: tuple[Any, ...] | None = None) -> KeyStatus:
    """REFUSED unless the value is in `allowed` (default: the field's default)."""
    return KeyStatus(REFUSED, reason=reason, feature=feature, allowed=allowed)


def inert(reason: str) -> KeyStatus:
    """INERT: accepted and ignored, for `reason` (shown by `rlfabric config check` when a file sets it)."""
    return KeyStatus(INERT, reason=reason)


def setting(default: Any = dataclasses.MISSING, help: str = "", status: KeyStatus | None = None, *,
            factory: Callable[[], Any] | None = None):
    """Declare a config field: its single default, its help text and its status.

    Args:
        default: the default value (immutable values only).
        help: one line shown by `rlfabric config keys` and in docs.
        status: `read(...)`, `refused(...)` or `inert(...)`; tests/common/test_config_keys.py fails without one.
        factory: for mutable defaults (lists, nested sections), a zero-argument callable.
    """
    metadata = {"help": help, "status": status}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_status(field: dataclasses.Field) -> KeyStatus | None:
    return field.metadata.get("status")


def field_default(field: dataclasses.Field) -> Any:
    """A field's default value (a fresh one for factories)."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def normalize_key(key: Any) -> str:
    """YAML key -> field name: MindSpeed-RL reads `use-flash-attn` as `use_flash_attn`."""
    return str(key).replace("-", "_")


class _TypeMismatchError(Exception):
    """Raised by `coerce` with the expected type spelled for humans."""

    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


def describe(annotation: Any) -> str:
    """Human spelling of a type hint: `int`, `list of str`, `float or null`."""
    if annotation is Any:
        return "any value"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        names = [describe(a) for a in typing.get_args(annotation) if a is not type(None)]
        tail = " or null" if type(None) in typing.get_args(annotation) else ""
        return " or ".join(names) + tail
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        return "list" if item is Any else f"list of {describe(item)}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(annotation):
        return f"mapping ({annotation.__name__})"
    if annotation is float:
        return "number"
    if annotation is int:
        return "integer"
    if annotation is bool:
        return "boolean (true/false)"
    if annotation is str:
        return "string"
    return getattr(annotation, "__name__", str(annotation))


def coerce(value: Any, annotation: Any) -> Any:
    """Check `value` against `annotation`; return it (possibly converted) or raise `_TypeMismatchError`.

    Conversions allowed: int -> float for float fields; a numeric string -> float for float fields
    (PyYAML reads `lr: 1e-6` as the string "1e-6"). Booleans are never accepted as numbers. A `Literal`
    field (an enumeration) takes exactly one of its values.
    """
    if annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        if any(type(value) is type(option) and value == option for option in typing.get_args(annotation)):
            return value
        raise _TypeMismatchError(describe(annotation))
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None:
            if type(None) in options:
                return None
            raise _TypeMismatchError(describe(annotation))
        # Try exact-type options first so `int | float` keeps an int an int.
        for option in sorted(options, key=lambda o: 0 if o is type(value) else 1):
            if option is type(None):
                continue
            try:
                return coerce(value, option)
            except _TypeMismatchError:
                continue
        raise _TypeMismatchError(describe(annotation))
    if origin is list or annotation is list:
        if not isinstance(value, list | tuple):
            raise _TypeMismatchError(describe(annotation))
        (item,) = typing.get_args(annotation) or (Any,)
        try:
            return [coerce(v, item) for v in value]
        except _TypeMismatchError as exc:
            raise _TypeMismatchError(describe(annotation)) from exc
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise _TypeMismatchError("mapping")
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _TypeMismatchError(describe(bool))
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _TypeMismatchError(describe(int))
    if annotation is float:
        if isinstance(value, bool):
            raise _TypeMismatchError(describe(float))
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value.strip().replace("_", ""))
        raise _TypeMismatchError(describe(float))
    if annotation is str:
        if isinstance(value, str):
            return value
        raise _TypeMismatchError(describe(str))
    raise _TypeMismatchError(describe(annotation))


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a section dataclass, keyed by field name."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def field_help(cls: type, name: str) -> str:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("help", "")
    raise KeyError(name)


def closest_key(key: str, valid: typing.Iterable[str]) -> str | None:
    """The most similar valid key, or None when nothing is reasonably close."""
    matches = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(key: str, section: str, valid: typing.Iterable[str],
                        elsewhere: Mapping[str, typing.Iterable[str]] | None = None) -> str:
    """The message for an unknown key, naming the section and the closest valid key.

    `elsewhere` maps other section names to their keys, so that a key placed in the wrong section
    is sent to the right one.
    """
    valid = sorted(valid)
    message = f"unknown key `{key}` in section `{section}`"
    homes = [name for name, keys in (elsewhere or {}).items() if key in keys]
    if homes:
        return f"{message}; `{key}` belongs in section `{homes[0]}`: move it there"
    guess = closest_key(key, valid)
    if guess is not None:
        return f"{message}; did you mean `{guess}`?"
    if len(valid) <= 20:
        return f"{message}; valid keys are: {', '.join(valid)}"
    return f"{message}; no similar key exists (`rlfabric config keys {section}` lists them)"


def parse_section(
    cls: type,
    raw: Any,
    *,
    section: str,
    issues: list[ConfigIssue],
    source: Callable[[str], str | None] = lambda key: None,
    elsewhere: Mapping[str, typing.Iterable[str]] | None = None,
    skip: typing.Collection[str] = (),
    bad: set[str] | None = None,
) -> dict[str, Any]:
    """Check one YAML mapping against a section dataclass and return its keyword arguments.

    Unknown keys and type errors are appended to `issues` (the bad keys are left out of the result
    so the section still builds with defaults and later checks can run). Nested dataclass fields
    (e.g. `sampling_config`) are parsed recursively and returned as instances.

    Args:
        cls: the section dataclass.
        raw: the YAML value of the section (None means empty).
        section: dotted name used in messages, e.g. "generate_config.sampling_config".
        issues: collected errors.
        source: maps a raw key to "file:line" (or an override) for messages.
        elsewhere: other sections' keys, to say "belongs in section X".
        skip: raw keys the caller handles itself (e.g. `model`).
        bad: receives "section.key" for keys that failed (and the key an unknown key most likely
            meant), so later cross-field checks about them can be left out as noise.
    """
    bad = set() if bad is None else bad
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        issues.append(ConfigIssue(section, f"section `{section}` must be a mapping of keys to values, "
                                           f"got {type(raw).__name__}", source("")))
        return {}
    types_ = field_types(cls)
    kwargs: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for raw_key, value in raw.items():
        if raw_key in skip:
            continue
        key = normalize_key(raw_key)
        where = f"{section}.{key}"
        if key in seen:
            issues.append(ConfigIssue(where, f"`{raw_key}` and `{seen[key]}` name the same key "
                                             f"(dashes read as underscores); keep one", source(raw_key)))
            continue
        seen[key] = str(raw_key)
        if key not in types_:
            issues.append(ConfigIssue(where, unknown_key_message(key, section, types_, elsewhere),
                                      source(raw_key)))
            guess = closest_key(key, types_)
            if guess is not None:
                bad.add(f"{section}.{guess}")
            continue
        annotation = types_[key]
        nested = dataclass_in(annotation)
        if nested is not None and isinstance(value, Mapping):
            sub_source = _sub_source(raw, raw_key, source)
            kwargs[key] = nested(**parse_section(nested, value, section=where, issues=issues,
                                                 source=sub_source, bad=bad))
            continue
        try:
            kwargs[key] = coerce(value, annotation)
        except _TypeMismatchError as exc:
            bad.add(where)
            issues.append(ConfigIssue(where, f"`{key}` in section `{section}` must be {exc.expected}, "
                                             f"got {value!r} ({type(value).__name__})", source(raw_key)))
    return kwargs


def dataclass_in(annotation: Any) -> type | None:
    """The dataclass inside `X` or `X | None`, if any."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            if dataclasses.is_dataclass(option):
                return option
    return None


def _sub_source(raw: Any, raw_key: Any, source: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """Line lookup for a nested mapping: its own key lines when it has them, else the parent's."""
    child = raw[raw_key]
    lines = getattr(child, "key_sources", None)
    if lines:
        return lambda key: lines.get(key) or source(raw_key)
    return lambda key: source(raw_key)
