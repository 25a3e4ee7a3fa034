"""Wiring of a coordinator process: config text -> RunDriver with its loader, tokenizer, reward pool, sinks."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import yaml

from services.common.model_spec import read_config_json
from services.common.redis_store import Registry, RunJournal
from services.coordinator.run import RunDriver
from services.coordinator.sinks import FanOut, JsonlSink, MetricsSink, SwanLabSink, TensorBoardSink, WandbSink

logger = logging.getLogger(__name__)

# Held while warm_imports imports: a StartRun that came while it ran imported from a half-initialised
# transformers ("cannot import name 'AutoTokenizer'", an UNKNOWN status; tests/reliability/test_train_interrupt.py).
_IMPORTING = threading.Lock()


def load_run_config(config_yaml: str, overrides: list[str], configs_dir: Path) -> Any:
    """Parses and validates config text; `defaults: model:` includes resolve under `configs_dir/model/`."""
    from services.common.config import ConfigError, load_config_dict

    try:
        data = yaml.safe_load(config_yaml)
        return load_config_dict(data, base_dir=configs_dir, overrides=overrides, label="<StartRun config>")
    except yaml.YAMLError as e:
        raise ValueError(f"config is not valid YAML: {e}") from e
    except ConfigError as e:
        raise ValueError(str(e)) from e


def warm_imports() -> None:
    """Imports the heavy module `build_driver` needs (transformers' tokenizer classes: ~2 s of CPU, more on a busy
    2-core machine), so that a coordinator started beside the other services pays it while those start, not between
    StartRun and the first iteration. Run it in a background thread at serve time; an import error surfaces later,
    at StartRun. (The prompts' indexed datasets no longer need megatron-core: services/data/indexed_reader.py.)

    The thread runs at the lowest CPU priority: beside the other services' start-up it takes only the CPU they
    leave idle (the rollout's engine build, the last service ready, is the start-up's critical path), and it is
    done long before a run comes on an idle machine."""
    with contextlib.suppress(AttributeError, OSError):  # Linux: a thread is a task with its own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    try:
        with _IMPORTING:
            from transformers import AutoTokenizer  # noqa: F401 (transformers is lazy: this is the costly part)
    except ImportError as e:
        logger.warning("warming the coordinator's imports failed (StartRun will say why): %s", e)


def build_sinks(cfg: Any, run_dir: Path) -> MetricsSink:
    rl = cfg.rl_config
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if rl.use_tensorboard:
        sinks.append(TensorBoardSink(getattr(cfg.actor_config, "tensorboard_dir", None) or run_dir / "tensorboard"))
    if rl.use_wandb:
        sinks.append(WandbSink(rl.wandb_project, rl.wandb_exp_name, rl.wandb_save_dir or None, {}))
    if rl.use_swanlab:
        sinks.append(SwanLabSink(rl.swanlab_project, rl.swanlab_exp_name, rl.swanlab_save_dir or run_dir / "swanlab",
                                 rl.swanlab_mode or None))
    return FanOut(sinks)


def build_driver(config_yaml: str, overrides: list[str], run_id: str, *, redis_client: Any, configs_dir: Path,
                 runs_dir: Path, token: str | None = None, discovery_timeout_s: float = 300.0) -> RunDriver:
    cfg = load_run_config(config_yaml, overrides, configs_dir)
    mt = cfg.actor_config
    with _IMPORTING:  # after warm_imports, if it is running
        from transformers import AutoTokenizer

    from services.coordinator.prompt_loader import PromptLoader
    from services.coordinator.reward_pool import RewardClientPool

    tokenizer_path = cfg.derived.rollout_tokenizer_name_or_path or mt.tokenizer_name_or_path
    from services.common.model_paths import check_local_path

    tokenizer_path = check_local_path(tokenizer_path, "tokenizer_name_or_path")  # missing: at once, no hub lookup
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer at {tokenizer_path!r} (megatron_training.tokenizer_name_or_path): "
                         f"{e}") from e

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def loader(consumed: int) -> PromptLoader:
        return PromptLoader(mt.data_path, int(mt.global_batch_size), int(cfg.rl_config.max_prompt_length),
                            int(mt.seed), consumed_batches=consumed, shuffle=not mt.no_shuffle)

    loader(0)  # fail at StartRun, not mid-run, when the data is missing
    hf_config = read_config_json(tokenizer_path)  # the model's, beside its tokenizer (DataError: INVALID_ARGUMENT)
    registry = Registry(redis_client)
    pool = RewardClientPool(registry, token=token)
    multi_turn = _multi_turn(cfg, tokenizer, registry, token, decode)
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    return RunDriver(cfg, run_id, registry, RunJournal(redis_client, run_id), loader, decode, pool.score,
                     build_sinks(cfg, run_dir), hf_config, token=token, discovery_timeout_s=discovery_timeout_s,
                     score_metrics=pool.take_failover_metrics, multi_turn=multi_turn)


def _multi_turn(cfg, tokenizer, registry: Registry, token: str | None, decode):
    """With `rl_config.multi_turn_enable`: the run's turn logic (services/coordinator/multi_turn.py), else None."""
    from services.coordinator.multi_turn import build_multi_turn
    from services.coordinator.settings import multi_turn_settings
    from services.coordinator.tool_client import ToolClient
    from services.data.templates import get_template

    settings = multi_turn_settings(cfg)
    if settings is None:
        return None
    mt = cfg.actor_config
    template = None  # without prompt_type: the tokenizer's own chat template renders the answers, as upstream
    if mt.prompt_type:
        template = get_template(mt.prompt_type, cfg.derived.prompt_type_path)
        if template.format_observation is None:
            raise ValueError(f"rl_config.multi_turn_enable: template {mt.prompt_type!r} (megatron_training."
                             "prompt_type) has no format_observation to wrap the tool answers in")
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError("rl_config.multi_turn_enable: the tokenizer has no chat template to render the tool answers "
                         "with; set megatron_training.prompt_type to a template with format_observation")
    return build_multi_turn(settings, tokenizer=tokenizer, template=template,
                            tool_client=ToolClient(registry, token=token), decode=decode)
