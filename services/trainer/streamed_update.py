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

from collections.abc import Callable, Iterator
from typing import TypeVar

from services.trainer import moe, packing
from services.trainer.step import run_micro_batches
from services.trainer.update import (
    Experience,
    Trained,
    UpdateOptions,
    actor_metrics,
    finish_mini_batch,
    micro_batch_loss,
)

T = TypeVar("T")


def can_stream(opts: UpdateOptions, model, world_size: int, batch_rows: int) -> bool:
    """Whether an Update of `batch_rows` rows may start before its last row (module docstring)."""
    return (world_size == 1 and opts.epochs == 1 and opts.mini_batch_rows in (0, batch_rows)
            and not opts.shuffle_mini_batch and not opts.packing.dynamic and not moe.is_moe(model))


class ExperienceStream:
    """An actor's global batch of `total_rows` rows arriving in parts (an Update call's requests).

    `rows_of(part)` counts a part's rows; `build(parts)` makes one Experience of consecutive parts (the server's own
    concatenation of requests, services/trainer/inputs.py). A micro-batch builds only the parts it touches, so the
    batch is joined once in all (`whole`), however many micro-batches it has."""

    def __init__(self, parts: Iterator[T], total_rows: int, rows_of: Callable[[T], int],
                 build: Callable[[list[T]], Experience]) -> None:
        self.total_rows = total_rows
        self._parts, self._rows_of, self._build = parts, rows_of, build
        self._received: list[tuple[int, T]] = []  # (its first row, part)
        self._rows = 0

    def span(self, lo: int, hi: int) -> tuple[Experience, int]:
        """Rows `lo`..`hi` - 1 within an Experience of the parts holding them, and the Experience's row of `lo`;
        waits for parts until those rows are here."""
        self._receive(hi)
        touched = [(first, part) for first, part in self._received
                   if first < hi and first + self._rows_of(part) > lo]
        return self._build([part for _, part in touched]), lo - touched[0][0]

    def whole(self) -> Experience:
        """Every row, once the stream has ended (a part past `total_rows` rows is refused)."""
        self._receive(self.total_rows)
        if next(self._parts, None) is not None:
            raise ValueError(f"the Update stream sent more than batch_rows ({self.total_rows}) rows")
        return self._build([part for _, part in self._received])

    def _receive(self, rows: int) -> None:
        while self._rows < rows:
            part = next(self._parts, None)
            if part is None:
                raise ValueError(f"the Update stream ended after {self._rows} rows; its batch_rows said "
                                 f"{self.total_rows}")
            self._received.append((self._rows, part))
            self._rows += self._rows_of(part)
            if self._rows > self.total_rows:
                raise ValueError(f"the Update stream sent more than batch_rows ({self.total_rows}) rows")


def grpo_update_streamed(model, optimizer, scheduler, stream: ExperienceStream, opts: UpdateOptions, *,
                         temperature: float, kl_coef: float, clip_grad: float) -> dict[str, float]:
    """`update.grpo_update` over a batch that is still arriving (one mini-batch, one epoch: `can_stream`)."""
    size = opts.micro_batch_size
    bounds = [(lo, min(lo + size, stream.total_rows)) for lo in range(0, stream.total_rows, size)]

    def micro_batches() -> Iterator[dict]:
        for lo, hi in bounds:
            exp, at = stream.span(lo, hi)
            if opts.use_kl and exp.ref_log_probs is None:
                raise ValueError("ref_log_probs is required: this trainer's loss has a KL term "
                                 "(rl_config.init_kl_coef != 0), so every UpdateRequest must carry the reference "
                                 "model's log-probs")
            mb = packing.build_micro_batches(exp.rows, [list(range(at, at + hi - lo))], opts.packing, pp=1)[0]
            mb.update(loss_scale=1.0, experience=exp)
            yield mb

    trained = Trained([], [], None, len(bounds))
    model.train()
    optimizer.zero_grad()
    out = run_micro_batches(model, micro_batches(), micro_batch_loss(None, opts, temperature, kl_coef),
                            forward_only=False, count=len(bounds))
    exp = stream.whole()  # before the step: a stream that sent too many rows changes no weight
    finish_mini_batch(model, optimizer, scheduler, out, clip_grad, trained)
    return actor_metrics(model, exp, opts, trained)
