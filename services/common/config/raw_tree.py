"""The raw YAML tree before it is parsed: copied with its key sources, a key's "file:line", overrides.

Overrides are dotted `section.key=value` strings (the value parsed as YAML); they edit the raw tree, so the
strict parse that follows reports an unknown overridden key exactly like one written in the file, naming
the override as its source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.common.config.errors import ConfigError, ConfigIssue
from services.common.config.schema import normalize_key
from services.common.config.yaml_io import SourcedDict, parse_yaml


def copy_tree(value: Any) -> Any:
    """Deep copy of parsed YAML that keeps each mapping's key sources."""
    if isinstance(value, Mapping):
        out = SourcedDict((k, copy_tree(v)) for k, v in value.items())
        out.key_sources = dict(getattr(value, "key_sources", {}))
        return out
    if isinstance(value, list):
        return [copy_tree(v) for v in value]
    return value


def source_of(raw: Mapping, *path: str) -> str | None:
    """file:line of a key path in the raw tree (keys matched after dash normalization)."""
    node: Any = raw
    source = None
    for part in path:
        if not isinstance(node, Mapping):
            return source
        key = next((k for k in node if normalize_key(k) == part), None)
        if key is None:
            return source
        source = getattr(node, "key_sources", {}).get(key, source)
        node = node[key]
    return source


def apply_overrides(raw: SourcedDict, overrides: Sequence[str], issues: list[ConfigIssue]) -> None:
    """Set `a.b.c=value` entries in the raw tree; unknown keys are caught later by the strict parse."""
    for text in overrides:
        origin = f"--override {text}"
        dotted, sep, value_text = text.partition("=")
        parts = [normalize_key(p.strip()) for p in dotted.split(".")]
        if not sep or not all(parts):
            issues.append(ConfigIssue(dotted or text, "an override must look like `section.key=value`, e.g. "
                                                      "`rl_config.clip_ratio=0.3`", origin))
            continue
        if parts[0] == "defaults":
            issues.append(ConfigIssue("defaults", "`defaults` cannot be overridden; edit the file", origin))
            continue
        try:
            value = parse_yaml(value_text, origin) if value_text.strip() else None
        except ConfigError as exc:
            issues.extend(exc.issues)
            continue
        node = raw
        for i, part in enumerate(parts[:-1]):
            key = next((k for k in node if normalize_key(k) == part), None)
            if key is None:
                node[part] = SourcedDict()
                node.key_sources[part] = origin
                key = part
            if not isinstance(node[key], Mapping):
                issues.append(ConfigIssue(".".join(parts[: i + 1]), f"`{'.'.join(parts[: i + 1])}` is a value, not "
                                                                    f"a section, so `{dotted}` cannot be set", origin))
                break
            node = node[key]
        else:
            existing = next((k for k in node if normalize_key(k) == parts[-1]), parts[-1])
            node[existing] = copy_tree(value)
            node.key_sources[existing] = origin
