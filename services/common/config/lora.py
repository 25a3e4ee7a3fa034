"""Rules of the LoRA keys (`lora_r`, `lora_alpha`, `lora_target_modules`, `lora_ckpt_filter`) as the trainer's
LoRA (services/trainer/lora.py) can run them.

LoRA is on when the actor's `lora_target_modules` is set (MindSpeed-LLM's switch). Then:
- the targets are a non-empty list of Megatron's linear names that lora.py adapts (`TARGET_NAMES`, kept equal to
  lora.py's `TARGET_KINDS` by tests/trainer/test_lora_worker.py: config may not import the trainer);
- `lora_r` and `lora_alpha` are positive (the scaling is alpha / r);
- a mixture-of-experts model takes no `linear_fc1` / `linear_fc2`: lora.py refuses expert layers (their own TP group
  and token dispatch), and Megatron's MoE layers name their experts' linears so; a multi-latent-attention model has
  no `linear_qkv` (MLA's projections have other names), so that target would adapt nothing.
The reference never gets adapters (it is the base model), so a `ref_config` that asks for them is refused rather
than ignored; `lora_ckpt_filter` without LoRA has no adapters to filter and is refused too, as is
`rl_config.share_backbone` (the reference is the actor's backbone with its adapters off: no reference trainer).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig

# Megatron's module names services/trainer/lora.py adapts (its TARGET_KINDS).
TARGET_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_EXPERT_TARGETS = ("linear_fc1", "linear_fc2")


def lora_enabled(cfg: RLFabricConfig) -> bool:
    """Whether the actor trains LoRA adapters (`lora_target_modules` set)."""
    return cfg.actor_config.lora_target_modules is not None


def lora_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    a = cfg.actor_config
    if cfg.ref_config is not a and cfg.where("ref_config.lora_target_modules") in cfg.provenance.sources:
        yield Problem(("ref_config.lora_target_modules",),
                      "`ref_config.lora_target_modules` is set: the reference is the base model and never gets "
                      "LoRA adapters; remove it (set LoRA in `megatron_training` or `actor_config`)")
    if cfg.rl_config.share_backbone and not lora_enabled(cfg):
        yield Problem(("rl_config.share_backbone",),
                      "`rl_config.share_backbone` is true but LoRA is off (`lora_target_modules` unset): the reference "
                      "would be the actor's backbone with its adapters off, and a full-weights actor has no adapters; "
                      "set lora_target_modules or remove share_backbone")
    if not lora_enabled(cfg):
        if a.lora_ckpt_filter:
            yield Problem(("lora_ckpt_filter",),
                          f"`{cfg.where('lora_ckpt_filter')}` is true but LoRA is off (`lora_target_modules` unset): "
                          f"there are no adapters to save alone; set lora_target_modules or remove lora_ckpt_filter")
        return
    targets = a.lora_target_modules
    where = cfg.where("lora_target_modules")
    unknown = [t for t in targets if t not in TARGET_NAMES]
    if unknown:
        yield Problem(("lora_target_modules",),
                      f"`{where}` names {unknown}, which rlfabric's LoRA does not adapt; the valid names are "
                      f"{list(TARGET_NAMES)} (Megatron's linear layers)")
    elif not targets:
        yield Problem(("lora_target_modules",),
                      f"`{where}` is empty; name at least one of {list(TARGET_NAMES)}, or remove it to train full "
                      f"weights")
    for key, value in (("lora_r", a.lora_r), ("lora_alpha", a.lora_alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            yield Problem((key,), f"`{cfg.where(key)}` is {value!r}; it must be a positive number (the adapter's "
                                  f"output is scaled by lora_alpha / lora_r)")
    experts = [t for t in targets if t in _EXPERT_TARGETS]
    if a.num_experts is not None and experts:
        yield Problem(("lora_target_modules", "num_experts"),
                      f"`{where}` names {experts}, but this is a mixture-of-experts model (num_experts "
                      f"{a.num_experts}): rlfabric's LoRA (services/trainer/lora.py) does not adapt expert layers; "
                      f"leave linear_fc1 and linear_fc2 out")
    if a.multi_latent_attention and "linear_qkv" in targets:
        yield Problem(("lora_target_modules", "multi_latent_attention"),
                      f"`{where}` names linear_qkv, but multi-latent attention has no such layer (its projections "
                      f"have other names), so it would adapt nothing; leave linear_qkv out")
