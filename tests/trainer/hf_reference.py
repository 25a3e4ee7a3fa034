"""What a trainer should compute, on the HF model in plain torch: log-probs with temperature, and one GRPO update
(the same loss per micro-batch of 2 rows averaged over the micro-batches, clip_grad_norm_(1.0), AdamW with weight
decay on matrices only: Megatron's Adam as the CPU optimizer path runs it)."""

from __future__ import annotations

import torch


def hf_log_probs(model, rows, temperature: float) -> torch.Tensor:
    """Response-token log-probs of every row, concatenated (the trainer's ComputeLogProbs layout)."""
    out = []
    for i in range(len(rows)):
        seq = rows.token_ids[rows.seq_offsets[i] : rows.seq_offsets[i + 1]]
        p = int(rows.prompt_lengths[i])
        with torch.no_grad():
            logits = model(seq[None]).logits[0] / temperature
        out.append(torch.log_softmax(logits, -1)[p - 1 : len(seq) - 1].gather(-1, seq[p:, None])[:, 0])
    return torch.cat(out)


def plain_torch_update(model, rows, exp, *, temperature: float, kl_coef: float, lr: float) -> float:
    """One optimizer step on `model` in place (micro-batches of 2 rows, one mini-batch); returns the grad norm."""
    from services.trainer import grpo_loss
    from services.trainer.step import response_slices

    n_micro = len(rows) // 2
    for m in range(n_micro):
        idx = [2 * m, 2 * m + 1]
        width = int(rows.response_lengths[idx].max())
        logps, ents = [], []
        for i in idx:
            seq = rows.token_ids[rows.seq_offsets[i] : rows.seq_offsets[i + 1]]
            p, r = int(rows.prompt_lengths[i]), int(rows.response_lengths[i])
            logits = model(seq[None]).logits[:, p - 1 : p - 1 + r]
            lp, ent = grpo_loss.compute_log_probs(logits, seq[None, p:], temperature, with_entropy=True)
            logps.append(torch.nn.functional.pad(lp, (0, width - r)))
            ents.append(torch.nn.functional.pad(ent, (0, width - r)))
        mask = (torch.arange(width)[None] < rows.response_lengths[idx][:, None]).float()
        loss, _ = grpo_loss.grpo_loss(
            torch.cat(logps), response_slices(exp.old_log_probs, rows, idx, width),
            response_slices(exp.ref_log_probs, rows, idx, width), exp.advantages[idx], mask,
            clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=kl_coef, entropy=torch.cat(ents).detach())
        (loss / n_micro).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr,
                            betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    opt.step()
    return norm.item()
