"""Rules of the multi-turn keys (`rl_config.multi_turn_enable` and its companions), as MindSpeed-RL uses them.

With `multi_turn_enable: true` (services/coordinator/multi_turn.py runs the turns):
- `tool_config_path` names a tool YAML that loads (services/common/config/tools.py; relative to the config's
  folder, then the working directory);
- `max_tool_calls`, `max_parallel_calls`, `max_total_response_length` and `max_tool_response_length` are >= 1
  (upstream's defaults, 0, mean nothing here), and a turn's `max_tokens` fits in `max_total_response_length`;
- `tool_response_truncate_side` is left, right or middle (unset: middle, verl's default) and `tool_parser_format`
  a registered parser (unset: hermes, the only one upstream has);
- the prompt's chat template (`prompt_type`) has a `format_observation`: the tool answers are appended in it;
- `max_model_len` holds the longest prompt plus `max_total_response_length` (every turn is a prompt of the whole
  context so far);
- routing replay is not combined with it (a continuation's routing would cover context it did not generate).
Without `multi_turn_enable` the companions are inert, as upstream reads them only with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config.errors import ConfigError
from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig

TRUNCATE_SIDES = ("left", "right", "middle")
TOOL_PARSER_FORMATS = ("hermes",)  # services/coordinator/tool_parsers.py TOOL_PARSERS


def tool_config_file(cfg: RLFabricConfig) -> Path | None:
    """The tool YAML's path: relative to the config's folder when it is there, else as written."""
    raw = cfg.rl_config.tool_config_path
    if not raw:
        return None
    path = Path(raw)
    if not path.is_absolute() and cfg.path is not None and (cfg.path.parent / path).exists():
        return cfg.path.parent / path
    return path


def multi_turn_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    rl, gen = cfg.rl_config, cfg.generate_config
    if not rl.multi_turn_enable:
        return
    for key, value in (("max_tool_calls", rl.max_tool_calls), ("max_parallel_calls", rl.max_parallel_calls),
                       ("max_total_response_length", rl.max_total_response_length),
                       ("max_tool_response_length", rl.max_tool_response_length)):
        if value < 1:
            yield Problem((f"rl_config.{key}",), f"rl_config.{key} must be at least 1 with multi_turn_enable, got "
                                                 f"{value}")
    side = rl.tool_response_truncate_side
    if side is not None and side not in TRUNCATE_SIDES:
        yield Problem(("rl_config.tool_response_truncate_side",),
                      f"rl_config.tool_response_truncate_side must be one of {', '.join(TRUNCATE_SIDES)}, got {side!r}")
    parser = rl.tool_parser_format
    if parser is not None and parser not in TOOL_PARSER_FORMATS:
        yield Problem(("rl_config.tool_parser_format",), f"rl_config.tool_parser_format must be one of "
                                                         f"{', '.join(TOOL_PARSER_FORMATS)}, got {parser!r}")
    max_tokens = gen.sampling_config.max_tokens
    if 1 <= rl.max_total_response_length < max_tokens:
        yield Problem(("rl_config.max_total_response_length", "generate_config.sampling_config.max_tokens"),
                      f"rl_config.max_total_response_length ({rl.max_total_response_length}) is below one turn's "
                      f"max_tokens ({max_tokens}); raise it or lower max_tokens")
    longest = rl.max_prompt_length - 1 + rl.max_total_response_length
    if rl.max_total_response_length >= 1 and longest > gen.max_model_len:
        yield Problem(("generate_config.max_model_len", "rl_config.max_total_response_length"),
                      f"the longest prompt kept (max_prompt_length - 1 = {rl.max_prompt_length - 1}) plus "
                      f"max_total_response_length ({rl.max_total_response_length}) is {longest} tokens, more than "
                      f"generate_config.max_model_len ({gen.max_model_len}); every turn's prompt is the whole "
                      f"context so far")
    if cfg.rlfabric.routing_replay != "none":
        yield Problem(("rlfabric.routing_replay", "rl_config.multi_turn_enable"),
                      "rlfabric.routing_replay is not supported with multi_turn_enable yet; set it to none")
    yield from _tool_file(cfg)


def _tool_file(cfg: RLFabricConfig) -> Iterable[Problem]:
    from services.common.config.tools import load_tool_config

    path = tool_config_file(cfg)
    if path is None:
        yield Problem(("rl_config.tool_config_path",), "rl_config.multi_turn_enable needs rl_config.tool_config_path "
                                                        "(the tool YAML, e.g. configs/tools/retool_config.yaml)")
        return
    try:
        load_tool_config(path)
    except ConfigError as e:  # a missing file included
        yield Problem(("rl_config.tool_config_path",), f"rl_config.tool_config_path: {e}")
