"""Loading MindSpeed-RL YAML: upstream values, defaults, merging, strict keys, overrides, includes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import (
    ConfigError,
    GenerateConfig,
    MegatronConfig,
    ModelConfig,
    MsprobeConfig,
    ProfilerConfig,
    RLConfig,
    SamplingConfig,
    load_config,
    load_config_dict,
)


@pytest.fixture
def upstream_7b(repo_root: Path) -> Path:
    return repo_root / "configs" / "grpo_qwen25_7b_A3.yaml"


def _write(tmp_path: Path, repo_root: Path, text: str, name: str = "cfg.yaml") -> Path:
    """A config file beside a copy of configs/model/, so `defaults: model:` includes resolve."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    for src in (repo_root / "configs" / "model").glob("*.yaml"):
        (model_dir / src.name).write_text(src.read_text())
    path = tmp_path / name
    path.write_text(text)
    return path


def _issues(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    return "\n".join(exc.value.errors)


def test_upstream_7b_loads_with_exact_values(upstream_7b: Path):
    cfg = load_config(upstream_7b)
    a, rl, gen = cfg.actor_config, cfg.rl_config, cfg.generate_config
    assert cfg.model_name == "qwen25_7b"
    # megatron_training keys
    assert a.global_batch_size == 32
    assert a.seq_length == 2048
    assert a.use_fused_rmsnorm is True and a.sequence_parallel is True and a.use_flash_attn is True
    assert a.distributed_backend == "nccl"
    assert a.split == "100,0,0"
    assert a.dataset_additional_keys == ["labels"]
    assert a.reuse_fp32_param is False
    assert a.seed == 1
    assert a.stage == "ray_grpo"
    # actor_config keys: `lr: 1e-6` is a string to PyYAML and must arrive as a float
    assert a.micro_batch_size == 4
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (2, 2)
    assert a.lr == 1e-6 and isinstance(a.lr, float)
    assert a.min_lr == 0.0 and a.adam_beta2 == 0.95 and a.lr_decay_style == "constant"
    assert a.finetune is True and a.no_load_optim is True
    # model block from configs/model/qwen25_7b.yaml
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (28, 3584, 18944)
    assert cfg.model.num_query_groups == 4 and cfg.model.group_query_attention is True
    assert cfg.model.rotary_base == 1000000 and cfg.model.norm_epsilon == 1e-6
    assert cfg.model.padded_vocab_size == 152064 and cfg.model.untie_embeddings_and_output_weights is True
    # rl_config
    assert rl.n_samples_per_prompt == 8 and rl.mini_batch_size == 32 and rl.epochs == 1
    assert rl.kl_penalty == "low_var_kl" and rl.init_kl_coef == 0.001 and rl.clip_ratio == 0.2
    assert rl.verifier_function == ["math_17k_acc"] and rl.verifier_weight == [1.0]
    assert rl.actor_resource.num_npus == 16 and rl.use_integrated_worker is True
    assert rl.num_cpus_for_local_task == 1.0 and rl.log_max_throughput is False
    # generate_config
    assert gen.infer_tensor_parallel_size == 1 and gen.max_model_len == 4096 and gen.max_num_seqs == 1024
    assert gen.dtype == "bfloat16" and gen.gpu_memory_utilization == 0.4
    s = gen.sampling_config
    assert (s.logprobs, s.max_tokens, s.top_p, s.top_k, s.min_p, s.temperature) == (1, 2048, 1.0, -1, 0.0, 1.0)
    assert s.seed is None  # not in the YAML: the default fills it (MindSpeed-RL would drop the key)
    # derived: 16 devices / (TP2 x PP2) -> DP 4; rollout engines of 1 device -> DP 16
    d = cfg.derived
    assert d.actor_data_parallel_size == 4 and d.rollout_data_parallel_size == 16
    assert d.samples_per_iteration == 256 and d.mini_batch_size_samples == 256
    assert d.samples_per_actor_dp_rank == 64 and d.micro_batches_per_mini_batch == 16
    assert d.actor_rollout_dispatch_size == 16 and d.actor_update_dispatch_size == 64
    assert d.skip_old_log_probs is True and d.params_dtype == "bfloat16"
    assert cfg.warnings == []


def test_views_merge_model_block_then_megatron_training_then_actor(upstream_7b: Path):
    cfg = load_config(upstream_7b, overrides=["megatron_training.lr=3e-6", "megatron_training.num_layers=4",
                                              "actor_config.lr=2e-6"])
    assert cfg.megatron_training.lr == 3e-6  # megatron_training alone
    assert cfg.actor_config.lr == 2e-6  # actor wins
    assert cfg.megatron_training.micro_batch_size is None and cfg.actor_config.micro_batch_size == 4
    assert cfg.model.num_layers == 4  # megatron_training wins over the model block
    assert cfg.megatron_training.hidden_size == 3584  # both views include the block
    assert cfg.ref_config is cfg.actor_config  # integrated mode, no ref_config section
    assert cfg.where("lr") == "actor_config.lr" and cfg.where("hidden_size") == "model.qwen25_7b.hidden_size"


def test_tiny_cpu_config_is_fp32_single_device(repo_root: Path):
    cfg = load_config(repo_root / "configs" / "grpo_tiny_cpu.yaml")
    a, m = cfg.actor_config, cfg.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size) == \
        (128, 2, 4, 2, 512)
    assert m.padded_vocab_size == 4096 and m.untie_embeddings_and_output_weights is False
    assert m.rotary_base == 10000 and m.add_qkv_bias is True
    assert a.bf16 is False and cfg.generate_config.dtype == "float32" and cfg.derived.params_dtype == "float32"
    assert a.distributed_backend == "gloo" and cfg.rl_config.actor_resource.num_npus == 1
    assert (a.global_batch_size, cfg.rl_config.n_samples_per_prompt, cfg.rl_config.mini_batch_size,
            a.micro_batch_size) == (8, 8, 8, 16)
    assert (a.seq_length, cfg.rl_config.max_prompt_length, cfg.sampling_config.max_tokens,
            cfg.generate_config.max_model_len) == (128, 64, 64, 256)
    assert a.lr == 1e-5 and cfg.rl_config.init_kl_coef == 0.001 and cfg.rl_config.kl_penalty == "low_var_kl"
    assert cfg.rl_config.verifier_function == ["math_17k_acc"] and cfg.rl_config.use_integrated_worker is False
    assert (a.train_iters, a.save_interval) == (10, 5)
    assert cfg.derived.actor_data_parallel_size == 1 and cfg.derived.micro_batches_per_mini_batch == 4
    assert cfg.warnings == []


