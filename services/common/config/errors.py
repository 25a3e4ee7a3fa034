"""Configuration errors: one `ConfigIssue` per problem, all of them raised together in a `ConfigError`.

Loading never stops at the first problem: a user fixing a YAML file should see every unknown key,
type error and broken rule in one run, each naming the key, where it came from (file:line or the
`--override` that set it) and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import DataError


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration.

    Attributes:
        key: dotted key the problem is about, e.g. "rl_config.clip_ration" (or a file path).
        message: what is wrong and what to change.
        source: where the key was set: "path/to/file.yaml:73", "--override k=v", or None.
    """

    key: str
    message: str
    source: str | None = None

    def __str__(self) -> str:
        prefix = f"{self.source}: " if self.source else ""
        if self.source and self.source.rsplit(":", 1)[0] == self.key or self.source is None and "/" in self.key:
            # A problem with a whole file: the file is already named, do not repeat it as the key.
            return f"{prefix or self.key + ': '}{self.message}"
        return f"{prefix}{self.key}: {self.message}"

    def to_dict(self) -> dict[str, str | None]:
        return {"key": self.key, "message": self.message, "source": self.source}


class ConfigError(DataError):
    """A configuration that cannot be used; `.issues` lists every problem found. A `DataError`: the user's to fix."""

    def __init__(self, issues: list[ConfigIssue], path: str | None = None):
        self.issues = list(issues)
        self.path = path
        where = f" in {path}" if path else ""
        count = len(self.issues)
        if count == 1:  # one line: a single mistake needs no list
            only = str(self.issues[0])
            super().__init__(only if not path or path in only else f"{path}: {only}")
            return
        header = f"{count} configuration error{'s' if count != 1 else ''}{where}:"
        super().__init__("\n".join([header, *(f"  - {issue}" for issue in self.issues)]))

    @property
    def errors(self) -> list[str]:
        """The problems as plain strings (same text as in the message)."""
        return [str(issue) for issue in self.issues]
