"""Chat templates from MindSpeed-RL's `configs/model/templates.json`, rendered to prompt token ids.

A template is a set of formatters; each formatter is a list of slots:
- a string, in which `{{content}}` (and, for the user turn, `{{idx}}`) is replaced once;
- a JSON list of special-token names (`["bos_token"]`, `["eos_token"]`), which becomes that token's id when the
  tokenizer has one and nothing otherwise;
- an object `{"token": "<|x|>"}`, the id of that token.

The prompt of one user turn is `format_prefix` + `format_system(system or default_system)` (only when that is
non-empty) + `format_user(content)`. Each slot is tokenised on its own with `add_special_tokens=False`, as
MindSpeed-RL does, so ids equal upstream ids even where a joint tokenisation would merge across slots.
Templates whose name starts with `llama2` put the formatted system text inside the user turn instead.
Formatters a template leaves out fall back to `{{content}}` (user, system), `{{content}}` + eos (assistant)
and nothing (prefix, separator), as upstream.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from services.common.errors import DataError

DEFAULT_TEMPLATES_PATH = Path(__file__).resolve().parents[2] / "configs" / "model" / "templates.json"

_PLACEHOLDER = re.compile(r"\{\{([a-zA-Z_][a-zA-Z0-9_]*)\}\}")
_FORMATTER_KEYS = (
    "format_user", "format_assistant", "format_system", "format_function", "format_observation",
    "format_tools", "format_separator", "format_prefix",
)
_SCALAR_KEYS = ("name", "default_system", "stop_words", "efficient_eos", "replace_eos", "force_system",
                "template_class")
KNOWN_TEMPLATE_KEYS = frozenset(_FORMATTER_KEYS + _SCALAR_KEYS)
# Special-token names a list slot may carry, and the tokenizer attribute holding each one.
_SPECIAL_SLOT_NAMES = {"bos_token": "bos_token", "eos_token": "eos_token"}

Slot = str | frozenset[str] | Mapping[str, str]


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer a template uses."""

    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def convert_tokens_to_ids(self, token: str) -> int: ...


@dataclass(frozen=True)
class Formatter:
    """An ordered list of slots; `apply` substitutes placeholders in the string slots."""

    slots: tuple[Slot, ...] = ()

    def apply(self, **values: str) -> list[Slot]:
        return [_substitute(s, values) if isinstance(s, str) else s for s in self.slots]

    def placeholders(self) -> set[str]:
        return {m for s in self.slots if isinstance(s, str) for m in _PLACEHOLDER.findall(s)}


def _substitute(text: str, values: Mapping[str, str]) -> str:
    """Replaces the first `{{name}}` of each given name, in one pass so inserted text is never rescanned."""
    done: set[str] = set()

    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in values and name not in done:
            done.add(name)
            return values[name]
        return m.group(0)

    return _PLACEHOLDER.sub(repl, text)


_CONTENT = Formatter(("{{content}}",))
_EMPTY = Formatter(())


@dataclass(frozen=True)
class Template:
    """One named chat template (the subset of fields a prompt needs, plus the flags rollout may read)."""

    name: str
    format_user: Formatter = _CONTENT
    format_system: Formatter = _CONTENT
    format_assistant: Formatter = Formatter(("{{content}}", frozenset({"eos_token"})))
    format_prefix: Formatter = _EMPTY
    format_separator: Formatter = _EMPTY
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    efficient_eos: bool = False
    replace_eos: bool = False
    system_in_user: bool = False
    # The tool turn (multi-turn rollouts): None when the template has no `format_observation`.
    format_observation: Formatter | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def prompt_slots(self, content: str, system: str = "") -> list[Slot]:
        """The slots of a one-turn prompt that ends where the assistant's answer starts."""
        system = system or self.default_system
        slots: list[Slot] = list(self.format_prefix.apply())
        if self.system_in_user:
            system_text = "".join(self.format_system.apply(content=system)) if system else ""
            return slots + self.format_user.apply(content=system_text + content, idx="0")
        if system:
            slots += self.format_system.apply(content=system)
        return slots + self.format_user.apply(content=content, idx="0")

    def encode_prompt(self, tokenizer: Tokenizer, content: str, system: str = "") -> list[int]:
        """Prompt token ids, each slot tokenised separately without the tokenizer's own special tokens."""
        return _encode_slots(tokenizer, self.prompt_slots(content, system))

    def encode_observation(self, tokenizer: Tokenizer, content: str) -> list[int]:
        """Token ids of a tool turn after an assistant turn: the separator, then `format_observation` (which
        ends where the assistant's next turn starts). ValueError when the template has no observation format."""
        if self.format_observation is None:
            raise ValueError(f"template {self.name!r} has no format_observation (a tool turn's format)")
        return _encode_slots(tokenizer, [*self.format_separator.apply(), *self.format_observation.apply(content=content)])

    def render_prompt(self, content: str, system: str = "", tokenizer: Tokenizer | None = None) -> str:
        """The prompt as text: what `encode_prompt`'s ids decode to (special-token slots need `tokenizer`)."""
        parts: list[str] = []
        for slot in self.prompt_slots(content, system):
            if isinstance(slot, str):
                parts.append(slot)
            elif isinstance(slot, frozenset):
                for name in sorted(slot):
                    token = getattr(tokenizer, _SPECIAL_SLOT_NAMES[name], None) if tokenizer else None
                    parts.append(token or "")
            else:
                parts.append(slot["token"])
        return "".join(parts)


