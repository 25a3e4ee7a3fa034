"""Status messages quote client values cut short, so the real status code reaches the client."""

from __future__ import annotations

from services.common.status import ECHO_CHARS, MAX_STATUS_CHARS, clip_status, echo


def test_echo_quotes_short_values_whole_and_cuts_long_ones_saying_how_long() -> None:
    assert echo("it3/p17") == "'it3/p17'"
    assert echo([1, 2]) == "[1, 2]"
    cut = echo("x" * 100_000)
    assert cut.startswith("'xxx") and cut.endswith("... (100002 characters)")  # the repr's quotes count
    assert len(cut) < ECHO_CHARS + 30


def test_clip_status_caps_whole_messages() -> None:
    assert clip_status("short") == "short"
    long = clip_status("y" * 50_000)
    assert len(long) < MAX_STATUS_CHARS + 50 and long.endswith("(message cut from 50000 characters)")
