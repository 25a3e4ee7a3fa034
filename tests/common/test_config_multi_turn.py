"""The multi-turn keys (`rl_config.multi_turn_enable` and companions, services/common/config/multi_turn.py): the
upstream multi-turn settings (MindSpeed-RL's dapo_qwen25_7b_A2_multi_turn.yaml: its `rl_config` multi-turn block
and lengths, here on the upstream 7B config) with the upstream ReTool and search tool YAMLs load; bad values are
refused naming the key; without multi_turn_enable the companions are inert."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.coordinator.settings import multi_turn_settings

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = REPO.parent / "shared" / "reference" / "mindspeed_rl"
BASE = UPSTREAM / "configs" / "grpo_qwen25_7b_A3.yaml"
TOOLS = UPSTREAM / "asked" / "tools"
# dapo_qwen25_7b_A2_multi_turn.yaml's multi-turn block and the lengths it runs them with.
MULTI_TURN = ["rl_config.multi_turn_enable=true", "rl_config.max_tool_calls=1", "rl_config.max_parallel_calls=1",
              "rl_config.max_total_response_length=2048", "rl_config.max_tool_response_length=256",
              "rl_config.tool_response_truncate_side=middle", "rl_config.tool_parser_format=hermes",
              "rl_config.max_prompt_length=2048", "generate_config.max_model_len=4096",
              "generate_config.sampling_config.max_tokens=2048"]


def _load(*overrides: str, tools: str = "retool_config.yaml"):
    return load_config(BASE, overrides=[*MULTI_TURN, f"rl_config.tool_config_path={TOOLS / tools}", *overrides])


@pytest.mark.parametrize("tools", ["retool_config.yaml", "search_tool_config.yaml"])
def test_the_upstream_multi_turn_settings_load_with_the_upstream_tool_yamls(tools: str) -> None:
    settings = multi_turn_settings(_load(tools=tools))
    assert (settings.max_tool_calls, settings.max_parallel_calls, settings.max_total_response_length,
            settings.max_tool_response_length, settings.truncate_side, settings.tool_parser_format) == \
        (1, 1, 2048, 256, "middle", "hermes")


@pytest.mark.parametrize(("override", "key", "words"), [
    ("rl_config.max_tool_calls=0", "rl_config.max_tool_calls", "at least 1"),
    ("rl_config.tool_response_truncate_side=both", "rl_config.tool_response_truncate_side", "left, right, middle"),
    ("rl_config.tool_parser_format=json", "rl_config.tool_parser_format", "hermes"),
    ("rl_config.max_total_response_length=1024", "rl_config.max_total_response_length", "below one turn's"),
    ("generate_config.max_model_len=3000", "generate_config.max_model_len", "whole context"),
    ("rl_config.tool_config_path=/nonexistent/tools.yaml", "rl_config.tool_config_path", "/nonexistent/tools.yaml"),
])
def test_bad_multi_turn_values_are_refused_naming_the_key(override: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _load(override)
    messages = {i.key: i.message for i in exc.value.issues}
    assert key in messages and words in messages[key], messages


def test_without_multi_turn_enable_the_companions_are_inert() -> None:
    cfg = load_config(BASE, overrides=["rl_config.max_tool_calls=0", "rl_config.tool_parser_format=json"])
    assert multi_turn_settings(cfg) is None


def test_the_upstream_multi_turn_config_loads_unchanged(repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MindSpeed-RL's dapo_qwen25_7b_A2_multi_turn.yaml as it is (tests/common/upstream_configs/); its tool YAML path
    is relative to where upstream runs from, the repository root, where configs/tools/ holds upstream's bytes."""
    from services.common.config.multi_turn import tool_config_file
    from services.common.config.tools import load_tool_config

    monkeypatch.chdir(repo_root)
    cfg = load_config(Path(__file__).parent / "upstream_configs" / "dapo_qwen25_7b_A2_multi_turn.yaml")
    assert cfg.rl_config.multi_turn_enable and cfg.derived.algorithm == "dapo"
    settings = multi_turn_settings(cfg)
    assert (settings.max_tool_calls, settings.max_parallel_calls, settings.max_total_response_length,
            settings.max_tool_response_length, settings.truncate_side, settings.tool_parser_format) == \
        (1, 1, 2048, 256, "middle", "hermes")  # as MULTI_TURN above copies them
    (tool,) = load_tool_config(tool_config_file(cfg)).tools
    assert tool.config.sandbox_fusion_url.endswith("/run_code")
