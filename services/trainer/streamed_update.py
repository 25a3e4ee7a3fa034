"""The streaming update: the actor's optimisation pass starts on the first rows of an Update call, before its last.

In a synchronous iteration the coordinator can send the update's rows as the reference's log-probs for them come
back, instead of after the last one (services/coordinator/iteration.py). A trainer that collected the whole stream
first would still start only then; here Megatron's schedule takes each micro-batch when it is due, built from the
rows received so far, and waits for more rows only when a micro-batch needs them. The optimizer step, the metrics
and every number equal the collected update's for the same rows in the same order (tests/trainer/
test_streamed_update.py): the micro-batches are the same fixed slices of the batch, and only their inputs arrive
later.

Only where that equality is plain (`can_stream`): a single-rank group (every rank would otherwise need each part
as it comes), one mini-batch and one epoch, fixed micro-batches (use_dynamic_bsz groups rows by the token counts
of the whole mini-batch), no mixture-of-experts (its padding micro-batches and load records need the whole pass).
Elsewhere the server collects the call first, as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.trainer import moe, packing
from services.trainer.step import SequenceRows, run_micro_batches
from services.trainer.update import (
    Experience,
    Trained,
    UpdateOptions,
    actor_metrics,
    finish_mini_batch,
    micro_batch_loss,
)


def can_stream(opts: UpdateOptions, model, world_size: int, batch_rows: int) -> bool:
    """Whether an Update of `batch_rows` rows may start before its last row (module docstring)."""
    return (world_size == 1 and opts.epochs == 1 and opts.mini_batch_rows in (0, batch_rows)
            and not opts.shuffle_mini_batch and not opts.packing.dynamic and not moe.is_moe(model))


class ExperienceStream:
    """An actor's global batch of `total_rows` rows arriving as Experiences of a few rows each (`parts`)."""

    def __init__(self, parts: Iterator[Experience], total_rows: int) -> None:
        self.total_rows = total_rows
        self._parts = parts
        self._received: list[Experience] = []
        self._rows = 0
        self._joined: Experience | None = None

    def prefix(self, rows: int) -> Experience:
        """The batch's first `rows` rows (at least; all received so far), waiting for parts until they are here."""
        while self._rows < rows:
            part = next(self._parts, None)
            if part is None:
                raise ValueError(f"the Update stream ended after {self._rows} rows; its batch_rows said "
                                 f"{self.total_rows}")
            self._rows += len(part.rows)
            if self._rows > self.total_rows:
                raise ValueError(f"the Update stream sent more than batch_rows ({self.total_rows}) rows")
            self._received.append(part)
            self._joined = None
        if self._joined is None:
            self._joined = join(self._received)
        return self._joined

    def whole(self) -> Experience:
        """Every row, once the stream has ended (a part past `total_rows` rows is refused)."""
        exp = self.prefix(self.total_rows)
        if next(self._parts, None) is not None:
            raise ValueError(f"the Update stream sent more than batch_rows ({self.total_rows}) rows")
        return exp


def join(parts: list[Experience]) -> Experience:
    """One Experience of `parts`' rows, in order."""
    if len(parts) == 1:
        return parts[0]

    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError(f"{name} is set on some UpdateRequests of the call but not on others")
        return torch.cat(values)

    rows = [p.rows for p in parts]
    routed = [r.routed_experts for r in rows]
    masks = [r.response_mask for r in rows]
    joined = SequenceRows(torch.cat([r.token_ids for r in rows]), torch.cat([r.prompt_lengths for r in rows]),
                          torch.cat([r.response_lengths for r in rows]),
                          None if routed[0] is None else torch.cat(routed))
    if any(m is not None for m in masks):
        joined.response_mask = torch.cat([torch.ones(r.num_response_tokens, dtype=torch.bool) if m is None else m
                                          for r, m in zip(rows, masks, strict=True)])
    return Experience(joined, cat("advantages"), cat("old_log_probs"), cat("ref_log_probs"),
                      cat("behavior_log_probs"), token_advantages=cat("token_advantages"))


def grpo_update_streamed(model, optimizer, scheduler, stream: ExperienceStream, opts: UpdateOptions, *,
                         temperature: float, kl_coef: float, clip_grad: float) -> dict[str, float]:
    """`update.grpo_update` over a batch that is still arriving (one mini-batch, one epoch: `can_stream`)."""
    size = opts.micro_batch_size
    slices = [list(range(lo, min(lo + size, stream.total_rows))) for lo in range(0, stream.total_rows, size)]

    def micro_batches() -> Iterator[dict]:
        for rows_idx in slices:
            exp = stream.prefix(rows_idx[-1] + 1)
            if opts.use_kl and exp.ref_log_probs is None:
                raise ValueError("ref_log_probs is required: this trainer's loss has a KL term "
                                 "(rl_config.init_kl_coef != 0), so every UpdateRequest must carry the reference "
                                 "model's log-probs")
            mb = packing.build_micro_batches(exp.rows, [rows_idx], opts.packing, pp=1)[0]
            mb.update(loss_scale=1.0, experience=exp)
            yield mb

    trained = Trained([], [], None, len(slices))
    model.train()
    optimizer.zero_grad()
    out = run_micro_batches(model, micro_batches(), micro_batch_loss(None, opts, temperature, kl_coef),
                            forward_only=False, count=len(slices))
    exp = stream.whole()  # before the step: a stream that sent too many rows changes no weight
    finish_mini_batch(model, optimizer, scheduler, out, clip_grad, trained)
    return actor_metrics(model, exp, opts, trained)