def test_tiny_cpu_paths_can_be_overridden(repo_root: Path, tmp_path: Path):
    cfg = load_config(repo_root / "configs" / "grpo_tiny_cpu.yaml",
                      overrides=[f"megatron_training.tokenizer_name_or_path={tmp_path}/tok",
                                 f"megatron_training.data_path={tmp_path}/data/tiny"])
    assert cfg.actor_config.tokenizer_name_or_path == f"{tmp_path}/tok"
    assert cfg.derived.rollout_tokenizer_name_or_path == f"{tmp_path}/tok"
    assert cfg.actor_config.data_path == f"{tmp_path}/data/tiny"


def test_section_defaults():
    # Defaults follow MindSpeed-RL's config classes.
    m = MegatronConfig()
    assert (m.bf16, m.seed, m.lr, m.micro_batch_size, m.tensor_model_parallel_size) == (True, 1234, None, None, 1)
    assert (m.lr_decay_style, m.weight_decay, m.clip_grad, m.adam_beta1, m.adam_beta2) == ("linear", 0.01, 1.0, 0.9, 0.999)
    assert (m.distributed_backend, m.dataset_additional_keys, m.num_query_groups, m.norm_epsilon) == ("nccl", [], 1, 1e-5)
    rl = RLConfig()
    assert (rl.n_samples_per_prompt, rl.mini_batch_size, rl.epochs, rl.max_prompt_length) == (1, 1, 1, 512)
    assert (rl.kl_penalty, rl.kl_ctrl_type, rl.init_kl_coef, rl.adv_estimator) == ("low_var_kl", "fixed", 0.01, "group_norm")
    assert (rl.clip_ratio, rl.entropy_coeff, rl.clip_ratio_low, rl.clip_ratio_high) == (0.2, 0.0, 0.1, 0.1)
    assert (rl.verifier_function, rl.verifier_weight, rl.use_integrated_worker, rl.blocking) == (["base_acc"], [1.0], True, True)
    assert (rl.token_level_loss, rl.rollout_max_tokens, rl.filter_groups_metric) == (True, 2048, "acc")
    assert rl.actor_resource.num_npus is None and rl.integrated_mode_config is None
    assert RLConfig().verifier_function is not rl.verifier_function  # mutable defaults are not shared
    g = GenerateConfig()
    assert (g.infer_tensor_parallel_size, g.infer_pipeline_parallel_size, g.max_num_seqs, g.max_model_len) == (8, 1, 1, 2048)
    assert (g.dtype, g.gpu_memory_utilization, g.enforce_eager, g.tokenizer_name_or_path) == ("bfloat16", 0.5, True, None)
    s = SamplingConfig()
    assert (s.logprobs, s.max_tokens, s.top_p, s.top_k, s.min_p, s.temperature, s.detokenize, s.seed) == \
        (1, 128, 1.0, 50, 0.0, 0.2, False, None)
    p = ProfilerConfig()
    assert (p.profile, p.stage, p.profile_level, p.profile_step_start, p.profile_step_end) == (False, "all", "level0", 1, 2)
    assert MsprobeConfig().dump_path == "./msprobe_dump"
    assert ModelConfig().position_embedding_type == "learned_absolute"


