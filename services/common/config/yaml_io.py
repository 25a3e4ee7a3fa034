"""Reading YAML with the line of every key, refusing duplicate keys.

PyYAML silently keeps the last of two equal keys and forgets where keys were; both hurt a user who
mistypes a config. The loader here returns mappings (`SourcedDict`) that remember "file:line" for
each key, and reports a duplicate key, a syntax error or a missing file as a `ConfigError` naming
the file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from services.common.config.errors import ConfigError, ConfigIssue


class SourcedDict(dict):
    """A dict that also maps each key to where it was written ("file:line")."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.key_sources: dict[Any, str] = {}


def _make_loader(label: str) -> type[yaml.SafeLoader]:
    class _Loader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> SourcedDict:
        loader.flatten_mapping(node)
        result = SourcedDict()
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in result:
                raise ConfigError([ConfigIssue(
                    str(key),
                    f"duplicate key `{key}` (first set at {result.key_sources[key]}); YAML keeps only "
                    f"the last one, so delete one of them",
                    f"{label}:{line}",
                )], label)
            result[key] = loader.construct_object(value_node, deep=True)
            result.key_sources[key] = f"{label}:{line}"
        return result

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return _Loader


def parse_yaml(text: str, label: str) -> Any:
    """Parse YAML text; `label` (a path or "--override ...") is used in messages and key sources."""
    try:
        return yaml.load(text, Loader=_make_loader(label))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        column = f" (column {mark.column + 1})" if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError([ConfigIssue(label, f"YAML syntax error{column}: {problem}; fix the file "
                                              f"at this line", f"{label}{line}")], label) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue(label, f"YAML error: {exc}", label)], label) from exc


def read_yaml(path: Path, *, what: str = "config file") -> Any:
    """Read and parse a YAML file, with a clear error when it is missing or malformed."""
    label = str(path)
    if not path.is_file():
        hint = "it is a directory; pass a .yaml file" if path.is_dir() else "check the path"
        raise ConfigError([ConfigIssue(label, f"{what} not found ({hint})")], label)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue(label, f"cannot read {what}: {exc}")], label) from exc
    return parse_yaml(text, label)
