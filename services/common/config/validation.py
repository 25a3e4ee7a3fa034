"""Cross-field validation rules of a loaded configuration.

Each rule is a small function `(cfg) -> Iterable[Problem]`; `RULES` lists them in the order their
messages are shown. A `Problem` names the keys it is about (a bare name is a Megatron field of the
actor view, others are dotted, e.g. `rl_config.n_samples_per_prompt`) so the loader can drop
problems about keys that already failed to parse, and can point at the file:line that set them.

Messages follow TRL's style: say what was set, why it cannot work, and what to change, with the
numbers involved. MindSpeed-RL's rules are kept (see parity.md), plus checks that catch upstream
failures early (head counts vs TP, vLLM limits). Refused keys (refusals.py), the algorithm's rules
(algorithm.py), the batch-size rules (batches.py), the resume rule (resume.py), the activation-memory rules
(activations.py) and the mixture-of-experts rules (moe.py) join them in `RULES`. `WARNINGS` lists rules whose
findings are only warnings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common import pipeline_layout
from services.common.config.activations import activation_rules, activation_warnings
from services.common.config.algorithm import algorithm_rules
from services.common.config.batches import batch_divisibility, dispatch_sizes
from services.common.config.lora import lora_rules
from services.common.config.moe import moe_rules
from services.common.config.multi_turn import multi_turn_rules
from services.common.config.partial_rollout import partial_rollout
from services.common.config.ppo import ppo_rules
from services.common.config.problems import Problem, Rule
from services.common.config.resume import resume_rule
from services.common.config.rl import ADV_ESTIMATORS, CRITIC_ADV_ESTIMATORS, KL_CTRL_TYPES, KL_PENALTIES
from services.common.config.routing_replay import routing_replay_rules
from services.common.config.sections import WEIGHT_TRANSPORTS

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
DISTRIBUTED_BACKENDS = ("nccl", "hccl", "gloo")
ROLLOUT_DTYPES = ("bfloat16", "float16", "float32", "auto")
# The deepest pipeline rlfabric.max_staleness may ask for: each step keeps that many rollouts ahead of the update.
MAX_PIPELINE_DEPTH = 4


def _q(cfg: RLFabricConfig, key: str) -> str:
    """`section.key` in backticks, for messages."""
    return f"`{cfg.where(key)}`"


def required_training_keys(cfg: RLFabricConfig) -> Iterable[Problem]:
    for key, example in (("global_batch_size", 32), ("micro_batch_size", 4), ("seq_length", 2048),
                         ("train_iters", 500), ("lr", "1e-6")):
        if getattr(cfg.actor_config, key) is None:
            yield Problem((key,), f"`{key}` is not set; set it in `megatron_training` or `actor_config` "
                                  f"(e.g. `{key}: {example}`)")
    if cfg.rl_config.actor_resource.num_npus is None:
        yield Problem(("rl_config.actor_resource",),
                      "`rl_config.actor_resource.num_npus` is not set; set the number of devices for the actor, "
                      "e.g. `actor_resource: {num_npus: 16}` (1 on a CPU machine)")
    # A ref_config section is read over megatron_training alone: the actor_config's micro_batch_size is not its.
    if cfg.derived.use_reference and cfg.ref_config is not cfg.actor_config \
            and cfg.derived.ref_forward_micro_batch_size is None:
        yield Problem(("rl_config.ref_forward_micro_batch_size", "ref_config.micro_batch_size"),
                      "the reference's forward micro-batch is not set: neither `rl_config.ref_forward_micro_batch_size` "
                      "nor `micro_batch_size` in `ref_config` or `megatron_training`; set one (e.g. "
                      "`ref_forward_micro_batch_size: 4`)")


def model_architecture(cfg: RLFabricConfig) -> Iterable[Problem]:
    actor = cfg.actor_config
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if getattr(actor, k) is None]
    if missing:
        hint = (f"the model block `{cfg.model_name}` does not set them" if cfg.model_name
                else "no model block is selected: set `megatron_training.model` to a block listed under "
                     "`defaults: - model:`")
        yield Problem(("megatron_training.model",),
                      f"model architecture incomplete: {', '.join(missing)} not set; {hint}")
        return
    heads, groups = actor.num_attention_heads, actor.num_query_groups
    if actor.group_query_attention and groups >= 1 and heads % groups != 0:
        yield Problem(("num_query_groups", "num_attention_heads"),
                      f"num_attention_heads ({heads}) must be divisible by num_query_groups ({groups})")
    tp = actor.tensor_model_parallel_size
    if tp >= 1:
        if heads % tp != 0:
            yield Problem(("tensor_model_parallel_size", "num_attention_heads"),
                          f"num_attention_heads ({heads}) must be divisible by tensor_model_parallel_size ({tp}); "
                          f"choose a TP that divides {heads}")
        if actor.group_query_attention and groups >= 1 and groups % tp != 0:
            yield Problem(("tensor_model_parallel_size", "num_query_groups"),
                          f"num_query_groups ({groups}) must be divisible by tensor_model_parallel_size ({tp}); "
                          f"choose a TP that divides {groups}")
    yield from pipeline_stages(cfg)
    itp = cfg.generate_config.infer_tensor_parallel_size
    if itp >= 1 and heads % itp != 0:
        yield Problem(("generate_config.infer_tensor_parallel_size", "num_attention_heads"),
                      f"num_attention_heads ({heads}) must be divisible by "
                      f"generate_config.infer_tensor_parallel_size ({itp}) for vLLM")


def pipeline_stages(cfg: RLFabricConfig) -> Iterable[Problem]:
    """Each role's layers placed on its pipeline stages as Megatron / MindSpeed place them: evenly, or by
    num_layer_list, with noop_layers counted among num_layers (services/common/pipeline_layout.py)."""
    sections = [("", cfg.actor_config)]
    if cfg.ref_config is not cfg.actor_config:
        sections.append(("ref_config.", cfg.ref_config))
    for prefix, mt in sections:
        if mt.num_layers is None or mt.pipeline_model_parallel_size < 1:
            continue  # model_architecture / positive_sizes report these
        try:
            pipeline_layout.stage_layers(mt.num_layers, mt.pipeline_model_parallel_size, mt.num_layer_list,
                                         mt.noop_layers)
        except pipeline_layout.StageLayoutError as e:
            keys = ("pipeline_model_parallel_size", "num_layers") if e.key == "pipeline_model_parallel_size" \
                else (e.key,)
            yield Problem(tuple(prefix + k for k in keys), str(e))


def positive_sizes(cfg: RLFabricConfig) -> Iterable[Problem]:
    a, rl, gen = cfg.actor_config, cfg.rl_config, cfg.generate_config
    values = {
        "global_batch_size": a.global_batch_size, "micro_batch_size": a.micro_batch_size,
        "seq_length": a.seq_length, "train_iters": a.train_iters,
        "tensor_model_parallel_size": a.tensor_model_parallel_size,
        "pipeline_model_parallel_size": a.pipeline_model_parallel_size,
        "context_parallel_size": a.context_parallel_size,
        "expert_model_parallel_size": a.expert_model_parallel_size,
        "rl_config.n_samples_per_prompt": rl.n_samples_per_prompt,
        "rl_config.mini_batch_size": rl.mini_batch_size, "rl_config.epochs": rl.epochs,
        "rl_config.max_prompt_length": rl.max_prompt_length,
        "rl_config.actor_resource.num_npus": rl.actor_resource.num_npus,
        "generate_config.infer_tensor_parallel_size": gen.infer_tensor_parallel_size,
        "generate_config.infer_pipeline_parallel_size": gen.infer_pipeline_parallel_size,
        "generate_config.infer_expert_parallel_size": gen.infer_expert_parallel_size,
        "generate_config.max_num_seqs": gen.max_num_seqs, "generate_config.max_model_len": gen.max_model_len,
        "generate_config.max_num_batched_tokens": gen.max_num_batched_tokens,
        "generate_config.sampling_config.max_tokens": gen.sampling_config.max_tokens,
    }
    for name in ("actor_forward_micro_batch_size", "ref_forward_micro_batch_size"):
        values[f"rl_config.{name}"] = getattr(rl, name)
    if a.save_interval is not None:
        values["save_interval"] = a.save_interval
    for key, value in values.items():
        if value is not None and value < 1:
            yield Problem((key,), f"{_q(cfg, key)} must be at least 1, got {value}")


def sequence_lengths(cfg: RLFabricConfig) -> Iterable[Problem]:
    a, rl, gen = cfg.actor_config, cfg.rl_config, cfg.generate_config
    if a.seq_length is not None and gen.max_model_len < a.seq_length:
        yield Problem(("generate_config.max_model_len", "seq_length"),
                      f"generate_config.max_model_len ({gen.max_model_len}) is smaller than seq_length "
                      f"({a.seq_length}); raise max_model_len to at least {a.seq_length} or lower seq_length")
    # Prompts of max_prompt_length tokens or more are dropped, so the longest kept is one shorter.
    if rl.max_prompt_length - 1 >= gen.max_model_len:
        yield Problem(("generate_config.max_model_len", "rl_config.max_prompt_length"),
                      f"the longest prompt kept (max_prompt_length - 1 = {rl.max_prompt_length - 1}) leaves no room "
                      f"for a response within generate_config.max_model_len ({gen.max_model_len}); raise "
                      f"max_model_len above {rl.max_prompt_length - 1} or lower max_prompt_length")


def response_room_warnings(cfg: RLFabricConfig) -> Iterable[Problem]:
    """Upstream's vLLM stops a response at max_model_len; the coordinator asks for no more than that leaves
    (services/coordinator/generation.py), so a config whose longest prompts lack room for max_tokens means there
    what it means upstream: their responses are shorter."""
    rl, gen = cfg.rl_config, cfg.generate_config
    max_tokens = gen.sampling_config.max_tokens
    room = gen.max_model_len - max_tokens
    if rl.max_prompt_length - 1 > room >= 0:
        yield Problem(("generate_config.max_model_len", "rl_config.max_prompt_length",
                       "generate_config.sampling_config.max_tokens"),
                      f"prompts of more than {room} tokens (max_model_len {gen.max_model_len} - max_tokens "
                      f"{max_tokens}; max_prompt_length allows {rl.max_prompt_length - 1}) get fewer than max_tokens "
                      f"response tokens: generation stops at max_model_len (finish reason length), as upstream")


def device_layout(cfg: RLFabricConfig) -> Iterable[Problem]:
    a, r, rl, gen, d = cfg.actor_config, cfg.ref_config, cfg.rl_config, cfg.generate_config, cfg.derived
    npus = rl.actor_resource.num_npus
    if npus is not None and npus >= 1 and d.actor_model_parallel_size and d.actor_data_parallel_size is None:
        tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
        yield Problem(("rl_config.actor_resource.num_npus", "tensor_model_parallel_size"),
                      f"rl_config.actor_resource.num_npus ({npus}) must be divisible by tensor x pipeline x "
                      f"context parallel size ({tp} x {pp} x {cp} = {tp * pp * cp}); use a multiple of "
                      f"{tp * pp * cp} devices or smaller parallel sizes")
    ref_npus = d.ref_world_size
    if (r is not a and ref_npus is not None and d.ref_model_parallel_size
            and d.ref_data_parallel_size is None):
        yield Problem(("rl_config.reference_resource", "ref_config.tensor_model_parallel_size"),
                      f"the reference's {ref_npus} devices must be divisible by its tensor x pipeline x context "
                      f"parallel size ({d.ref_model_parallel_size})")
    # An infer_pipeline_parallel_size other than 1 is a refused value (sections.py): no second message here.
    engine_ok = gen.infer_pipeline_parallel_size == 1 and d.rollout_engine_size
    if engine_ok and npus is not None and npus >= 1 and d.rollout_data_parallel_size is None:
        yield Problem(("generate_config.infer_tensor_parallel_size",),
                      f"rl_config.actor_resource.num_npus ({npus}) must be divisible by "
                      f"generate_config.infer_tensor_parallel_size ({gen.infer_tensor_parallel_size}): "
                      f"each rollout engine takes that many devices")
    if gen.data_parallel_size is not None and d.rollout_data_parallel_size is not None \
            and gen.data_parallel_size != d.rollout_data_parallel_size:
        yield Problem(("generate_config.data_parallel_size",),
                      f"generate_config.data_parallel_size ({gen.data_parallel_size}) disagrees with devices / "
                      f"infer TP = {d.rollout_data_parallel_size}; remove it (it is computed)")


def algorithm_choices(cfg: RLFabricConfig) -> Iterable[Problem]:
    rl = cfg.rl_config
    if rl.kl_penalty not in KL_PENALTIES:
        yield Problem(("rl_config.kl_penalty",),
                      f"unsupported rl_config.kl_penalty `{rl.kl_penalty}`; supported: {', '.join(KL_PENALTIES)}")
    if rl.kl_ctrl_type not in KL_CTRL_TYPES:
        yield Problem(("rl_config.kl_ctrl_type",),
                      f"unsupported rl_config.kl_ctrl_type `{rl.kl_ctrl_type}`; supported: {', '.join(KL_CTRL_TYPES)}")
    if rl.adv_estimator not in ADV_ESTIMATORS + CRITIC_ADV_ESTIMATORS:
        yield Problem(("rl_config.adv_estimator",),
                      f"unsupported rl_config.adv_estimator `{rl.adv_estimator}`; rlfabric supports: "
                      f"{', '.join(ADV_ESTIMATORS)}, and gae with a critic (stage: ray_ppo)")
    if rl.clip_ratio <= 0:
        yield Problem(("rl_config.clip_ratio",), f"rl_config.clip_ratio must be positive, got {rl.clip_ratio}")
    if rl.init_kl_coef < 0:
        yield Problem(("rl_config.init_kl_coef",), f"rl_config.init_kl_coef must be >= 0, got {rl.init_kl_coef}")
    if rl.clip_higher_enable and rl.clip_ratio_low > rl.clip_ratio_high:
        yield Problem(("rl_config.clip_ratio_low", "rl_config.clip_ratio_high"),
                      f"you enabled clip_higher_enable with clip_ratio_low ({rl.clip_ratio_low}) greater than "
                      f"clip_ratio_high ({rl.clip_ratio_high}); clip-higher needs clip_ratio_low <= clip_ratio_high")
    style = cfg.actor_config.lr_decay_style
    if style not in LR_DECAY_STYLES:
        yield Problem(("lr_decay_style",),
                      f"unsupported lr_decay_style `{style}`; supported: {', '.join(LR_DECAY_STYLES)}")
    lr = cfg.actor_config.lr
    if lr is not None and lr < 0:
        yield Problem(("lr",), f"lr must be >= 0, got {lr}")
    backend = cfg.actor_config.distributed_backend
    if backend not in DISTRIBUTED_BACKENDS:
        yield Problem(("distributed_backend",),
                      f"unsupported distributed_backend `{backend}`; supported: {', '.join(DISTRIBUTED_BACKENDS)}")


def rewards(cfg: RLFabricConfig) -> Iterable[Problem]:
    rl = cfg.rl_config
    if len(rl.verifier_function) != len(rl.verifier_weight):
        yield Problem(("rl_config.verifier_weight", "rl_config.verifier_function"),
                      f"rl_config.verifier_function has {len(rl.verifier_function)} entries "
                      f"({rl.verifier_function}) but verifier_weight has {len(rl.verifier_weight)} "
                      f"({rl.verifier_weight}); give one weight per verifier")
    if rl.rule_reward and not rl.verifier_function:
        yield Problem(("rl_config.verifier_function",),
                      "rl_config.verifier_function is empty; list at least one verifier, e.g. [math_17k_acc]")
    if rl.overlong_buffer_enable:
        max_tokens = cfg.generate_config.sampling_config.max_tokens
        if rl.overlong_buffer < 1 or rl.overlong_buffer >= max_tokens:
            yield Problem(("rl_config.overlong_buffer",),
                          f"rl_config.overlong_buffer ({rl.overlong_buffer}) must be between 1 and "
                          f"sampling_config.max_tokens - 1 ({max_tokens - 1}) when overlong_buffer_enable is true")
        if rl.rollout_max_tokens != max_tokens:
            yield Problem(("rl_config.rollout_max_tokens",),
                          f"rl_config.rollout_max_tokens ({rl.rollout_max_tokens}) must equal "
                          f"generate_config.sampling_config.max_tokens ({max_tokens}) when overlong_buffer_enable "
                          f"is true; set both to the same length")
    if rl.filter_groups_enable:
        metric = rl.filter_groups_metric
        # Upstream YAMLs spell the metric either `acc` or as its logged key `grpo/acc_rewards/mean`.
        name = metric.removeprefix("grpo/").removesuffix("_rewards/mean")
        if name not in rl.verifier_function:
            yield Problem(("rl_config.filter_groups_metric",),
                          f"rl_config.filter_groups_metric `{metric}` is not one of verifier_function "
                          f"{rl.verifier_function}; dynamic sampling filters on a verifier's scores")
        fg, dp = rl.filter_groups_train_batch_size, cfg.derived.actor_data_parallel_size
        if fg < 1:
            yield Problem(("rl_config.filter_groups_train_batch_size",),
                          f"rl_config.filter_groups_train_batch_size must be at least 1, got {fg}")
        elif dp is not None and fg % dp != 0:
            yield Problem(("rl_config.filter_groups_train_batch_size",),
                          f"rl_config.filter_groups_train_batch_size ({fg}) must be divisible by the actor "
                          f"data-parallel size {dp}")
        if rl.filter_groups_max_batches == 0 or rl.filter_groups_max_batches < -1:
            yield Problem(("rl_config.filter_groups_max_batches",),
                          f"rl_config.filter_groups_max_batches must be -1 (no limit) or at least 1, "
                          f"got {rl.filter_groups_max_batches}")


def sampling(cfg: RLFabricConfig) -> Iterable[Problem]:
    gen = cfg.generate_config
    s = gen.sampling_config
    if s.temperature <= 0:
        yield Problem(("generate_config.sampling_config.temperature",),
                      f"sampling_config.temperature must be positive for training (log-probs divide logits by it), "
                      f"got {s.temperature}")
    if not 0 < s.top_p <= 1:
        yield Problem(("generate_config.sampling_config.top_p",), f"sampling_config.top_p must be in (0, 1], got {s.top_p}")
    if not 0 <= s.min_p <= 1:
        yield Problem(("generate_config.sampling_config.min_p",), f"sampling_config.min_p must be in [0, 1], got {s.min_p}")
    if s.top_k < -1:
        yield Problem(("generate_config.sampling_config.top_k",),
                      f"sampling_config.top_k must be -1 (disabled) or positive, got {s.top_k}")
    if s.logprobs < 0:
        yield Problem(("generate_config.sampling_config.logprobs",),
                      f"sampling_config.logprobs must be >= 0, got {s.logprobs}")
    if gen.dtype not in ROLLOUT_DTYPES:
        yield Problem(("generate_config.dtype",),
                      f"unsupported generate_config.dtype `{gen.dtype}`; supported: {', '.join(ROLLOUT_DTYPES)}")
    if not 0 < gen.gpu_memory_utilization <= 1:
        yield Problem(("generate_config.gpu_memory_utilization",),
                      f"generate_config.gpu_memory_utilization must be in (0, 1], got {gen.gpu_memory_utilization}")
    if gen.max_num_batched_tokens < gen.max_num_seqs:
        yield Problem(("generate_config.max_num_batched_tokens",),
                      f"generate_config.max_num_batched_tokens ({gen.max_num_batched_tokens}) must be at least "
                      f"max_num_seqs ({gen.max_num_seqs}), as vLLM requires")


def placement(cfg: RLFabricConfig) -> Iterable[Problem]:
    rl = cfg.rl_config
    if rl.use_integrated_worker:
        if rl.reference_resource is not None:
            yield Problem(("rl_config.reference_resource",),
                          "rl_config.reference_resource is set while use_integrated_worker is true; in integrated "
                          "mode the reference shares the actor's devices: remove reference_resource")
    elif rl.integrated_mode_config is not None:
        yield Problem(("rl_config.integrated_mode_config",),
                      "rl_config.integrated_mode_config is set while use_integrated_worker is false; remove it, "
                      "or set use_integrated_worker: true")
    for tracker in ("wandb", "swanlab"):
        for key in ("project", "exp_name"):
            if getattr(rl, f"use_{tracker}") and not getattr(rl, f"{tracker}_{key}"):
                yield Problem((f"rl_config.{tracker}_{key}",),
                              f"rl_config.use_{tracker} is true but {tracker}_{key} is empty; set {tracker}_project "
                              f"and {tracker}_exp_name")


def pipelining(cfg: RLFabricConfig) -> Iterable[Problem]:
    fab = cfg.rlfabric
    if not 0 <= fab.max_staleness <= MAX_PIPELINE_DEPTH:
        yield Problem(("rlfabric.max_staleness",),
                      f"rlfabric.max_staleness must be 0 (synchronous) to {MAX_PIPELINE_DEPTH} (pipelined: the rollout "
                      f"runs up to that many iterations ahead), got {fab.max_staleness}")
    elif fab.max_staleness and cfg.rl_config.use_integrated_worker:
        yield Problem(("rlfabric.max_staleness", "rl_config.use_integrated_worker"),
                      f"rlfabric.max_staleness: {fab.max_staleness} overlaps generation with the update, which needs "
                      "the rollout on devices of its own; set use_integrated_worker: false or max_staleness: 0")
    if fab.weight_transport not in WEIGHT_TRANSPORTS:
        yield Problem(("rlfabric.weight_transport",),
                      f"rlfabric.weight_transport must be {', '.join(WEIGHT_TRANSPORTS[:-1])} or "
                      f"{WEIGHT_TRANSPORTS[-1]}, got {fab.weight_transport!r}")
    if not fab.importance_sampling_cap > 0:
        yield Problem(("rlfabric.importance_sampling_cap",),
                      f"rlfabric.importance_sampling_cap must be > 0, got {fab.importance_sampling_cap}")


def determinism(cfg: RLFabricConfig) -> Iterable[Problem]:
    if not cfg.rlfabric.deterministic:
        return
    if cfg.generate_config.sampling_config.seed is None:
        yield Problem(("rlfabric.deterministic", "generate_config.sampling_config.seed"),
                      "rlfabric.deterministic: true needs a sampling seed (without one every run draws its own); "
                      "set generate_config.sampling_config.seed")
    if cfg.rlfabric.max_staleness:
        yield Problem(("rlfabric.deterministic", "rlfabric.max_staleness"),
                      f"rlfabric.deterministic: true with max_staleness {cfg.rlfabric.max_staleness}: in pipelined "
                      "mode which samples a version trains on depends on timing; set max_staleness: 0")
    if cfg.rl_config.partial_rollout_max_split > 1 and cfg.rl_config.async_engine:
        yield Problem(("rlfabric.deterministic", "rl_config.async_engine"),
                      "rlfabric.deterministic: true with partial rollout's asynchronous engine: where a round is "
                      "interrupted, and so which tokens each response has, depends on timing; set "
                      "async_engine: false (the chunked scheme is deterministic)")


def precision_warnings(cfg: RLFabricConfig) -> Iterable[Problem]:
    train, roll = cfg.derived.params_dtype, cfg.generate_config.dtype
    if roll != "auto" and roll != train:
        yield Problem(("generate_config.dtype", "bf16"),
                      f"rollout runs in {roll} but training in {train} (bf16: {cfg.actor_config.bf16}); "
                      f"log-probs of the two will differ. Use bf16: true with dtype bfloat16 on accelerators, "
                      f"bf16: false with dtype float32 on CPU")


def refused_keys(cfg: RLFabricConfig) -> Iterable[Problem]:
    """Refused keys of no feature (those of a feature are refused by the loader, one message per feature)."""
    from services.common.config.refusals import refusal_message, refused_values

    for refusal in refused_values(cfg):
        if refusal.feature is None:
            yield Problem((refusal.key,), refusal_message(cfg, refusal))


RULES: tuple[Rule, ...] = (
    required_training_keys, model_architecture, positive_sizes, sequence_lengths, device_layout, moe_rules,
    batch_divisibility, dispatch_sizes, algorithm_choices, algorithm_rules, rewards, sampling, placement,
    pipelining, partial_rollout, determinism, resume_rule, activation_rules, routing_replay_rules, multi_turn_rules,
    lora_rules, ppo_rules,
    refused_keys,
)
WARNINGS: tuple[Rule, ...] = (precision_warnings, activation_warnings, response_room_warnings)


def run_rules(cfg: RLFabricConfig, rules: Iterable[Rule]) -> list[Problem]:
    return [problem for rule in rules for problem in rule(cfg)]
