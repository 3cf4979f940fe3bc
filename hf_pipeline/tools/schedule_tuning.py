"""Measuring schedules by running them: ``model.tune(batch)``.

:func:`tune` times ``train_step`` on a loaded model and a real batch for each schedule that keeps
the loaded stage placement and each microbatch count that fits the batch, and switches the model to
the fastest (collective; the step time is the slowest rank's). Its answer is the
:class:`~hf_pipeline.planning.auto_choice.AutoChoice` of the load-time choice, with measured times
where that one has simulated estimates (:mod:`hf_pipeline.planning.auto_choice`).

Example:
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, schedule="auto", n_microbatches="auto")
    >>> print(model.tune(batch))            # measured among the schedules of the loaded placement
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Mapping, Sequence

import torch

from ..core import PipelineCore
from ..errors import InputError
from ..planning.auto_choice import AutoChoice, Candidate, Estimate, microbatch_counts, same_placement, with_schedule
from ..planning.schedules import SCHEDULES

__all__ = ["tune"]


def tune(
    model: PipelineCore, batch: Mapping[str, Any], *, schedules: Sequence[str] | None = None,
    n_microbatches: Sequence[int] | None = None,
    steps: int = 2,
) -> AutoChoice:
    """Time ``train_step`` on ``batch`` for each schedule of the loaded placement and microbatch
    count, and switch the model to the fastest (collective: every rank passes the same batch).

    Gradients are cleared afterwards (set to None); the weights are not changed.

    Args:
        model: a loaded :class:`~hf_pipeline.model.PipelinedModel`.
        batch: a training batch, as for ``train_step``.
        schedules: the schedules to try (default: every schedule that places the stages as loaded).
        n_microbatches: the counts to try (default: every count that divides the batch's rows per
            replica, 1..64, and that the schedule trains).
        steps: timed steps per candidate, after one untimed.
    """
    import torch.distributed as dist

    plan, dims = model.plan, model.dims
    first = next(v for v in batch.values() if isinstance(v, torch.Tensor))
    rows, seq = int(first.shape[0]), int(first.shape[-1])
    if schedules is not None:
        names = list(schedules)
    else:
        names = [s.name for s in SCHEDULES.values() if same_placement(s, model.options)]
    cands = []
    for name in names:
        # Refused before any step when it would need other stages (the message of set_schedule).
        spec = with_schedule(model.options, name, model.n_microbatches).schedule
        local_rows = rows // dims.dp_size
        for m in (list(n_microbatches) if n_microbatches is not None else microbatch_counts(local_rows, None)):
            problem = spec.training_problem(pp_size=plan.pp_size, virtual_stages=plan.virtual_stages, n_microbatches=m)
            if local_rows % m == 0 and problem is None:
                cands.append(Candidate(schedule=spec.name, virtual_stages=plan.virtual_stages, n_microbatches=m))
    if not cands:
        raise InputError(
            f"no schedule of the loaded placement trains a batch of {rows} rows; pass n_microbatches= counts "
            "that divide it"
        )
    before = (model.schedule.name, model.n_microbatches)
    estimates = []
    try:
        for c in cands:
            model.set_schedule(c.schedule, n_microbatches=c.n_microbatches)
            times = []
            for i in range(steps + 1):
                t = time.perf_counter()
                model.train_step(batch)
                took = torch.tensor([time.perf_counter() - t])
                if dist.is_initialized():
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the pipeline is as slow as its slowest rank
                if i:
                    times.append(float(took))
            estimates.append(Estimate(candidate=c, measured_seconds=statistics.median(times)))
    except BaseException:
        model.set_schedule(before[0], n_microbatches=before[1])
        raise
    finally:
        for p in model.parameters():
            p.grad = None
    best = min(estimates, key=lambda e: e.measured_seconds)
    model.set_schedule(best.candidate.schedule, n_microbatches=best.candidate.n_microbatches)
    return AutoChoice(chosen=best.candidate, estimates=tuple(estimates), basis="measured", batch=rows, seq=seq)