@pytest.mark.parametrize("cls", [MegatronConfig, RLConfig, GenerateConfig, SamplingConfig, ProfilerConfig,
                                 MsprobeConfig])
def test_every_field_has_help(cls):
    missing = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
    assert missing == []


def test_defaults_fill_sections_the_yaml_omits(tmp_path: Path, repo_root: Path):
    path = _write(tmp_path, repo_root, """
defaults:
  - model: [tiny_qwen2]
megatron_training: {model: tiny_qwen2, global_batch_size: 4, micro_batch_size: 1, seq_length: 64, train_iters: 1,
                    lr: 1.0e-5, bf16: false, attention_dropout: 0.0, hidden_dropout: 0.0}
rl_config: {actor_resource: {num_npus: 1}}
generate_config: {infer_tensor_parallel_size: 1, max_model_len: 1024, dtype: float32, max_num_batched_tokens: 1024}
""")
    cfg = load_config(path)
    assert cfg.rl_config == RLConfig(actor_resource=cfg.rl_config.actor_resource)
    assert cfg.sampling_config == SamplingConfig()
    assert cfg.profiler_config == {} and cfg.msprobe_config == MsprobeConfig()
    assert cfg.derived.prompt_type_path == str(tmp_path / "model" / "templates.json")


def test_misspelled_key_names_key_section_closest_key_and_line(upstream_7b: Path, tmp_path: Path, repo_root: Path):
    text = upstream_7b.read_text().replace("  clip_ratio: 0.2", "  clip_ration: 0.2")
    path = _write(tmp_path, repo_root, text)
    line = text.splitlines().index("  clip_ration: 0.2") + 1
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.errors == [f"{path}:{line}: rl_config.clip_ration: unknown key `clip_ration` in section "
                                f"`rl_config`; did you mean `clip_ratio`?"]
    assert exc.value.issues[0].key == "rl_config.clip_ration"


@pytest.mark.parametrize(("section", "key", "expected"), [
    ("megatron_training", "use_flash_atn", "did you mean `use_flash_attn`?"),
    ("generate_config.sampling_config", "temprature", "did you mean `temperature`?"),
    ("megatron_training", "n_samples_per_prompt", "`n_samples_per_prompt` belongs in section `rl_config`"),
    ("rl_config", "max_model_len", "belongs in section `generate_config`"),
    ("rl_config.actor_resource", "num_gpus", "did you mean `num_npus`?"),
    ("profiler_config.integrated", "profile_levl", "did you mean `profile_level`?"),
    ("model.qwen25_7b", "num_layer", "did you mean `num_layers`?"),
    ("rl_config", "zzzz_qqq", "no similar key exists"),
])
def test_unknown_keys_in_every_section(upstream_7b: Path, section: str, key: str, expected: str):
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=[f"{section}.{key}=1"])
    (error,) = exc.value.errors
    assert f"unknown key `{key}` in section `{section}`" in error and expected in error
    assert error.startswith(f"--override {section}.{key}=1: ")


