"""The fine-tuning loop shared by ``hf-pipeline train`` and ``scripts/train.py``.

One optimizer step is ``grad_accum`` calls of ``model.train_step`` (each batch's loss scaled by
``1 / grad_accum``, so the accumulated gradient is the mean's), one global gradient clip, then
the optimizer and scheduler step. Every rank runs the same loop on the same batches; only the
main process prints and writes the log file.

Example:
    >>> records = run_training(model, batches, opt, sched, steps=100, grad_accum=2, log_file="log.jsonl")
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable

import torch

from ..core import PipelineCore
from ..log import StepProgress

__all__ = ["StepRecord", "run_training"]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One optimizer step as logged: ``loss`` is the mean over its accumulated batches; ``lr`` the rate it used."""

    step: int
    loss: float
    lr: float
    grad_norm: float

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm})


def _optimizer_step(
    model: PipelineCore,
    batches: Callable[[int], dict[str, Any]],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    step: int,
    grad_accum: int,
    max_grad_norm: float,
    autocast: torch.dtype | None,
) -> StepRecord:
    """Accumulate ``grad_accum`` batches, clip, step the optimizer and the scheduler."""
    total = 0.0
    for micro in range(grad_accum):
        # Batch numbers run on across steps, so a resumed run reads the batches the first run would have.
        batch = batches(step * grad_accum + micro)  # the same batch on every rank
        total += float(model.train_step(batch, loss_scale=1.0 / grad_accum, autocast=autocast))
    norm = float(model.clip_grad_norm_(max_grad_norm)) if max_grad_norm > 0 else float("nan")
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepRecord(step=step + 1, loss=total / grad_accum, lr=lr, grad_norm=norm)


def run_training(
    model: PipelineCore,
    batches: Callable[[int], dict[str, Any]],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    steps: int,
    start_step: int = 0,
    grad_accum: int = 1,
    max_grad_norm: float = 1.0,
    autocast: torch.dtype | None = None,
    progress: StepProgress | None = None,
    log_file: str | os.PathLike | None = None,
    warn_non_finite: bool = False,
    save_every: int = 0,
    save: Callable[[int], None] | None = None,
) -> list[StepRecord]:
    """Train ``model`` from optimizer step ``start_step`` up to ``steps``. Collective: every rank calls it.

    Args:
        model: a pipelined model in train mode (``model.train()``).
        batches: batch number -> the global batch (the same on every rank), e.g. a
            :class:`~hf_pipeline.training.data.Batches`.
        optimizer: over ``model.parameters()``.
        scheduler: a learning-rate scheduler of ``optimizer`` (``get_last_lr()`` is logged).
        steps: the optimizer step to stop after, counting the ones before ``start_step``.
        start_step: optimizer steps already done (when resuming from a checkpoint).
        grad_accum: ``train_step`` calls per optimizer step.
        max_grad_norm: clip the global gradient norm to this; ``<= 0`` does not clip (``grad_norm`` is nan).
        autocast: ``train_step``'s autocast dtype (e.g. ``torch.bfloat16``), or None.
        progress: the main process's bar and loss lines (closed when the loop ends).
        log_file: append one JSON line per step (step, loss, lr, grad_norm) here on the main process.
        warn_non_finite: print a line on stderr for a step whose loss is nan or inf (main process).
        save_every: call ``save`` every this many optimizer steps (0: only after the last).
        save: called with the number of optimizer steps done (a checkpoint, say); None saves nothing.

    Returns:
        One :class:`StepRecord` per optimizer step run, on every rank.
    """
    main = bool(model.ctx.is_main_process)
    records: list[StepRecord] = []
    progress = progress if progress is not None else StepProgress(steps, initial=start_step, enabled=False)
    with progress:
        for step in range(start_step, steps):
            record = _optimizer_step(
                model, batches, optimizer, scheduler, step=step, grad_accum=grad_accum,
                max_grad_norm=max_grad_norm, autocast=autocast,
            )
            records.append(record)
            progress.step(record.step, loss=record.loss, lr=record.lr)
            if main and log_file is not None:
                with open(log_file, "a", encoding="utf-8") as f:
                    f.write(record.to_json() + "\n")
            if main and warn_non_finite and not math.isfinite(record.loss):
                print(f"step {record.step}: loss is {record.loss}", file=sys.stderr, flush=True)
            if save is not None and ((save_every and record.step % save_every == 0) or record.step == steps):
                save(record.step)
    return records
