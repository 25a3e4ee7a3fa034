"""Activation memory of one device: what each pipeline stage keeps for backward, per micro-batch.

Pure functions of a model shape and a training layout (no torch, no config), like arithmetic.py; docs/memory.md
derives each term. All results are bytes on one device (one TP x PP rank).

Activations follow the accounting of Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (MLSys 2023, arXiv:2205.05198): the bytes each layer keeps for backward, per micro-batch,
with tensor parallelism dividing what is split over heads / the MLP width, sequence parallelism also dividing
the rest, selective recompute dropping the core attention and full recompute keeping only each checkpointed
unit's input. Their GPT (4h GeLU MLP, dropout) is replaced here by what megatron-core keeps for the models
rlfabric trains (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU of width f, no dropout), in two
kernel sets: `fused` (flash attention, fused RMSNorm / SwiGLU / RoPE: what an accelerator run uses when the
config asks for them) and `UNFUSED` (megatron-core's local spec, what runs on CPU), counted from the tensors
autograd saves in each (checked against services/trainer/memory.py's ActivationTracker in the tests).

MoE layers keep their experts' share and the dispatch (services/planning/experts.py).
"""

from __future__ import annotations

import dataclasses

from services.planning.arithmetic import ModelShape, Stages, ceil_div, stage_span
from services.planning.experts import ExpertLayout, expert_mlp_bytes, moe_dispatch_bytes

