"""Reading YAML with the line of every key, refusing duplicate keys.

PyYAML silently keeps the last of two equal keys and forgets where keys were; both hurt a user who
mistypes a config. The loader here returns mappings (`SourcedDict`) that remember "file:line" for
each key, and reports a duplicate key, a syntax error or a missing file as a `ConfigError` naming
the file and line.
"""

from __future__ import annotations

import re
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


def _culprit(exc: yaml.MarkedYAMLError, text: str) -> tuple[int, int] | None:
    """(line, column), 1-based, of the mistake. PyYAML's problem mark is where parsing got stuck, often past the
    mistake: a key without its colon is noticed on the next line, an unclosed quote or bracket later still. For
    those (a scanner's "while scanning ...", an open flow collection) the context mark is the mistake."""
    context = exc.context or ""
    mark = exc.problem_mark or exc.context_mark
    if exc.context_mark is not None and context.startswith(("while scanning", "while parsing a flow")):
        mark = exc.context_mark
    if mark is None:
        return None
    lines = text.splitlines()
    if 0 < len(lines) <= mark.line:  # "<stream end>" sits past the last line; the unfinished text is on the last one
        return len(lines), 1
    line = mark.line
    if exc.problem == "mapping values are not allowed here":
        # `key value` (colon forgotten) and the next line's `key:` read as one plain scalar spanning both lines,
        # so the colon is refused on the later line: go back to where that scalar began.
        while line > 0 and _continues_scalar(lines[line - 1]):
            line -= 1
        if line != mark.line:
            return line + 1, len(lines[line]) - len(lines[line].lstrip()) + 1
    return line + 1, mark.column + 1  # PyYAML's marks are 0-based


def _continues_scalar(line: str) -> bool:
    """Whether a line can be part of a multi-line plain scalar: text with no `key:` and no list dash."""
    body = re.split(r"(^|\s)#", line, maxsplit=1)[0].strip()
    return bool(body) and not body.startswith("- ") and re.search(r":(\s|$)", body) is None


def parse_yaml(text: str, label: str) -> Any:
    """Parse YAML text; `label` (a path or "--override ...") is used in messages and key sources."""
    try:
        return yaml.load(text, Loader=_make_loader(label))
    except yaml.MarkedYAMLError as exc:
        mark = _culprit(exc, text)
        line = f":{mark[0]}" if mark is not None else ""
        column = f" (column {mark[1]})" if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem:
            problem = f"{exc.context}: {exc.problem}"
        noticed = min(exc.problem_mark.line + 1, len(text.splitlines())) if exc.problem_mark is not None else 0
        if mark is not None and mark[0] < noticed:
            problem += (f" (noticed at line {noticed}; a key without its `:` or an unclosed quote or bracket on "
                        f"this line?)")
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
