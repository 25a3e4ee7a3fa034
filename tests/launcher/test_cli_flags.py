"""The flags `rlfabric up` and `rlfabric system up` share are declared once (services/launcher/cli.py)."""

from __future__ import annotations

import argparse

import pytest

from services.cli import build_parser
from services.launcher.cli import service_count_error

SHARED = ("-o", "--reward-workers", "--reward-processes", "--rollout-replicas", "--tool-servers",
          "--trainer-threads", "--startup-timeout")


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _flag(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def test_up_and_system_up_declare_the_shared_flags_alike() -> None:
    parser = build_parser()
    up, system_up = _subparser(parser, "up"), _subparser(parser, "system", "up")
    for flag in SHARED:
        ours, theirs = _flag(up, flag), _flag(system_up, flag)
        assert (ours.default, ours.help, ours.type, ours.metavar) == \
            (theirs.default, theirs.help, theirs.type, theirs.metavar), flag


@pytest.mark.parametrize("command", [["up"], ["system", "up"]])
def test_a_count_under_one_is_named(command: list[str]) -> None:
    parser = build_parser()
    assert service_count_error(parser.parse_args([*command, "c.yaml"])) is None
    args = parser.parse_args([*command, "c.yaml", "--rollout-replicas", "2", "--tool-servers", "0"])
    assert service_count_error(args) == "--tool-servers must be at least 1, got 0"
