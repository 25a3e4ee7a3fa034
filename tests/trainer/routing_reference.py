"""Routing on the HF Qwen3-MoE in plain torch, for the routing-replay checks: the experts HF's routers choose for
every token, and log-probs of a forward whose routers are forced to given experts (the probabilities of those
experts from the router's softmax, renormalised as `norm_topk_prob` asks: what HF would compute had its top-k
chosen them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _routers(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]


@contextlib.contextmanager
def _patched(model, forward_of) -> Iterator[None]:
    routers = _routers(model)
    originals = [r.forward for r in routers]
    for column, r in enumerate(routers):
        r.forward = forward_of(column, r)
    try:
        yield
    finally:
        for r, f in zip(routers, originals, strict=True):
            r.forward = f


def hf_routing(model, rows) -> torch.Tensor:
    """int64 [tokens, moe_layers, top_k]: the experts HF chose for every token of every row (token order of rows)."""
    chosen: dict[int, torch.Tensor] = {}

    def forward_of(column, router):
        original = router.forward

        def forward(hidden):
            out = original(hidden)
            chosen[column] = out[2]
            return out
        return forward

    out = []
    with _patched(model, forward_of), torch.no_grad():
        for i in range(len(rows)):
            model(rows.token_ids[rows.seq_offsets[i]:rows.seq_offsets[i + 1]][None])
            out.append(torch.stack([chosen[c] for c in range(len(chosen))], dim=1))
    return torch.cat(out)


def hf_forced_log_probs(model, rows, routed: torch.Tensor, temperature: float) -> torch.Tensor:
    """Response log-probs with every router forced to `routed` ([tokens, moe_layers, top_k], rows' token order)."""
    current: dict[str, torch.Tensor] = {}

    def forward_of(column, router):
        def forward(hidden):
            hidden = hidden.reshape(-1, router.hidden_dim)
            logits = torch.nn.functional.linear(hidden, router.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            idx = current["routed"][:, column]
            top = probs.gather(1, idx)
            if router.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        return forward

    out = []
    with _patched(model, forward_of), torch.no_grad():
        for i in range(len(rows)):
            a, b = int(rows.seq_offsets[i]), int(rows.seq_offsets[i + 1])
            seq, p = rows.token_ids[a:b], int(rows.prompt_lengths[i])
            current["routed"] = routed[a:b]
            logits = model(seq[None]).logits[0] / temperature
            out.append(torch.log_softmax(logits, -1)[p - 1:len(seq) - 1].gather(-1, seq[p:, None])[:, 0])
    return torch.cat(out)


def random_routing(tokens: int, layers: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """int64 [tokens, layers, top_k]: distinct random experts per token and layer."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand((tokens, layers, experts), generator=g).argsort(-1)[..., :top_k]
