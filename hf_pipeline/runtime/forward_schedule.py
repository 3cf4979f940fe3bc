"""The schedule a forward-only (inference) call runs: torch's GPipe forward, or forwards in stage order.

Torch's multi-stage schedules are training schedules: the V-shaped ones cannot run forward only
(their action lists pair every F with a B). :func:`forward_schedule` picks what a forward-only
call runs over one rank's torch ``PipelineStage`` objects: with one stage per rank, the forward
of the spec's ``forward_as`` schedule (GPipe's); with several, :class:`ScheduleForwardInOrder`.
Either runs any number of microbatches.

Example:
    >>> schedule = forward_schedule(spec, pstages, n_microbatches=4, stage_to_rank={0: 0, 1: 1, 2: 1, 3: 0})
    >>> out = schedule.step(**inputs)
"""

from __future__ import annotations

from typing import Any

from ..compat import Action, ComputationType, PipelineScheduleRuntime, lower_compute_actions
from ..planning.schedules import SCHEDULES, ScheduleSpec

__all__ = ["ScheduleForwardInOrder", "forward_schedule"]


class ScheduleForwardInOrder(PipelineScheduleRuntime):
    """Forward-only schedule for any stage placement, looped or V-shaped.

    Every rank runs its stages in stage order, all microbatches of one stage before the next
    (breadth first), which cannot deadlock whatever the placement; torch's runtime adds the sends
    and receives.

    Note: torch's own lowering entry (``_prepare_schedule_with_comms``) validates that every
    forward has a backward (it is built for training schedules). The placement is known from the
    plan, so it is set here and torch's lowering passes run on the forward actions alone.
    """

    def __init__(self, stages, n_microbatches: int, *, stage_to_rank: dict[int, int], **kwargs):
        super().__init__(stages=stages, n_microbatches=n_microbatches, **kwargs)
        forward = ComputationType.FORWARD
        actions: dict[int, list] = {r: [] for r in sorted(set(stage_to_rank.values()))}
        for stage in sorted(stage_to_rank):
            for mb in range(n_microbatches):
                actions[stage_to_rank[stage]].append(Action(stage, forward, mb))
        self.stage_index_to_group_rank = dict(stage_to_rank)
        for stage in stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.pipeline_order = dict(actions)
        self.pipeline_order_with_comms = lower_compute_actions(
            actions, stage_to_rank=self.stage_index_to_group_rank, num_stages=stages[0].num_stages,
            n_microbatches=n_microbatches,
        )


def forward_schedule(
    spec: ScheduleSpec, stages: list, *, n_microbatches: int, stage_to_rank: dict[int, int], **kwargs: Any
):
    """The schedule a forward-only (inference) call runs over this rank's torch ``PipelineStage`` objects.

    Training schedules are not used for inference: one stage per rank runs GPipe's forward
    actions, several stages per rank (looped or V) :class:`ScheduleForwardInOrder`. Either
    runs any number of microbatches.

    Args:
        spec: the model's training schedule (its ``forward_as`` names the single-stage schedule to run).
        stages: this rank's torch ``PipelineStage`` objects, in stage order.
        n_microbatches: microbatches per call.
        stage_to_rank: stage index -> pipeline rank, every stage of the pipeline.
        **kwargs: passed to a single-stage schedule's constructor (``loss_fn``, ``scale_grads``).
    Returns:
        A torch schedule whose ``step`` runs the forward of every microbatch.
    """
    if not spec.multi:
        return SCHEDULES[spec.forward_as or spec.name].cls(stages[0], n_microbatches=n_microbatches, **kwargs)
    return ScheduleForwardInOrder(stages, n_microbatches, stage_to_rank=stage_to_rank)
