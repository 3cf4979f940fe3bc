"""The step simulator: the wall time of one training step of a schedule, from its stages' costs.

Each rank runs its actions (:func:`~hf_pipeline.planning.actions.schedule_actions`) in torch's
order; an action starts when its rank is free and its input exists (:func:`action_input`). The
dependency graph depends on the schedule and placement alone and is built once
(``_step_graph``), so the planner and the automatic schedule choice (``auto_choice.py``) can
simulate many candidate splits cheaply.

Example:
    >>> simulate_step("1f1b", pp_size=2, virtual_stages=1, n_microbatches=4, stage_cost=[1.0, 1.0])
    (15.0, {0: 12.0, 1: 12.0})
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Sequence

from ..errors import ScheduleError
from .actions import ACTION_KINDS, schedule_actions
from .schedules import ScheduleSpec, get_schedule

__all__ = ["ACTION_WEIGHTS", "action_input", "simulate_step"]

# Cost of each kind of action in units of its stage's forward: a full backward does twice a
# forward's matmuls, its input and weight halves one each.
ACTION_WEIGHTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def action_input(
    stage: int, kind: str, microbatch: int, *, last_stage: int, exists: Callable[[tuple[int, str, int]], bool]
) -> tuple[int, str, int] | None:
    """The action whose output ``(stage, kind, microbatch)`` waits for, or None (a pipeline input,
    or the last stage's backward, which starts from its own forward's loss).

    A forward waits for the previous stage's forward of its microbatch; a full or input-gradient
    backward for the next stage's full backward, or its input-gradient pass where that stage's
    backward is split (``exists`` says which ran); a weight-gradient pass for its own input pass.
    """
    if kind == "F":
        return (stage - 1, "F", microbatch) if stage > 0 else None
    if kind in ("B", "I"):
        if stage == last_stage:
            return None
        full = (stage + 1, "B", microbatch)
        return full if exists(full) else (stage + 1, "I", microbatch)
    if kind == "W":
        return (stage, "I", microbatch)
    raise ScheduleError(f"unknown action kind {kind!r}; expected one of {ACTION_KINDS}")


@functools.lru_cache(maxsize=256)
def _step_graph(
    spec: ScheduleSpec, pp_size: int, virtual_stages: int, n_microbatches: int
) -> tuple[tuple[int, int, str, int], ...]:
    """Every action of one training step as (rank, stage, kind, index of the action it waits for or -1), in an order
    where each comes after what it waits for: the previous action of its rank (implicit, by order) and its data.

    The graph depends on the schedule alone, so a simulation with any stage costs is one pass over it.
    """
    orders = schedule_actions(
        spec, pp_size=pp_size, n_microbatches=n_microbatches, virtual_stages=virtual_stages, training=True
    )
    last = max(int(re.match(r"\d+", a).group()) for acts in orders.values() for a in acts)
    parsed = {
        r: [(int(s), k, int(i)) for s, k, i in (re.fullmatch(r"(\d+)([FBIW])(\d+)", a).groups() for a in acts)]
        for r, acts in orders.items()
    }
    kinds = {(s, k, i) for acts in parsed.values() for s, k, i in acts}
    index: dict[tuple[int, str, int], int] = {}
    graph: list[tuple[int, int, str, int]] = []
    pos = {r: 0 for r in parsed}
    remaining = sum(len(a) for a in parsed.values())
    while remaining:
        progressed = False
        for r, acts in parsed.items():
            while pos[r] < len(acts):
                s, k, i = acts[pos[r]]
                need = action_input(s, k, i, last_stage=last, exists=kinds.__contains__)
                if need is not None and need not in index:
                    break
                index[(s, k, i)] = len(graph)
                graph.append((r, s, k, -1 if need is None else index[need]))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(
                f"schedule {spec.name!r}: the simulated step deadlocks (an action waits for one that never runs)"
            )
    return tuple(graph)


def simulate_step(
    spec: ScheduleSpec | str, *, pp_size: int, virtual_stages: int, n_microbatches: int,
    stage_cost: Sequence[float], overhead: float = 0.0,
) -> tuple[float, dict[int, float]]:
    """Simulated wall time of one training step, and each rank's busy time.

    Each rank runs its actions in the order torch's schedule lists them; an action starts when its
    rank is free and its input exists (a forward after the previous stage's forward, a backward
    after the next stage's backward, a weight-gradient pass after its input pass). Messages are free.

    Args:
        stage_cost: forward cost of one microbatch on each stage (any unit; each kind of action costs
            :data:`ACTION_WEIGHTS` times it).
        overhead: added to every action, in the same unit.
    """
    spec = get_schedule(spec)
    graph = _step_graph(spec, pp_size, virtual_stages, n_microbatches)
    done = [0.0] * len(graph)
    free = [0.0] * pp_size
    busy = [0.0] * pp_size
    for n, (r, s, k, need) in enumerate(graph):
        cost = ACTION_WEIGHTS[k] * stage_cost[s] + overhead
        start = free[r] if need < 0 or done[need] <= free[r] else done[need]
        done[n] = free[r] = start + cost
        busy[r] += cost
    return max(free), dict(enumerate(busy))