def test_unknown_top_level_section(upstream_7b: Path):
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=["rl_confg.clip_ratio=0.1"])
    assert exc.value.errors == ["--override rl_confg.clip_ratio=0.1: rl_confg: unknown top-level section "
                                "`rl_confg`; did you mean `rl_config`?"]


def test_all_errors_reported_together(upstream_7b: Path):
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=[
            "rl_config.clip_ration=0.3",  # unknown key
            "megatron_training.bf16=sometimes",  # type error
            "generate_config.sampling_config.temprature=1.0",  # unknown nested key
            "generate_config.infer_pipeline_parallel_size=2",  # rule
            "rl_config.verifier_weight=[1.0, 2.0]",  # rule
        ])
    errors = _issues(exc)
    assert len(exc.value.issues) == 5, errors
    for needle in ("`clip_ration`", "`bf16` in section `megatron_training` must be boolean",
                   "`temprature`", "`generate_config.infer_pipeline_parallel_size` is 2",
                   "verifier_weight has 2"):
        assert needle in errors
    assert str(exc.value).startswith("5 configuration errors in ")


@pytest.mark.parametrize(("override", "expected"), [
    ("megatron_training.global_batch_size=abc", "`global_batch_size` in section `megatron_training` must be integer or null, got 'abc' (str)"),
    ("megatron_training.bf16=1", "`bf16` in section `megatron_training` must be boolean (true/false), got 1 (int)"),
    ("rl_config.clip_ratio=high", "`clip_ratio` in section `rl_config` must be number, got 'high' (str)"),
    ("rl_config.n_samples_per_prompt=8.5", "must be integer, got 8.5 (float)"),
    ("rl_config.verifier_weight=[a]", "`verifier_weight` in section `rl_config` must be list of number"),
    ("rl_config.verifier_function=math_17k_acc", "must be list of string, got 'math_17k_acc' (str)"),
    ("generate_config.sampling_config=5", "`sampling_config` in section `generate_config` must be mapping (SamplingConfig)"),
    ("actor_config.tensor_model_parallel_size=true", "must be integer, got True (bool)"),
])
def test_type_errors_name_key_and_expected_type(upstream_7b: Path, override: str, expected: str):
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=[override])
    assert expected in _issues(exc)


def test_overrides_parse_yaml_scalars(upstream_7b: Path):
    cfg = load_config(upstream_7b, overrides=[
        "rl_config.clip_ratio=0.3",
        "rl_config.use_tensorboard=false",
        "rl_config.verifier_function=[math_17k_acc, format]",
        "rl_config.verifier_weight=[0.9, 0.1]",
        "generate_config.sampling_config.temperature=0.7",
        "generate_config.sampling-config.top-k=20",  # dashes in overrides too
        "rl_config.integrated_mode_config.ref_model_load_path=./base",  # creates a missing nested section
        "actor_config.lr=2e-6",
        "profiler_config.integrated.profile_level=level1",
    ])
    assert cfg.rl_config.clip_ratio == 0.3 and cfg.rl_config.use_tensorboard is False
    assert cfg.rl_config.verifier_function == ["math_17k_acc", "format"]
    assert cfg.rl_config.verifier_weight == [0.9, 0.1]
    assert cfg.sampling_config.temperature == 0.7 and cfg.sampling_config.top_k == 20
    assert cfg.sampling_config.max_tokens == 2048  # untouched siblings keep their values
    assert cfg.rl_config.integrated_mode_config.ref_model_load_path == "./base"
    assert cfg.actor_config.lr == 2e-6
    assert cfg.profiler_config["integrated"].profile_level == "level1"
    assert cfg.source("rl_config.clip_ratio") == "--override rl_config.clip_ratio=0.3"


