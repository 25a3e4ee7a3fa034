"""PPO's critic model: a built GPTModel whose output is a value per position instead of the vocabulary's logits.

MindSpeed-RL's critic (`mindspeed_rl/models/orm/orm_model.py`, GPTRewardModel with one attribute, built by
`rm_model_provider` in cli/train_ppo.py) is the GPT backbone with its final norm and a head Linear(hidden -> 1, bias)
in float32, the hidden states cast to float32, applied at every position; the LM output layer exists but is frozen
and unused. Here `attach_value_head` turns a GPTModel built by services/trainer/model.py into that:

- the head is a submodule `value_head` of the GPTModel (`value_head.weight` [1, hidden], `value_head.bias` [1]), so
  it is in the state dict, the checkpoints and the optimizer (float32 whatever the model's dtype: the optimizer
  steps float32 weights of a bf16 model in place, as it does Megatron's norms);
- the output layer's forward is replaced on the instance by the head: GPTModel returns [b, S, 1] (or [b, R, 1]
  when `step.response_logits_only` picked the response positions in the output layer's pre-hook), so the
  micro-batch plumbing (step.py, packing.py, sequence_parallel.py's gather in front of the output layer) runs as
  for log-probs. The output layer's own weights (untied models) are frozen, as upstream's;
- the head is whole on every tensor-parallel rank (upstream's is a RowParallelLinear split over TP): its input is
  the replicated (under sequence parallelism, gathered) final hidden state, so each TP rank computes the same
  values and the same gradients without a reduction, and the value does not depend on the TP size. Its gradient
  counts once in the norm (a TP duplicate, as the norms' weights);
- initialisation: weight ~ normal(0, init_method_std), bias 0, drawn from a generator seeded with the critic's seed
  on every rank (so TP and DP replicas agree). That is upstream's: its head's init_method is Megatron's
  normal(0, init_method_std) and a RowParallelLinear zeroes its bias. Loading weights without the head (an HF
  folder, the actor's checkpoint) initialises it again the same way (services/trainer/checkpoint.py).

Pipeline parallelism with tied embeddings is refused: the last stage's copy of the embedding would stop receiving
the output layer's gradient, and the optimizer's embedding all-reduce pairs the two stages (upstream unties the
embeddings there, `untie_embeddings_and_output_weights`, which changes the model loaded).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from services.trainer.model import unwrap

VALUE_HEAD = "value_head"


def is_head_name(name: str) -> bool:
    """Whether a (canonical) parameter name is the value head's."""
    return name.startswith(f"{VALUE_HEAD}.") or f".{VALUE_HEAD}." in name


def value_head(model) -> torch.nn.Linear | None:
    """The value head of `model` on this pipeline stage (None: no head here, or not a critic)."""
    return getattr(unwrap(model), VALUE_HEAD, None)


def has_value_head(model) -> bool:
    """Whether `model` is a critic (with a head on this stage, or on the last stage when this is another one)."""
    return bool(getattr(unwrap(model), "_is_critic", False))


def attach_value_head(model, *, init_std: float, seed: int) -> None:
    """Makes `model` (a GPTModel, possibly wrapped) PPO's critic: module docstring. Every rank calls it."""
    gpt = unwrap(model)
    config = gpt.config
    if config.pipeline_model_parallel_size > 1 and gpt.share_embeddings_and_output_weights:
        raise ValueError("the critic with pipeline_model_parallel_size > 1 needs a model with untied embeddings "
                         "(tie_word_embeddings false): its output layer is unused, and a tied embedding split over "
                         "the first and last stage would train on one of them only; run the critic at PP 1")
    if init_std <= 0:
        raise ValueError(f"init_method_std must be > 0 for the critic's value head, got {init_std}")
    gpt._is_critic = True
    if not gpt.post_process:
        return
    layer = gpt.output_layer
    layer.requires_grad_(False)
    device = next(gpt.parameters()).device
    head = torch.nn.Linear(config.hidden_size, 1, bias=True, dtype=torch.float32, device=device)
    head.init_std, head.init_seed = float(init_std), int(seed)
    gpt.add_module(VALUE_HEAD, head)
    reset_value_head(gpt)

    def forward(input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None, **_kwargs):
        # GPTModel hands a tied model's embedding as `weight`: the critic reads no vocabulary. [S, b, h] -> [S, b, 1].
        return head(input_.float()), None

    layer.forward = forward


@torch.no_grad()
def reset_value_head(model) -> None:
    """Draws the head's initial weights again (module docstring); nothing on a stage without the head."""
    head = value_head(model)
    if head is None:
        return
    g = torch.Generator().manual_seed(head.init_seed)
    weight = torch.empty(head.weight.shape, dtype=torch.float32).normal_(0.0, head.init_std, generator=g)
    head.weight.copy_(weight)
    head.bias.zero_()


def check_optimizer_resume(model, saved_names: Iterable[str], path: Path, *, wants_optimizer: bool) -> None:
    """Refuses, on every rank alike and before any state is touched, to resume a critic's optimizer from a
    checkpoint without a value head (`saved_names`: this rank's saved model keys): that optimizer state is another
    model's. A collective for a critic, whose head sits on the last pipeline stage only."""
    if not has_value_head(model):
        return
    lacks = value_head(model) is not None and not any(is_head_name(k) for k in saved_names)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flags: list = [None] * dist.get_world_size()
        dist.all_gather_object(flags, lacks)
        lacks = any(flags)
    if lacks and wants_optimizer:
        raise ValueError(f"{path} holds no value head (an actor's, a converted or an HF-derived checkpoint): the "
                         "critic starts its head afresh and cannot resume that optimizer state; load it with "
                         "finetune: true or no_load_optim: true (critic_config)")