def _encode_slots(tokenizer: Tokenizer, slots: list[Slot]) -> list[int]:
    """Token ids of `slots`, each tokenised separately without the tokenizer's own special tokens."""
    ids: list[int] = []
    for slot in slots:
        if isinstance(slot, str):
            if slot:
                ids += tokenizer.encode(slot, add_special_tokens=False)
        elif isinstance(slot, frozenset):
            for name in sorted(slot):
                token_id = getattr(tokenizer, f"{_SPECIAL_SLOT_NAMES[name]}_id", None)
                if token_id is not None:
                    ids.append(int(token_id))
        else:
            ids.append(int(tokenizer.convert_tokens_to_ids(slot["token"])))
    return ids


def _parse_slot(raw: Any, where: str) -> Slot:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        names = frozenset(raw)
        unknown = sorted(n for n in names if n not in _SPECIAL_SLOT_NAMES)
        if unknown or not all(isinstance(n, str) for n in raw):
            raise DataError(f"{where}: special-token slot {raw!r} may only name {sorted(_SPECIAL_SLOT_NAMES)}")
        return names
    if isinstance(raw, dict) and set(raw) == {"token"} and isinstance(raw["token"], str):
        return dict(raw)
    raise DataError(f"{where}: a slot must be a string, a list of special-token names or {{\"token\": ...}}, "
                    f"got {raw!r}")


def _parse_formatter(raw: Any, where: str, *, needs_placeholder: bool) -> Formatter:
    if not isinstance(raw, dict) or not isinstance(raw.get("slots", []), list):
        raise DataError(f"{where}: expected an object with a list `slots`, got {raw!r}")
    fmt = Formatter(tuple(_parse_slot(s, f"{where}.slots[{i}]") for i, s in enumerate(raw.get("slots") or [])))
    has = bool(fmt.placeholders())
    if needs_placeholder and not has:
        raise DataError(f"{where}: needs a placeholder such as {{{{content}}}} in one of its slots")
    if not needs_placeholder and has:
        raise DataError(f"{where}: must not contain placeholders, found {sorted(fmt.placeholders())}")
    return fmt


def parse_template(raw: Mapping[str, Any], source: str = "templates.json") -> Template:
    """Builds a `Template` from one entry of templates.json, checking its keys and slots."""
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise DataError(f"{source}: every template needs a non-empty string `name`, got {raw!r:.120}")
    where = f"{source}: template {name!r}"
    unknown = sorted(set(raw) - KNOWN_TEMPLATE_KEYS)
    if unknown:
        raise DataError(f"{where}: unknown keys {unknown}; valid keys are {sorted(KNOWN_TEMPLATE_KEYS)}")
    kwargs: dict[str, Any] = {"name": name}
    for key, needs in (("format_user", True), ("format_system", True), ("format_assistant", True),
                       ("format_prefix", False), ("format_separator", False)):
        if raw.get(key):
            kwargs[key] = _parse_formatter(raw[key], f"{where}.{key}", needs_placeholder=needs)
    default_system = raw.get("default_system") or ""
    if isinstance(default_system, list):
        default_system = "".join(default_system)
    if not isinstance(default_system, str):
        raise DataError(f"{where}.default_system: expected a string, got {default_system!r}")
    kwargs["default_system"] = default_system
    kwargs["stop_words"] = tuple(raw.get("stop_words") or ())
    kwargs["efficient_eos"] = bool(raw.get("efficient_eos", False))
    kwargs["replace_eos"] = bool(raw.get("replace_eos", False))
    # MindSpeed-RL picks its Llama2 template class by name prefix; qwen3's ReasoningTemplate only changes
    # assistant turns, so a prompt renders as the plain template.
    kwargs["system_in_user"] = name.startswith("llama2")
    if raw.get("format_observation"):
        kwargs["format_observation"] = _parse_formatter(raw["format_observation"], f"{where}.format_observation",
                                                        needs_placeholder=True)
    kwargs["extra"] = {k: raw[k] for k in ("format_function", "format_tools", "force_system", "template_class")
                       if k in raw}
    return Template(**kwargs)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> dict[str, Template]:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if not isinstance(raw, list):
        raise DataError(f"{path}: expected a JSON list of templates, got {type(raw).__name__}")
    out: dict[str, Template] = {}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise DataError(f"{path}: entry {i} is a {type(entry).__name__}, expected an object")
        tpl = parse_template(entry, source=path)
        if tpl.name in out:
            raise DataError(f"{path}: template {tpl.name!r} is defined twice")
        out[tpl.name] = tpl
    return out


def load_templates(path: str | Path | None = None) -> dict[str, Template]:
    """All templates of a templates.json file (default: the repository's `configs/model/templates.json`)."""
    p = Path(path) if path else DEFAULT_TEMPLATES_PATH
    if not p.is_file():
        raise DataError(f"templates file {p} not found; set `prompt_type_path` to a templates.json")
    return dict(_load_cached(str(p.resolve()), p.stat().st_mtime_ns))


def get_template(name: str, path: str | Path | None = None) -> Template:
    """The template called `name`; an unknown name raises with the list of valid names."""
    templates = load_templates(path)
    key = name.strip()
    if key not in templates:
        raise DataError(f"unknown prompt_type {name!r} in {path or DEFAULT_TEMPLATES_PATH}; "
                        f"valid names: {', '.join(sorted(templates))}")
    return templates[key]


def template_names(path: str | Path | None = None) -> Sequence[str]:
    return sorted(load_templates(path))
