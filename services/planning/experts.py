"""Mixture-of-experts terms of the memory formulas (Qwen3-MoE: routed experts, a softmax top-k router).

Pure functions, like arithmetic.py and activations.py, which add these terms to the dense ones; docs/memory.md
derives them.

Parameters: a MoE layer replaces the dense SwiGLU (`3 h f`) by a router (`E h`, held whole by every TP rank, as
megatron-core's TopKRouter and vLLM's replicated gate are) and `E` experts of `3 h f_moe` each. Megatron places
them by its expert layout (services/common/config/derived.py): `ep` ranks share one copy of the experts, each rank
holding `E / ep` of them, each split over `etp` ranks (MindSpeed's `moe_tp_extend_ep`: ep = EP x TP, etp = 1).
The distributed optimizer shards expert state over the expert-data-parallel group, Megatron's
`world / (ep x etp x pp)`, which is `tp x dp / (ep x etp)`; the other parameters over DP as before.

Activations: a MoE layer routes each of the tokens a rank holds to `topk` experts; with balanced routing a rank's
experts receive as many token copies as it sends. Under sequence parallelism the tokens are split over TP and an
expert-TP group gathers its ranks' tokens, so a rank's experts see `T topk etp / tp` token copies (`T topk` without
moe_tp_extend_ep, `T topk / tp` with it); without sequence parallelism every TP rank holds (and routes) all `T`.
Each copy keeps the experts' SwiGLU (`3 f_moe / etp` values, as the dense MLP does) and the permuted input of the
grouped FC1 (`h`); the router keeps its logits and fp32 probabilities (`E (B + 4)` per token it holds). This is an
estimate: routing is never perfectly balanced and no MoE activation peak has been measured against it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Experts:
    """The routed experts of a MoE model: how many, their MLP width, the router's top-k, which layers have them."""

    num_experts: int
    ffn: int  # moe_ffn_hidden_size: each expert's SwiGLU width (per gate)
    topk: int
    layers: tuple[int, ...]  # indices of the MoE layers (the others have the dense MLP of width `ffn_hidden_size`)

    def expert_params(self, hidden: int) -> int:
        """Parameters of all experts of one MoE layer (gate, up and down projections; no biases)."""
        return self.num_experts * 3 * hidden * self.ffn

    def router_params(self, hidden: int) -> int:
        return self.num_experts * hidden

    def layers_in(self, first: int, count: int) -> int:
        """How many of layers first .. first + count - 1 are MoE layers."""
        return sum(first <= i < first + count for i in self.layers)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Megatron's expert layout of a trainer: `ep` ranks share one copy of the experts, each split over `etp`."""

    ep: int = 1
    etp: int = 1

    @classmethod
    def of(cls, *, tp: int, ep: int, tp_extend_ep: bool) -> ExpertLayout:
        """From the YAML's TP and expert_model_parallel_size (MindSpeed's moe_tp_extend_ep: EP x TP and 1)."""
        return cls(ep=ep * tp, etp=1) if tp_extend_ep else cls(ep=ep, etp=tp)

    def expert_dp(self, *, tp: int, dp: int) -> int | None:
        """Megatron's expert-data-parallel size, world / (ep x etp x pp); None when the layout does not fill it."""
        ranks = tp * dp
        return ranks // (self.ep * self.etp) if ranks % (self.ep * self.etp) == 0 else None

    def params_per_layer(self, experts: Experts, hidden: int) -> int:
        """Expert parameters one rank holds per MoE layer: E / ep experts, each split over etp."""
        return experts.num_experts // self.ep * 3 * hidden * experts.ffn // self.etp


def expert_token_copies(tokens: int, experts: Experts, layout: ExpertLayout, *, tp: int, sequence_parallel: bool
                        ) -> int:
    """Token copies a rank's experts process in one MoE layer (balanced routing; see the module docstring)."""
    if sequence_parallel:
        return tokens * experts.topk * layout.etp // tp
    return tokens * experts.topk


def expert_mlp_bytes(tokens: int, experts: Experts, layout: ExpertLayout, *, tp: int, sequence_parallel: bool,
                     act_bytes: int, swiglu_values: int) -> int:
    """Bytes the experts' SwiGLU of one MoE layer keeps on one rank: `swiglu_values` values per token copy and
    expert width (3 fused, 5 unfused, 2 under recompute_activation_function, as for the dense MLP)."""
    copies = expert_token_copies(tokens, experts, layout, tp=tp, sequence_parallel=sequence_parallel)
    return copies * swiglu_values * experts.ffn * act_bytes // layout.etp


def moe_dispatch_bytes(tokens: int, experts: Experts, layout: ExpertLayout, *, tp: int, sequence_parallel: bool,
                       hidden: int, act_bytes: int) -> int:
    """Bytes one MoE layer keeps around its experts: the permuted token copies (the grouped FC1's input) and the
    router's logits and fp32 probabilities of the tokens the rank holds."""
    copies = expert_token_copies(tokens, experts, layout, tp=tp, sequence_parallel=sequence_parallel)
    held = tokens // tp if sequence_parallel else tokens
    return copies * hidden * act_bytes + held * experts.num_experts * (act_bytes + 4)
