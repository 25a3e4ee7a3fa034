"""Client-side helpers shared by the rollout tests: build requests, run a stream, compute HF references."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.tensors import to_numpy, to_proto


def group_request(group_id: str, prompt: Sequence[int], n: int = 1, *, version: int = 0,
                  **sampling: float | int | bool) -> rollout_pb2.GenerateRequest:
    if "temperature" in sampling:
        sampling["has_temperature"] = True
    if "seed" in sampling:
        sampling["has_seed"] = True
    return rollout_pb2.GenerateRequest(
        group=common_pb2.PromptGroup(group_id=group_id, prompt_token_ids=to_proto(np.asarray(prompt, np.int32)),
                                     n=n),
        expected_weights_version=version,
        sampling=common_pb2.SamplingParams(**sampling),
    )


def generate(stub, requests: Iterable[rollout_pb2.GenerateRequest], timeout: float = 120) -> list[common_pb2.Sample]:
    return [r.sample for r in stub.Generate(iter(list(requests)), timeout=timeout)]


def tokens(sample: common_pb2.Sample) -> list[int]:
    return to_numpy(sample.response_token_ids).tolist()


def log_probs(sample: common_pb2.Sample) -> np.ndarray:
    return to_numpy(sample.response_log_probs)


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, cut after the first EOS (vLLM stops there too)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    new = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[: i + 1]
    return new


def hf_token_log_probs(model, prompt: Sequence[int], response: Sequence[int]) -> np.ndarray:
    """log p(response[j] | prompt, response[:j]) under `model`, float32 math."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
    return logp[positions, torch.tensor(list(response))].numpy()


def prompts(count: int, seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Skip the special tokens (ids 0..2) so prompts look like text.
    return [rng.integers(3, vocab, size=int(rng.integers(4, 24))).tolist() for _ in range(count)]
