"""What a schedule runs: each rank's compute actions in one step, and the backward-fusing rewrite.

:func:`schedule_actions` lists the actions (``["0F0", "0F1", "0B0", ...]``) every rank of a
schedule runs, from torch's own ``pipeline_order`` (built from stand-in stage objects, so no
process group is needed) or, for the single-stage schedules, from the loops of their ``step``.
:func:`fuse_backward` is the one rewrite the runtime applies to torch's zero-bubble schedules:
an input-gradient pass directly followed by its weight-gradient pass, where no other rank waits
between them, runs as one full backward.

Example:
    >>> schedule_actions("1f1b", pp_size=2, n_microbatches=2)[1]
    ['1F0', '1B0', '1F1', '1B1']
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterator, Sequence

from torch import nn

from ..compat import Action, ComputationType, prepare_schedule_with_comms
from .schedules import ScheduleSpec, get_schedule, rank_of_stage

__all__ = ["ACTION_KINDS", "fuse_backward", "fuse_schedule_backward", "peak_in_flight", "schedule_actions"]

ACTION_KINDS = ("F", "B", "I", "W")  # a schedule's own compute actions (what pipeline_order lists)


def _single_stage_actions(spec: ScheduleSpec, stage: int, num_stages: int, m: int) -> list[str]:
    # What ScheduleGPipe / Schedule1F1B._step_microbatches execute: ``spec.warmup`` forwards, then
    # one backward and one forward while forwards remain, then the remaining backwards. Note:
    # torch 2.13's Schedule1F1B.pipeline_order numbers the last rank's forwards 1..m (off by one),
    # so the order is derived from the step's own loops instead.
    warmup = m if spec.warmup == "all" else min(m, num_stages - stage)
    out = [f"{stage}F{i}" for i in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < m:
        out += [f"{stage}B{bwd}", f"{stage}F{fwd}"]
        bwd, fwd = bwd + 1, fwd + 1
    out += [f"{stage}B{i}" for i in range(bwd, m)]
    return out


def _flatten(actions) -> Iterator[Any]:
    for a in actions:
        if a is None:
            continue
        if a.sub_actions:
            yield from _flatten(a.sub_actions)
        else:
            yield a


def fuse_backward(order: dict[int, list], stage_to_rank: Callable[[int], int]) -> dict[int, list]:
    """``order`` with each input-gradient pass merged into the weight-gradient pass that follows it
    where the split buys nothing, as one full backward (B).

    Zero-bubble schedules split a stage's backward into the input gradient (I), which the previous
    stage waits for, and the weight gradient (W), which fills a bubble later. The split has a
    price: two autograd passes over the graph instead of one, ~5% more backward time measured on a
    LLaMA block on CPU. Where a rank's list has ``I(s, i)`` immediately followed by ``W(s, i)`` and
    no other rank waits for that input gradient (``s`` is the first stage, so there is none, or
    stage ``s - 1`` is on the same rank, whose backward comes later in the same list anyway), one
    full backward finishes at the same time with less work, and nothing else moves. Where the
    gradient goes to another rank the pair stays split: merging would hold its send back by W.

    Args:
        order: rank -> compute actions (torch's ``pipeline_order``; ``None`` bubbles are dropped).
        stage_to_rank: the rank of a stage index.
    Returns:
        rank -> the actions, merged pairs as one FULL_BACKWARD action each.
    """
    i_kind, w_kind, b_kind = (
        ComputationType.BACKWARD_INPUT,
        ComputationType.BACKWARD_WEIGHT,
        ComputationType.FULL_BACKWARD,
    )
    out: dict[int, list] = {}
    for rank, actions in order.items():
        acts = [a for a in actions if a is not None]
        merged: list = []
        k = 0
        while k < len(acts):
            a, nxt = acts[k], acts[k + 1] if k + 1 < len(acts) else None
            if (
                nxt is not None and a.computation_type == i_kind and nxt.computation_type == w_kind
                and (a.stage_index, a.microbatch_index) == (nxt.stage_index, nxt.microbatch_index)
                and (a.stage_index == 0 or stage_to_rank(a.stage_index - 1) == rank)
            ):
                merged.append(Action(a.stage_index, b_kind, a.microbatch_index))
                k += 2
            else:
                merged.append(a)
                k += 1
        out[rank] = merged
    return out


def fuse_schedule_backward(schedule) -> None:
    """Apply :func:`fuse_backward` to a built torch runtime schedule (zero-bubble ones) and lower it again."""
    mapping = dict(schedule.stage_index_to_group_rank)
    fused = fuse_backward(schedule.pipeline_order, mapping.__getitem__)
    if all(len(fused[r]) == sum(a is not None for a in acts) for r, acts in schedule.pipeline_order.items()):
        return  # nothing merged: torch's lowering stands as built
    schedule.pipeline_order = fused
    prepare_schedule_with_comms(schedule, fused)  # torch's own lowering: sends, receives, grad reduction


def _stand_in_stage(index: int, num_stages: int, pp_size: int) -> types.SimpleNamespace:
    # The attributes PipelineScheduleMulti.__init__ reads from its stages: enough to build a
    # schedule's pipeline_order without a process group or a model.
    return types.SimpleNamespace(
        stage_index=index, num_stages=num_stages, group_size=pp_size, group_rank=0,
        is_first=index == 0, is_last=index == num_stages - 1, submod=nn.Module(),
    )


def _forward_only_actions(spec: ScheduleSpec, p: int, v: int, m: int) -> dict[int, list[str]]:
    # A forward-only call runs every rank's stages in stage order, all microbatches of one
    # stage before the next (GPipe's forward for one stage per rank, looped BFS's for looped
    # stages, ScheduleForwardInOrder's for any layout): see runtime.forward_schedule.
    num_stages = p * (v if spec.multi else 1)
    return {
        r: [f"{s}F{i}" for s in range(num_stages) if rank_of_stage(s, p, spec.layout) == r for i in range(m)]
        for r in range(p)
    }


def _multi_stage_actions(spec: ScheduleSpec, p: int, v: int, m: int) -> dict[int, list[str]]:
    num_stages = p * v
    local = [_stand_in_stage(i, num_stages, p) for i in range(num_stages) if rank_of_stage(i, p, spec.layout) == 0]
    order = spec.cls(local, n_microbatches=m, loss_fn=lambda out, target: out).pipeline_order
    if spec.zero_bubble:  # as the runtime runs it (PipelineRuntime.get)
        order = fuse_backward(order, lambda s: rank_of_stage(s, p, spec.layout))
    return {r: [str(a) for a in _flatten(order[r]) if a.computation_type.value in ACTION_KINDS] for r in range(p)}


def schedule_actions(
    schedule: str | ScheduleSpec, *, pp_size: int, n_microbatches: int, virtual_stages: int = 1, training: bool = True
) -> dict[int, list[str]]:
    """The compute actions each pipeline rank runs in one step, in order (``["0F0", "0F1", "0B0", ...]``).

    Multi-stage schedules: torch's own ``pipeline_order`` (built from stand-in stage objects, so no
    process group is needed), with the backward passes merged as the runtime runs them
    (:func:`fuse_backward`). Single-stage GPipe / 1F1B: the order their ``step`` executes.

    Args:
        schedule: a schedule name or spec (anything :func:`get_schedule` takes).
        pp_size, n_microbatches, virtual_stages: the placement and the microbatches of one step.
        training: False for the forward actions only (what a forward-only step runs).
    Returns:
        rank -> its actions as strings (stage, kind F/B/I/W, microbatch).
    """
    spec = get_schedule(schedule)
    p, v, m = pp_size, virtual_stages, n_microbatches
    if not training:
        return _forward_only_actions(spec, p, v, m)
    if not spec.multi:
        return {r: _single_stage_actions(spec, r, p, m) for r in range(p)}
    return _multi_stage_actions(spec, p, v, m)


def peak_in_flight(actions: Sequence[str], act: dict[int, int]) -> tuple[int, dict[int, int]]:
    """The largest sum of ``act[stage]`` over the microbatches live at once in a rank's ``actions``, and how many
    were live per stage then: activations live from F to B (or to W for split backward)."""
    live: dict[int, set[int]] = {s: set() for s in act}
    peak, at_peak = 0, {s: 0 for s in act}
    for label in actions:
        i = next(j for j, c in enumerate(label) if c.isalpha())
        stage, kind, mb = int(label[:i]), label[i], int(label[i + 1 :])
        if kind == "F":
            live[stage].add(mb)
        elif kind in ("B", "W"):
            live[stage].discard(mb)
        total = sum(len(v) * act[s] for s, v in live.items())
        if total > peak:
            peak, at_peak = total, {s: len(v) for s, v in live.items()}
    return peak, at_peak
