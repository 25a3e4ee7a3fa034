"""The one exception type for data problems a user can cause (bad file, bad YAML, bad field)."""

from __future__ import annotations


class DataError(ValueError):
    """A user-fixable data or configuration problem; the message names the file, row, key or field."""
