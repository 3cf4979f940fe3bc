"""Activation recomputation to a memory budget: the fewest checkpointed layers whose predicted peak fits.

A memory-planning question, so it lives with the planner it asks (which itself applies
:mod:`hf_pipeline.recompute`'s settings to measure).


``model.activation_checkpointing_enable(memory_budget_bytes="6GiB", budget_batch=(8, 2048))`` asks the
memory planner (:func:`~hf_pipeline.memory.planner.plan_report`, the same fake-tensor measurement
``hf-pipeline plan`` prints) for every rank's predicted peak of live activations in a training step of
``batch`` sequences of ``seq`` tokens under the model's schedule and microbatches, and checkpoints as
few layers as fit: none when the model fits without checkpointing, else the largest
``every_n_layers`` (the layers ``i % n == 0`` of the whole model, as transformers counts them) whose
predicted peak on the fullest rank is within the budget. It raises when even checkpointing every
layer does not fit. The budget is for activations alone: weights, gradients and optimizer states
are what they are whatever is checkpointed (the planner's report shows them).

The search is a bisection over ``every_n_layers`` (a plan per candidate): it assumes checkpointing
fewer layers never needs less memory, which holds layer for layer (a checkpointed block keeps its
input instead of all it saves).

Example:
    >>> choice = model.activation_checkpointing_enable(memory_budget_bytes="2GiB", budget_batch=(8, 1024))
    >>> choice.every_n_layers, choice.predicted_bytes
    (2, 1873412096)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core import PipelineCore
from ..errors import InputError, InputTypeError, UsageError
from ..planning.options import parse_size
from ..recompute.layers import (
    CheckpointingSettings,
    check_checkpointable,
    checkpointed_layers,
    disable,
    enable,
    layer_order,
)

__all__ = ["CheckpointingChoice", "enable_checkpointing", "predicted_activation_peak"]


@dataclass(frozen=True, kw_only=True)
class CheckpointingChoice:
    """What ``memory_budget_bytes`` chose.

    Attributes:
        budget_bytes: the budget for the fullest rank's live activations.
        batch, seq: the training step it was planned for.
        every_n_layers: the chosen ``every_n_layers``; None when nothing needs checkpointing.
        layers: the checkpointed layers of the whole model (FQNs).
        predicted_bytes: the fullest rank's predicted activation peak with that choice.
        without_bytes: the same without checkpointing.
    """

    budget_bytes: int
    batch: int
    seq: int
    every_n_layers: int | None
    layers: tuple[str, ...]
    predicted_bytes: int
    without_bytes: int


def predicted_activation_peak(model: PipelineCore, batch: int, seq: int, every_n_layers: int) -> tuple[int, int]:
    """(fullest rank's predicted activation peak without checkpointing, with ``every_n_layers``), in bytes."""
    from .planner import plan_report

    report = plan_report(
        model.config, stages=model.plan.num_stages, virtual_stages=model.options.virtual_stages,
        schedule=model.schedule.name, dtype=model.plan.dtype, batch=batch, seq=seq,
        n_microbatches=model.n_microbatches, auto_class=model.options.model_class, split=model.options.split,
        checkpoint_every_n_layers=every_n_layers,
    )
    without = max(r.activation_bytes for r in report.ranks)
    return without, max(r.checkpointed_activation_bytes for r in report.ranks)


def _shape(budget_batch: Any) -> tuple[int, int]:
    ok = isinstance(budget_batch, (tuple, list)) and len(budget_batch) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in budget_batch):
        raise InputTypeError(
            f"budget_batch must be (batch, seq) of the training steps the budget plans for, two ints >= 1, "
            f"got {budget_batch!r}"
        )
    return int(budget_batch[0]), int(budget_batch[1])


def _choose(model: PipelineCore, budget: int, batch: int, seq: int) -> CheckpointingChoice:
    n_layers = len(layer_order(model.skeleton))
    without, every = predicted_activation_peak(model, batch, seq, 1)

    def choice(n: int | None, predicted: int) -> CheckpointingChoice:
        layers = tuple(checkpointed_layers(model.skeleton, n)) if n is not None else ()
        return CheckpointingChoice(budget_bytes=budget, batch=batch, seq=seq, every_n_layers=n, layers=layers,
                                   predicted_bytes=predicted, without_bytes=without)

    if without <= budget:
        return choice(None, without)
    if every > budget:
        raise UsageError(
            f"memory_budget_bytes={budget}: a training step of batch {batch} x seq {seq} is predicted to keep "
            f"{every} bytes of activations on the fullest rank even with every layer checkpointed ({without} "
            f"without); raise the budget, or lower the batch, the sequence length or the microbatch size "
            f"(more microbatches)"
        )
    best, best_bytes = 1, every
    lo, hi = 2, max(n_layers, 1)  # bisection: the largest n that still fits
    while lo <= hi:
        mid = (lo + hi) // 2
        _, predicted = predicted_activation_peak(model, batch, seq, mid)
        if predicted <= budget:
            best, best_bytes, lo = mid, predicted, mid + 1
        else:
            hi = mid - 1
    return choice(best, best_bytes)


def enable_checkpointing(
    model: PipelineCore, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False, *,
    memory_budget_bytes: int | str | None = None, budget_batch: tuple[int, int] | None = None,
) -> CheckpointingChoice | None:
    """``model.activation_checkpointing_enable``: as transformers', or to a memory budget (module docstring).

    Args:
        model: a :class:`~hf_pipeline.model.PipelinedModel`.
        activation_checkpointing_kwargs, every_n_layers, offload: as transformers'.
        memory_budget_bytes: bytes (or "2GiB") of live activations the fullest rank may hold.
        budget_batch: ``(batch, seq)`` of the training steps the budget plans for.

    Returns:
        The :class:`CheckpointingChoice` with a budget, None without.
    """
    if memory_budget_bytes is None and budget_batch is None:
        enable(model, activation_checkpointing_kwargs, every_n_layers, offload)
        return None
    if memory_budget_bytes is None or budget_batch is None:
        raise InputError("memory_budget_bytes and budget_batch=(batch, seq) go together: pass both, or neither")
    if every_n_layers != 1:
        raise InputError(
            f"every_n_layers={every_n_layers!r} with memory_budget_bytes: the budget chooses every_n_layers; "
            "pass one or the other"
        )
    # Every argument is checked (and a traced model refused) before anything is planned.
    CheckpointingSettings(kwargs=activation_checkpointing_kwargs or {}, offload=offload)
    budget = parse_size(memory_budget_bytes, what="memory_budget_bytes")
    batch, seq = _shape(budget_batch)
    check_checkpointable(model)
    choice = _choose(model, budget, batch, seq)
    if choice.every_n_layers is None:
        disable(model)
    else:
        enable(model, activation_checkpointing_kwargs, choice.every_n_layers, offload)
    return choice
