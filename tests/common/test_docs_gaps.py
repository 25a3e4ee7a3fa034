"""The docs' "Known gaps" stay honest: every gap names the test that shows it or the issue that tracks it, a fixed
gap names a test, and every test named exists; the statements issue 26 found stale are checked against the code
they describe (the 7B run's device count, which reward commands take the token)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from services.cli import build_parser
from services.common.config import load_config

REPO = Path(__file__).resolve().parents[2]
GAP_DOCS = ("docs/architecture.md", "docs/deploy.md")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")
ISSUE_REF = re.compile(r"\bissue (\d+)\b")
# Open gaps no test shows and no issue tracks yet: each needs an issue (then it leaves this list).
UNTRACKED = {("docs/deploy.md", "8"), ("docs/deploy.md", "13"), ("docs/deploy.md", "14")}


def known_gaps(doc: str) -> list[tuple[str, str]]:
    """(label, text) of each item of the doc's "Known gaps" section: "3" for a numbered item, else its position."""
    text = (REPO / doc).read_text()
    match = re.search(r"^## Known gaps[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{doc} has no Known gaps section"
    items: list[tuple[str, str]] = []
    for line in match.group(1).splitlines():
        start = re.match(r"^(?:(\d+)\.|-) (.*)", line)
        if start:
            items.append((start.group(1) or str(len(items) + 1), start.group(2)))
        elif line.startswith("  ") and items:  # a continuation line of the item
            items[-1] = (items[-1][0], f"{items[-1][1]} {line.strip()}")
    return items


ALL_GAPS = [(doc, label, text) for doc in GAP_DOCS for label, text in known_gaps(doc)]


@pytest.mark.parametrize(("doc", "label", "text"), ALL_GAPS, ids=[f"{d}:{lbl}" for d, lbl, _ in ALL_GAPS])
def test_every_gap_names_a_test_or_an_issue(doc: str, label: str, text: str) -> None:
    tests, issues = TEST_REF.findall(text), ISSUE_REF.findall(text)
    if (doc, label) in UNTRACKED:
        assert not tests and not issues, f"{doc} gap {label} is tracked now: remove it from UNTRACKED"
        return
    assert tests or issues, f"{doc} gap {label} names neither a test (tests/...py) nor an issue: {text[:100]}"
    if text.startswith("(fixed)"):
        assert tests, f"{doc} gap {label} is fixed: name the test that shows it"
    for path, name in tests:
        assert (REPO / path).is_file(), f"{doc} gap {label}: {path} does not exist"
        if name:
            assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), \
                f"{doc} gap {label}: {path} has no test {name}"


def test_gaps_referred_to_elsewhere_exist() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    labels = {label for label, _ in known_gaps("docs/deploy.md")}
    referred = set(re.findall(r"\bgaps? (\d+)\b", text))
    assert referred and referred <= labels, f"deploy.md refers to gaps {sorted(referred - labels)} it does not list"


def test_the_7b_device_counts_in_deploy_md_are_the_configs() -> None:
    cfg = load_config(REPO / "configs" / "grpo_qwen25_7b_A3.yaml")
    text = (REPO / "docs" / "deploy.md").read_text()
    assert cfg.rl_config.use_integrated_worker and cfg.derived.world_size == 16
    assert f"says world size {cfg.derived.world_size} devices\n(integrated)" in text
    assert "not wired" not in text.split("## Known gaps")[0]


def _commands(doc: str) -> list[list[str]]:
    """The `rlfabric reward ...` command lines of a doc's code blocks (continuation lines joined, a trailing `&`
    dropped; lines with a `...` placeholder left out)."""
    text = (REPO / doc).read_text().replace("\\\n", " ")
    lines = [line.strip().removesuffix("&") for line in text.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("rlfabric reward ") and "..." not in line]


def test_the_verifier_walkthrough_commands_parse_and_carry_the_token_where_guarded() -> None:
    parser = build_parser()
    commands = _commands("examples/verifiers/README.md")
    assert {argv[2] for argv in commands} >= {"serve", "register", "list", "unregister", "score"}
    for argv in commands:
        parser.parse_args(argv[1:])  # exits (fails the test) on a flag the command does not take
        if argv[2] in ("register", "unregister"):  # RegisterVerifier / UnregisterVerifier are guarded
            assert "--auth-token-file" in argv, shlex.join(argv)


def test_security_md_names_the_clients_that_take_the_token() -> None:
    text = (REPO / "docs" / "security.md").read_text().replace("\n", " ")
    claim = re.search(r"Clients take the client subset: (.*?) have `--auth-token-file`", text)
    assert claim, "security.md's list of clients that take --auth-token-file moved: update this test"
    named = [c.split() for c in re.findall(r"`rlfabric ([^`]+)`", claim.group(1))]
    commands = [[*words[:-1], alt] for words in named for alt in words[-1].split("|")]
    assert ["reward", "list"] not in commands
    subparsers = build_parser()._subparsers._group_actions[0].choices
    for command in [*commands, ["reward", "list"]]:
        parser = subparsers[command[0]]
        if len(command) > 1:
            parser = parser._subparsers._group_actions[0].choices[command[1]]
        takes = "--auth-token-file" in parser._option_string_actions
        assert takes == (command != ["reward", "list"]), f"rlfabric {' '.join(command)}: --auth-token-file {takes}"
