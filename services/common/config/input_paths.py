"""The files a run reads, checked before any service starts.

A launcher (`rlfabric up`, `rlfabric system up`) that started six services and then failed on a missing
tokenizer folder would show a rank's traceback after a minute of loading; this names every missing path at
once, with the key that names it, where that key was set, and the command that makes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.common import pipeline_layout
from services.common.config.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig

# What examples/grpo/tiny_assets.sh makes; configs/*_tiny_cpu.yaml name these paths.
TINY_ASSETS_DIR = "runs/tiny_cpu"
TINY_ASSETS_COMMAND = "bash examples/grpo/tiny_assets.sh"


def dataset_files(prefix: str) -> list[Path]:
    """The prompt files of a dataset prefix preprocessed by `rlfabric preprocess` (MindSpeed-RL's layout)."""
    stem = f"{prefix}_packed_input_ids_document"
    return [Path(stem + ".idx"), Path(stem + ".bin")]


# The seed's quick start (docs/quickstart.md): `preprocess_data.sh NAME` writes ./dataset/NAME/data_*.
PREPROCESS_SCRIPT = "bash examples/data/preprocess_data.sh"
DATASET_CONFIGS = Path("configs/datasets")


def _how_to_make(path: str, usual: str) -> str:
    if Path(path).is_relative_to(TINY_ASSETS_DIR):
        return f"`{TINY_ASSETS_COMMAND}` makes it (`make up` runs it for the default config)"
    return usual


def _how_to_preprocess(prefix: str) -> str:
    """The command that writes `prefix`: the quick start's script when the prefix is its `dataset/NAME/data`."""
    parts = Path(prefix).parts
    if len(parts) >= 3 and parts[-3:-2] == ("dataset",) and parts[-1] == "data" \
            and (DATASET_CONFIGS / f"{parts[-2]}.yaml").is_file():
        return f"run `{PREPROCESS_SCRIPT} {parts[-2]}` from the repository root"
    return f"run `rlfabric preprocess DATASET.yaml --set output_prefix={prefix}`"


def _how_to_make_model(cfg: RLFabricConfig, key: str, path: str) -> str:
    """A model folder's remedy: the HF model itself, or the conversion that writes the checkpoint `load` names."""
    hf = cfg.actor_config.tokenizer_name_or_path
    if key.endswith("tokenizer_name_or_path") or not hf or hf == path:
        return "put the Hugging Face model folder there (config.json, tokenizer files, *.safetensors)"
    return (f"convert the Hugging Face model with `rlfabric convert hf2mcore {_hf2mcore_flags(cfg, key)} {hf} {path}` "
            f"(or point it at a Hugging Face model folder)")


def _hf2mcore_flags(cfg: RLFabricConfig, key: str) -> str:
    """The converter's flags for the layout the trainer of `key`'s role loads: TP, PP, EP and uneven stages."""
    mt = cfg.ref_config if key.startswith("ref_config.") else cfg.actor_config
    if key.startswith("critic_config.") and cfg.critic_config is not None:
        mt = cfg.critic_config
    flags = [f"--tp {mt.tensor_model_parallel_size}", f"--pp {mt.pipeline_model_parallel_size}"]
    if mt.num_experts is not None and mt.expert_model_parallel_size > 1:
        flags.append(f"--ep {mt.expert_model_parallel_size}")
    for flag, name in (("--num-layer-list", "num_layer_list"), ("--noop-layers", "noop_layers")):
        value = getattr(mt, name)
        if value is not None:  # the YAML's spelling ("7,7,8", a list, one integer) as the flag's "7,7,8"
            flags.append(f"{flag} {','.join(map(str, pipeline_layout.layer_numbers(value, name)))}")
    return " ".join(flags)


def missing_input_paths(cfg: RLFabricConfig) -> list[ConfigIssue]:
    """One issue per path the run reads that is not there (relative paths from the current directory)."""
    issues: list[ConfigIssue] = []
    models = {"tokenizer_name_or_path": cfg.actor_config.tokenizer_name_or_path,
              "generate_config.tokenizer_name_or_path": cfg.derived.rollout_tokenizer_name_or_path,
              "actor_config.load": cfg.actor_config.load}
    if cfg.derived.reference_trainer:
        models["ref_config.load"] = cfg.derived.ref_model_load_path
    if cfg.critic_config is not None:
        models["critic_config.load"] = cfg.critic_config.load
    seen: set[str] = set()
    for key, path in models.items():
        if not path or path in seen:
            continue
        seen.add(path)
        if not Path(path).is_dir():
            usual = _how_to_make_model(cfg, key, path)
            issues.append(ConfigIssue(cfg.where(key), f"no folder {path}; {_how_to_make(path, usual)}",
                                      cfg.source(key)))
    validates = cfg.rlfabric.val_interval > 0 or cfg.rlfabric.val_before_train
    datasets = {"data_path": cfg.actor_config.data_path,
                "rlfabric.val_data_path": cfg.rlfabric.val_data_path if validates else None}
    for key, prefix in datasets.items():
        if not prefix:
            continue
        absent = [str(f) for f in dataset_files(prefix) if not f.is_file()]
        if absent:
            usual = _how_to_preprocess(prefix)
            issues.append(ConfigIssue(cfg.where(key), f"no preprocessed dataset at {prefix} (missing "
                                                      f"{', '.join(absent)}); {_how_to_make(prefix, usual)}",
                                      cfg.source(key)))
    return issues


def check_run_files(cfg: RLFabricConfig) -> list[Path]:
    """What a launcher checks before it starts anything: every input path exists, and the model block matches
    each config.json found (services/common/config/hf_check.py). Returns the model folders checked.

    Raises:
        ConfigError: naming every missing path and every mismatch, all at once.
    """
    from services.common.config.hf_check import check_model_files

    issues = missing_input_paths(cfg)
    checked: list[Path] = []
    try:
        checked = check_model_files(cfg)
    except ConfigError as e:
        issues += e.issues
    if issues:
        raise ConfigError(issues, str(cfg.path) if cfg.path else None)
    return checked