@pytest.mark.parametrize(("override", "expected"), [
    ("rl_config.clip_ratio", "an override must look like `section.key=value`"),
    ("=3", "an override must look like `section.key=value`"),
    ("rl_config.clip_ratio.low=0.1", "`rl_config.clip_ratio` is a value, not a section"),
    ("defaults.model=x", "`defaults` cannot be overridden"),
    ("rl_config.verifier_weight=[1.0", "YAML syntax error"),
])
def test_malformed_overrides(upstream_7b: Path, override: str, expected: str):
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=[override])
    assert expected in _issues(exc)


def test_dashes_read_as_underscores(upstream_7b: Path, tmp_path: Path, repo_root: Path):
    text = (upstream_7b.read_text().replace("use_flash_attn: true", "use-flash-attn: false")
            .replace("n_samples_per_prompt: 8", "n-samples-per-prompt: 4"))
    cfg = load_config(_write(tmp_path, repo_root, text))
    assert cfg.actor_config.use_flash_attn is False and cfg.rl_config.n_samples_per_prompt == 4
    assert cfg.derived.samples_per_iteration == 32 * 4


def test_dash_and_underscore_spelling_of_one_key_is_an_error(upstream_7b: Path, tmp_path: Path, repo_root: Path):
    text = upstream_7b.read_text().replace("  use_flash_attn: true", "  use_flash_attn: true\n  use-flash-attn: false")
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, repo_root, text))
    assert "`use-flash-attn` and `use_flash_attn` name the same key" in _issues(exc)


