"""What rlfabric's trainer adds around Megatron's sequence parallelism (`sequence_parallel: true`, TP > 1).

With sequence parallelism the activations outside attention and MLP (norms, residuals, dropout) are split
along the sequence over the TP ranks, so each rank keeps 1/TP of them; Megatron's layers do the
all-gathers and reduce-scatters. Two things are left to the caller, and live here:

- Sequence length. The embedding splits the sequence over the TP ranks, so its length must be a multiple
  of TP. `install` pads a micro-batch that is not (PP = 1: right padding, with a causal mask that keeps
  real tokens from seeing it, so their logits are unchanged) and cuts the logits back to the real length.
  Under pipeline parallelism the stages exchange activations of the length the schedule was told, so
  there the micro-batches must arrive padded (services/trainer/packing.py) and a wrong length is an error.
- The output layer. The loss needs logits at the response positions only, which `step.response_logits_only`
  picks from the output layer's input; with sequence parallelism that input is this rank's slice of the
  sequence. `install` gathers the whole sequence in front of the output layer and runs the layer as a
  plain column-parallel layer, as Megatron's GPTModel itself does for last-token inference logits. The
  all-gather is the one the layer would have done; backward takes this rank's slice of the gradient.

The third, the norm weights' gradients (each TP rank normalises only its slice of the sequence, so each
holds a partial sum), is the optimizer's: it sums the gradients of parameters tagged `sequence_parallel`
over the TP group (services/trainer/optimizer.py, Megatron's finalize rule); Megatron's norms and
megatron_compat.TorchNorm carry the tag.
"""

from __future__ import annotations

import torch


def install(model) -> None:
    """Hooks `model` (a GPTModel built with sequence_parallel on) for padding and the output layer."""
    config = model.config
    if not config.sequence_parallel:
        return
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    padded: dict[str, int] = {}

    def pad_inputs(_module, args, kwargs):
        padded.clear()
        names = ("input_ids", "position_ids", "attention_mask")
        kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        seq = ids.shape[1] if ids is not None else (mask.shape[-1] if mask is not None else None)
        if seq is None or seq % tp == 0 or kwargs.get("packed_seq_params") is not None:
            return args[len(names):], kwargs
        if pp > 1:
            raise ValueError(f"sequence_parallel: a micro-batch of {seq} tokens is not a multiple of "
                             f"tensor_model_parallel_size ({tp}); with pipeline parallelism the micro-batches "
                             f"must be padded to one before the schedule runs")
        target = -(-seq // tp) * tp
        kwargs.update(pad_to(target, kwargs.get("input_ids"), kwargs.get("position_ids"), mask))
        padded["real"], padded["padded"] = seq, target
        return args[len(names):], kwargs

    def trim_logits(module, _args, _kwargs, output):
        if padded and module.post_process and isinstance(output, torch.Tensor) and output.dim() == 3 \
                and output.shape[1] == padded["padded"]:
            return output[:, : padded["real"]]
        return output

    model.register_forward_pre_hook(pad_inputs, with_kwargs=True)
    model.register_forward_hook(trim_logits, with_kwargs=True)
    if getattr(model, "post_process", False) and getattr(model, "output_layer", None) is not None:
        _gather_before(model.output_layer)


def pad_to(target: int, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
           attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """Inputs right-padded to `target` tokens: token 0, positions counting on, a mask that hides the padding.

    The mask ([.., s, s], True = not allowed) keeps its real block; real rows cannot see padded columns
    (causal), padded rows see everything before them, so no row is fully masked.
    """
    out: dict[str, torch.Tensor | None] = {"input_ids": input_ids, "position_ids": position_ids,
                                           "attention_mask": attention_mask}
    if input_ids is not None:
        out["input_ids"] = torch.nn.functional.pad(input_ids, (0, target - input_ids.shape[1]), value=0)
    if position_ids is not None:
        seq = position_ids.shape[1]
        tail = position_ids[:, -1:] + torch.arange(1, target - seq + 1, device=position_ids.device)
        out["position_ids"] = torch.cat([position_ids, tail.to(position_ids.dtype)], dim=1)
    if attention_mask is not None:
        seq = attention_mask.shape[-1]
        full = torch.ones(target, target, dtype=torch.bool, device=attention_mask.device).triu(1)
        full = full.expand(*attention_mask.shape[:-2], target, target).clone()
        full[..., :seq, :seq] = attention_mask
        out["attention_mask"] = full
    return out


def _gather_before(output_layer) -> None:
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    # As a plain column-parallel layer, its input gradient is all-reduced over TP (copy_to_tensor_model_
    # parallel_region): whole on every rank, so the gather's backward only takes this rank's slice.
    output_layer.sequence_parallel = False

    def gather(_module, args, kwargs):
        if args:
            return (gather_from_sequence_parallel_region(args[0], tensor_parallel_output_grad=False), *args[1:]), kwargs
        hidden = gather_from_sequence_parallel_region(kwargs["input_"], tensor_parallel_output_grad=False)
        return args, {**kwargs, "input_": hidden}

    output_layer.register_forward_pre_hook(gather, with_kwargs=True)

