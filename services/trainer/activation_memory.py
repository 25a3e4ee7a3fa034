"""How the trainer trades compute (or host transfers) for activation memory.

Owns `ActivationMemory`, the keys of `megatron_training` / `actor_config` / `ref_config` that decide which
activations a forward keeps for backward (services/trainer/options.py fills it from the config, model.py
applies it), and the pieces Megatron-core does not have:

- `recompute_granularity` / `recompute_method` / `recompute_num_layers`: Megatron's own recomputation,
  passed to TransformerConfig unchanged. `full` keeps only the input of each recomputed unit of layers
  (`uniform`: every `recompute_num_layers` layers form a unit; `block`: the first `recompute_num_layers`
  layers of each pipeline stage are recomputed one by one, the rest keep their activations) and runs the
  unit's forward again in backward; `selective` recomputes the core attention (softmax(QK^T)V) of every
  layer. Training passes only: a forward-only pass (log-probs) saves nothing either way. With uneven pipeline
  stages (num_layer_list, noop_layers) the config bounds recompute_num_layers by each stage's layers counting its
  no-op layers, as upstream; the trainer builds no no-op layers, so a `uniform` unit may run past a stage's last
  layer: those places are identities, as the no-op layers they stand for (`apply_to_model`).
- `recompute_activation_function`: MindSpeed's feature, written here on megatron-core's MLP
  (`recompute_activation_mlp`): the MLP keeps fc1's output, frees the SwiGLU output as soon as fc2 has used
  it, and computes it again in backward right before fc2's backward needs it (Megatron's
  CheckpointWithoutOutput, the mechanism of its own layernorm recompute). Every layer, as MindSpeed does
  without `recompute_activation_function_num_layers`.
- `sequence_parallel`: Megatron's, through TransformerConfig (TP > 1 only; at TP 1 Megatron turns it off and
  so does `model.transformer_config`); what rlfabric adds around it is services/trainer/sequence_parallel.py.
- `swap_attention`: MindSpeed's (Ascend) swapping of attention activations to host memory. MindSpeed reads
  its feature switches from the process command line when `mindspeed.megatron_adaptor` is imported, so on
  Ascend `mindspeed_flags` puts `--swap-attention` there before the trainer imports it. No other platform
  has the feature: there the trainer says so in its log and keeps activations in device memory
  (docs/config.md lists the key as read on Ascend only).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys

import torch

from services.common.config.activations import recompute_problem

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ActivationMemory:
    """The activation-memory keys as the trainer applies them (names and meanings as in the YAML)."""

    recompute_granularity: str | None = None  # None, "full" or "selective"
    recompute_method: str | None = None  # "uniform" or "block" (full only)
    recompute_num_layers: int | None = None  # full only: layers per unit (uniform) / recomputed per stage (block)
    recompute_activation_function: bool = False
    sequence_parallel: bool = False
    swap_attention: bool = False

    def __post_init__(self) -> None:
        # The config rule (services/common/config/activations.py), for options built in code too.
        problem = recompute_problem(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        if problem:
            raise ValueError(problem[1])


def transformer_config_kwargs(memory: ActivationMemory, *, tp: int, layers_per_stage: int | None) -> dict:
    """TransformerConfig's fields for `memory` at tensor-parallel size `tp` (`layers_per_stage`: every stage's layers,
    which bound recompute_num_layers; None for uneven stages, whose bound the config checked)."""
    problem = recompute_problem(memory.recompute_granularity, memory.recompute_method, memory.recompute_num_layers,
                                layers_per_stage)
    if problem:
        raise ValueError(problem[1])
    return {
        "recompute_granularity": memory.recompute_granularity,
        "recompute_method": memory.recompute_method if memory.recompute_granularity == "full" else None,
        "recompute_num_layers": memory.recompute_num_layers if memory.recompute_granularity == "full" else None,
        # Megatron-LM: "disable sequence parallelism when tp=1 to avoid change in numerics".
        "sequence_parallel": memory.sequence_parallel and tp > 1,
    }


def apply_to_model(model, memory: ActivationMemory) -> None:
    """Gives the model's dense MLPs the activation recompute, when asked, and lets `uniform` units run past the
    stage's last layer.

    The built MLPs change class (the layer spec keeps naming MLP): TransformerLayer passes the TP group only
    to a spec whose module is exactly MLP. The subclass adds no state, only its forward.
    """
    if memory.recompute_granularity == "full" and memory.recompute_method == "uniform":
        _pad_uniform_units(model.decoder, memory.recompute_num_layers)
    if not memory.recompute_activation_function:
        return
    from megatron.core.transformer.mlp import MLP

    recompute_mlp = recompute_activation_mlp()
    mlps = [m for m in model.modules() if type(m) is MLP]
    for mlp in mlps:
        _check_recomputable(mlp.config)
        mlp.__class__ = recompute_mlp


def _pad_uniform_units(block, unit: int) -> None:
    """Megatron's uniform recompute runs units [k * unit, (k + 1) * unit) of the stage's layers; a stage whose
    layers a unit does not divide (no-op layers left out of it) gets identities past its last layer."""
    layers = block.layers
    if len(layers) % unit == 0:
        return

    def layer_or_identity(index: int):
        return layers[index] if index < len(layers) else _identity_layer

    block._get_layer = layer_or_identity


def _identity_layer(*, hidden_states, context=None, **_):
    """A no-op layer as TransformerBlock calls its layers: (hidden states, context) unchanged."""
    return hidden_states, context


def _check_recomputable(config) -> None:
    unsupported = {
        "use_te_activation_func": config.use_te_activation_func,
        "activation_func_clamp_value": config.activation_func_clamp_value is not None,
        "glu_linear_offset": config.glu_linear_offset != 0.0,
    }
    bad = [k for k, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"recompute_activation_function does not support {', '.join(bad)}")


@functools.cache
def recompute_activation_mlp():
    """The MLP class of `recompute_activation_function` (built on first use: Megatron is imported lazily here)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.mlp import MLP

    class _RecomputeActivationMLP(MLP):
        """Megatron's dense MLP whose activation output is freed after fc2 and recomputed in backward."""

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None or not (self.training and torch.is_grad_enabled()):
                return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
            fc1_out, fc1_bias = self.linear_fc1(hidden_states)
            # fp8=None: CheckpointWithoutOutput treats any other value (False included) as fp8 on.
            checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
            if fc1_bias is None:
                activated = checkpoint.checkpoint(self._activation, fc1_out)
            else:
                activated = checkpoint.checkpoint(self._activation, fc1_out, fc1_bias)
            output, output_bias = self.linear_fc2(activated)
            # fc2 saved `activated` for its weight gradient; it is recomputed when fc2's output gradient arrives.
            checkpoint.discard_output_and_register_recompute(output)
            return output, output_bias

        def _activation(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            # The non-fp8 branches of MLP.forward's activation, without per-token scaling.
            cfg = self.config
            if cfg.bias_activation_fusion and self.activation_func is torch.nn.functional.silu \
                    and cfg.gated_linear_unit:
                from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

                return bias_swiglu_impl(x, bias, cfg.activation_func_fp8_input_store, False)
            if bias is not None:
                x = x + bias
            if cfg.gated_linear_unit:
                gate, linear = torch.chunk(x, 2, dim=-1)
                return cfg.activation_func(gate) * linear
            return self.activation_func(x)

    _RecomputeActivationMLP.__name__ = _RecomputeActivationMLP.__qualname__ = "RecomputeActivationMLP"
    return _RecomputeActivationMLP


def mindspeed_flags(memory: ActivationMemory) -> list[str]:
    """MindSpeed's command-line switches for the features it implements and Megatron-core does not."""
    return ["--swap-attention"] if memory.swap_attention else []


def pass_to_mindspeed(memory: ActivationMemory) -> None:
    """Put MindSpeed's switches on sys.argv, where `mindspeed.megatron_adaptor` reads them when imported.

    Raises when MindSpeed was imported before (it parses the command line once): the switch would be lost.
    """
    flags = [f for f in mindspeed_flags(memory) if f not in sys.argv]
    if not flags:
        return
    if "mindspeed.megatron_adaptor" in sys.modules:
        raise RuntimeError(f"swap_attention: MindSpeed was imported before the trainer could pass {' '.join(flags)}; "
                           f"start the trainer without importing mindspeed first")
    sys.argv.extend(flags)


def note_platform_only(memory: ActivationMemory, *, on_ascend: bool) -> None:
    """Logs the Ascend-only keys a config sets on another platform (they change nothing there)."""
    if memory.swap_attention and not on_ascend:
        logger.warning("swap_attention: true is an Ascend/MindSpeed feature; on this platform attention "
                       "activations stay in device memory (use recompute_granularity to save activation memory)")