def test_duplicate_yaml_key_names_both_lines(tmp_path: Path, repo_root: Path, upstream_7b: Path):
    text = upstream_7b.read_text().replace("  epochs: 1", "  epochs: 1\n  epochs: 2")
    path = _write(tmp_path, repo_root, text)
    first = text.splitlines().index("  epochs: 1") + 1
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.errors == [f"{path}:{first + 1}: epochs: duplicate key `epochs` (first set at {path}:{first}); "
                                f"YAML keeps only the last one, so delete one of them"]


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path, repo_root: Path):
    path = _write(tmp_path, repo_root, "rl_config:\n  clip_ratio: 0.2\n  verifier_weight: [1.0\n  epochs: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    (error,) = exc.value.errors
    assert error.startswith(f"{path}:3: YAML syntax error")  # the unclosed bracket's line (PyYAML notices it on 4)


def test_missing_file(tmp_path: Path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "nope.yaml")
    assert exc.value.errors == [f"{tmp_path / 'nope.yaml'}: config file not found (check the path)"]


def test_missing_model_file_and_unknown_block(tmp_path: Path, repo_root: Path, upstream_7b: Path):
    text = upstream_7b.read_text().replace("      - qwen25_7b", "      - qwen25_7c")
    path = _write(tmp_path, repo_root, text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    errors = _issues(exc)
    assert f"model `qwen25_7c` not found: looked for qwen25_7c.yaml in {tmp_path.resolve() / 'model'}" in errors
    assert "model block `qwen25_7b` is not loaded (loaded: none)" in errors


def test_inline_model_block_overrides_included_one(upstream_7b: Path):
    cfg = load_config(upstream_7b, overrides=["model.qwen25_7b.num_layers=4"])
    assert cfg.model.num_layers == 4 and cfg.model.hidden_size == 3584


def test_load_config_dict_without_file(repo_root: Path):
    data = yaml.safe_load((repo_root / "configs" / "grpo_tiny_cpu.yaml").read_text())
    cfg = load_config_dict(data, base_dir=repo_root / "configs")
    assert cfg.model.hidden_size == 128 and cfg.path is None


def test_to_dict_has_every_section_and_derived(upstream_7b: Path):
    out = load_config(upstream_7b).to_dict()
    assert list(out) == ["model_name", "model", "megatron_training", "actor_config", "ref_config", "rl_config",
                         "generate_config", "profiler_config", "msprobe_config", "rlfabric", "derived"]
    assert out["generate_config"]["sampling_config"]["max_tokens"] == 2048
    assert out["derived"]["actor_data_parallel_size"] == 4


def test_derived_values_for_other_layouts(upstream_7b: Path):
    cfg = load_config(upstream_7b, overrides=[
        "generate_config.infer_tensor_parallel_size=4", "rl_config.mini_batch_size=8", "rl_config.epochs=2",
        "rl_config.actor_forward_micro_batch_size=8"])
    d = cfg.derived
    assert d.rollout_engine_size == 4 and d.rollout_data_parallel_size == 4
    assert d.actor_rollout_dispatch_size == 256 // 4
    assert d.mini_batch_size_samples == 64 and d.mini_batches_per_iteration == 4
    assert d.optimizer_steps_per_iteration == 8
    assert d.mini_batch_samples_per_dp_rank == 16 and d.micro_batches_per_mini_batch == 4
    assert d.skip_old_log_probs is False  # several optimizer steps: old log-probs are needed
    assert d.actor_forward_micro_batch_size == 8 and d.ref_forward_micro_batch_size == 4


def test_bf16_with_fp32_rollout_is_a_warning_not_an_error(upstream_7b: Path):
    cfg = load_config(upstream_7b, overrides=["generate_config.dtype=float32"])
    assert len(cfg.warnings) == 1 and "rollout runs in float32 but training in bfloat16" in cfg.warnings[0]


def test_package_imports_without_torch_or_vllm(repo_root: Path):
    code = ("import sys; import services.common.config, services.common.config_cli; "
            "from services.common.config import load_config; load_config('configs/grpo_qwen25_7b_A3.yaml'); "
            "heavy = sorted(m for m in ('torch', 'vllm', 'megatron', 'transformers', 'grpc') if m in sys.modules); "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("defaults", ["[{model: tiny_qwen2}]", "[_self_, {model: [tiny_qwen2]}]", "{model: tiny_qwen2}"])
def test_defaults_forms(repo_root: Path, tmp_path: Path, defaults: str):
    text = (repo_root / "configs" / "grpo_tiny_cpu.yaml").read_text()
    _, tail = text.split("megatron_training:", 1)
    path = _write(tmp_path, repo_root, f"defaults: {defaults}\nmegatron_training:{tail}")
    assert load_config(path).model.hidden_size == 128


def test_unsupported_defaults_entry(repo_root: Path, tmp_path: Path):
    text = (repo_root / "configs" / "grpo_tiny_cpu.yaml").read_text()
    _, tail = text.split("megatron_training:", 1)
    path = _write(tmp_path, repo_root, f"defaults: [{{model: [tiny_qwen2]}}, {{optimizer: adam}}]\n"
                                       f"megatron_training:{tail}")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "unsupported defaults entry {'optimizer': 'adam'}; only `- model: [name, ...]`" in _issues(exc)


def test_resolved_sections_round_trip_through_yaml(upstream_7b: Path):
    """Every resolved value (defaults included) is accepted back by the strict loader unchanged."""
    cfg = load_config(upstream_7b)
    actor = {**dataclasses.asdict(cfg.actor_config), "model": None}
    data = {"megatron_training": actor, "rl_config": dataclasses.asdict(cfg.rl_config),
            "generate_config": dataclasses.asdict(cfg.generate_config),
            "msprobe_config": dataclasses.asdict(cfg.msprobe_config),
            "profiler_config": {"integrated": dataclasses.asdict(ProfilerConfig())}}
    again = load_config_dict(yaml.safe_load(yaml.safe_dump(data)))
    assert again.actor_config == dataclasses.replace(cfg.actor_config, model=None)
    assert again.rl_config == cfg.rl_config and again.generate_config == cfg.generate_config
    assert again.derived == dataclasses.replace(cfg.derived, prompt_type_path=None)


def test_rlfabric_section_is_optional_and_strict(upstream_7b: Path):
    assert load_config(upstream_7b).rlfabric.rpc_deadline_s == 600.0
    cfg = load_config(upstream_7b, overrides=["rlfabric.rpc_deadline_s=30"])
    assert cfg.rlfabric.rpc_deadline_s == 30.0
    with pytest.raises(ConfigError, match="rpc_deadline_s"):
        load_config(upstream_7b, overrides=["rlfabric.rpc_deadline=30"])