# An RMSNorm keeps its rstd in fp32, one value per token; the unfused one (torch's composite rms_norm)
# computes in fp32 and keeps an fp32 copy of its input and of x * rstd whatever the model dtype.
_RSTD = 4
_UNFUSED_NORM = 2 * 4
# rlfabric gathers the response positions with an int64 index per (row, response position) (step.py).
_INDEX = 8


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which fused kernels the run uses (they change what autograd keeps)."""

    flash_attention: bool
    fused_norm: bool
    fused_swiglu: bool
    fused_rope: bool
    softmax_in_fp32: bool = True


UNFUSED = Kernels(flash_attention=False, fused_norm=False, fused_swiglu=False, fused_rope=False)


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Activation recomputation (Megatron's recompute_* keys and MindSpeed's recompute_activation_function)."""

    granularity: str | None = None  # None, "selective" or "full"
    method: str = "uniform"  # full: "uniform" or "block"
    num_layers: int = 1
    activation_function: bool = False


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: `rows` sequences padded to `seq` tokens, `response` positions whose logits are kept."""

    rows: int
    seq: int
    response: int
    tokens: int | None = None  # packed micro-batches: the real token count (default rows x seq)

    @property
    def n_tokens(self) -> int:
        return self.tokens if self.tokens is not None else self.rows * self.seq


@dataclasses.dataclass(frozen=True)
class TrainShape:
    """How a stage trains: TP, sequence parallelism, activation bytes, kernels, recompute."""

    tp: int = 1
    sequence_parallel: bool = False
    act_bytes: int = 2
    kernels: Kernels = UNFUSED
    recompute: Recompute = Recompute()
    experts: ExpertLayout | None = None  # MoE: the expert layout (default: ep 1, etp = tp)

    @property
    def expert_layout(self) -> ExpertLayout:
        return self.experts or ExpertLayout(ep=1, etp=self.tp)


def _mlp_bytes(m: ModelShape, mb: MicroBatch, ts: TrainShape, moe: bool, values: int) -> int:
    """`values` values per token and MLP width of one layer's MLP (the dense SwiGLU, or this rank's experts)."""
    if moe and m.experts is not None:
        return expert_mlp_bytes(mb.n_tokens, m.experts, ts.expert_layout, tp=ts.tp,
                                sequence_parallel=ts.sequence_parallel, act_bytes=ts.act_bytes, swiglu_values=values)
    return mb.n_tokens * values * m.ffn * ts.act_bytes // ts.tp


def _layer_parts(m: ModelShape, mb: MicroBatch, ts: TrainShape, moe: bool = False) -> dict[str, int]:
    """Bytes one layer (a MoE layer with `moe`) keeps for backward of one micro-batch, by part, without recompute."""
    t, b, k = ts.tp, ts.act_bytes, ts.kernels
    tok, rep = mb.n_tokens, ts.tp if ts.sequence_parallel else 1
    heads, kv, d, h = m.heads // t, max(m.kv_heads // t, 1), m.head_dim, m.hidden
    # Two norms (input and rstd; unfused also x * rstd, in fp32) and the inputs of the QKV and FC1 linears.
    norm = h * (b if k.fused_norm else _UNFUSED_NORM) + _RSTD
    parts = {"norms_and_linear_inputs": tok * (2 * norm + 2 * h * b) // rep}
    parts["rope"] = 0 if k.fused_rope else mb.seq * 4 * d * b  # cos and sin for q and k, per position
    if k.flash_attention:
        # Q and K after RoPE, V (a view of the fused QKV output, which stays whole), the output and the fp32
        # log-sum-exp per head.
        parts["attention"] = tok * (_qkv_kept(heads, kv, d) * b + heads * d * b + 4 * heads)
    else:
        # Q, K and V expanded to every query head, the output; scores: the softmax output (fp32 under
        # softmax_in_fp32, plus the cast copy the value matmul keeps).
        parts["attention"] = tok * 4 * heads * d * b + mb.rows * heads * mb.seq * mb.seq * _score_bytes(b, k)
    # SwiGLU: FC1 output (gate and up) and the FC2 input; unfused also silu(gate) and the up operand.
    parts["mlp"] = _mlp_bytes(m, mb, ts, moe, 3 if k.fused_swiglu else 5)
    if moe and m.experts is not None:
        # A MoE layer's SwiGLU is its experts' over the token copies routed here; it also keeps their permuted
        # input and the router's scores.
        parts["moe_dispatch"] = moe_dispatch_bytes(tok, m.experts, ts.expert_layout, tp=t,
                                                   sequence_parallel=ts.sequence_parallel, hidden=h, act_bytes=b)
    return parts


def _qkv_kept(heads: int, kv: int, d: int) -> int:
    """Per token: Q and K after RoPE (new tensors) and the fused QKV output a view of V keeps alive."""
    return (heads + kv) * d + (heads + 2 * kv) * d


def _score_bytes(b: int, k: Kernels) -> int:
    return b if b == 4 or not k.softmax_in_fp32 else 4 + b


@dataclasses.dataclass(frozen=True)
class StageActivations:
    """Activation bytes of one pipeline stage for one micro-batch, and how many micro-batches it holds.

    `held` stays from the forward to the end of the micro-batch's backward (layers, token ids, mask);
    `head` is the last stage's part that backward frees first (final norm, response gather, output-layer
    input); `logits_saved` the fp32 response logits the loss keeps; `backward_peak` the high-water of the
    micro-batch's own backward (recompute rebuilding a unit on top of what is held).
    """

    per_layer: int  # one layer as recompute leaves it
    held: int
    head: int
    logits_saved: int
    logits_transient: int  # the raw (and upcast) logits alive while the loss runs: allocator-visible only
    backward_peak: int
    in_flight: int  # micro-batches whose activations the stage holds at once (1F1B)

    @property
    def saved_peak(self) -> int:
        """Peak bytes kept for backward (what services/trainer/memory.py's ActivationTracker measures)."""
        others = (self.in_flight - 1) * (self.held + self.head)
        return others + max(self.held + self.head + self.logits_saved, self.backward_peak)

    @property
    def peak(self) -> int:
        """`saved_peak` plus the transient logits (closer to what a device allocator sees)."""
        others = (self.in_flight - 1) * (self.held + self.head)
        return max(self.saved_peak, others + self.held + self.head + self.logits_saved + self.logits_transient)


def _stage_kinds(m: ModelShape, pp: int, stage: int, first: int = 0, count: int | None = None, stages: Stages = None
                 ) -> list[tuple[bool, int]]:
    """(MoE?, how many) of the stage's layers first .. first + count - 1 (default all), kinds present only."""
    start, n_layers = stage_span(m.num_layers, pp, stage, stages)
    count = n_layers - first if count is None else count
    n_moe = m.moe_layers(start + first, count)
    return [(moe, n) for moe, n in ((False, count - n_moe), (True, n_moe)) if n]


def stage_activations(m: ModelShape, mb: MicroBatch, ts: TrainShape, *, pp: int = 1, stage: int = 0,
                      micro_batches: int = 1, stages: Stages = None) -> StageActivations:
    """Activations of pipeline stage `stage` of `pp` while it trains `micro_batches` micro-batches (1F1B).

    A stage of dense and MoE layers sums each kind's layers; what backward rebuilds on top is the larger kind's.
    `stages`: the layers of each stage (`stage_span`).
    """
    _, n_layers = stage_span(m.num_layers, pp, stage, stages)
    rc, t, b, k, tok = ts.recompute, ts.tp, ts.act_bytes, ts.kernels, mb.n_tokens
    rep = t if ts.sequence_parallel else 1
    heads, kv, d = m.heads // t, max(m.kv_heads // t, 1), m.head_dim
    parts, full, mlp_redo = {}, {}, {}
    for moe in (False, True) if m.experts is not None else (False,):
        parts[moe] = _layer_parts(m, mb, ts, moe)
        full[moe] = sum(parts[moe].values())
        mlp_redo[moe] = 0
        if rc.activation_function:
            # MindSpeed's: keep FC1's output only; backward refills the activation's output (and the unfused
            # SwiGLU keeps silu(gate) while it does).
            mlp_redo[moe] = _mlp_bytes(m, mb, ts, moe, 1 if k.fused_swiglu else 2)
            parts[moe]["mlp"] = _mlp_bytes(m, mb, ts, moe, 2)
    kinds = _stage_kinds(m, pp, stage, stages=stages)
    shared = tok * 8 if stage == 0 else 0  # token ids kept by the embedding
    if not k.flash_attention:
        shared += mb.seq * mb.seq  # the bool causal mask, kept once for every layer
    if rc.granularity == "full":
        # Each checkpointed unit keeps its input; the rotary frequencies (fp32) are kept once. The first norm
        # of a unit keeps that same input when it keeps its input as is (fused, or fp32).
        unit_input = tok * m.hidden * b // rep
        shared += mb.seq * d * 4
        dup = unit_input if (k.fused_norm or b == 4) else 0
        n = max(1, min(rc.num_layers, n_layers))
        per_layer = unit_input
        rebuilt = max(full[moe] for moe, _ in _stage_kinds(m, pp, stage, 0, n, stages))
        if rc.method == "block":  # the first n layers of the stage are checkpointed one by one
            plain = sum(c * full[moe] for moe, c in _stage_kinds(m, pp, stage, n, stages=stages)) \
                if n < n_layers else 0
            layers = n * unit_input + plain
            backward = n * unit_input + rebuilt - dup  # the plain layers are freed before the checkpointed ones
        else:  # uniform: units of n layers
            layers = ceil_div(n_layers, n) * unit_input
            backward = layers + n * rebuilt - dup
    elif rc.granularity == "selective":
        # Core attention recomputed: its inputs (Q, K after RoPE, the QKV output under V) and output stay.
        redo = parts[False]["attention"] - tok * _qkv_kept(heads, kv, d) * b - tok * heads * d * b
        for p in parts.values():
            p["attention"] = tok * (_qkv_kept(heads, kv, d) + heads * d) * b
        per_layer = max(sum(parts[moe].values()) for moe, _ in kinds)
        layers = sum(c * sum(parts[moe].values()) for moe, c in kinds)
        # The attention is redone after backward has passed (and freed) the layer's MLP half.
        backward = layers + max(max(redo - parts[moe]["mlp"] - parts[moe].get("moe_dispatch", 0)
                                    - parts[moe]["norms_and_linear_inputs"] // 2, mlp_redo[moe]) for moe, _ in kinds)
    else:
        per_layer = max(sum(parts[moe].values()) for moe, _ in kinds)
        layers = sum(c * sum(parts[moe].values()) for moe, c in kinds)
        backward = layers + max(mlp_redo[moe] for moe, _ in kinds)
    head = logits_saved = logits_transient = 0
    if stage == pp - 1:
        h, r = m.hidden, mb.rows * mb.response
        norm = h * (b if k.fused_norm else _UNFUSED_NORM) + _RSTD
        # The final norm (its slice of the sequence under SP), its output (gathered whole in front of the output
        # layer under SP, kept by the response gather), the gather's index, the output layer's input.
        head = tok * norm // rep + tok * h * b + r * (_INDEX + h * b)
        logits_saved = r * m.vocab * 4  # full vocabulary on every TP rank, fp32 (grpo_loss upcasts)
        logits_transient = r * m.vocab * (b + (4 if b < 4 else 0))
    return StageActivations(per_layer=per_layer, held=layers + shared, head=head, logits_saved=logits_saved,
                            logits_transient=logits_transient, backward_peak=backward + shared,
                            in_flight=max(1, min(pp - stage, micro_batches)))


def forward_only_peak(m: ModelShape, mb: MicroBatch, ts: TrainShape, *, pp: int = 1, stage: int = 0,
                      stages: Stages = None) -> int:
    """Estimated peak of a no-grad forward (log-probs): the residual stream, one layer's working set, logits.

    Nothing is kept between layers; a layer's temporaries are bounded by what it would keep for backward (of the
    stage's larger layer kind, dense or MoE). The last stage holds the response logits in the model dtype, their
    fp32 upcast and the scaled copy.
    """
    layer = max(sum(_layer_parts(m, mb, ts, moe).values()) for moe, _ in _stage_kinds(m, pp, stage, stages=stages))
    peak = 2 * mb.n_tokens * m.hidden * ts.act_bytes + layer
    if stage == pp - 1:
        peak += mb.rows * mb.response * m.vocab * (ts.act_bytes + 8)
    return peak
