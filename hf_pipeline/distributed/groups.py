"""The library's own process groups: made when a model loads, made afresh after a failure stopped them.

Every collective and point-to-point message of a pipelined model runs in groups the library made
for that model (``ctx.group`` over the whole job, ``dims.pp_group`` / ``dims.dp_group``), never in
the default (WORLD) group, which the user's code may share. When a stage fails in the middle of a
call, :mod:`.faults` stops these groups so the peers waiting on it wake up at once; WORLD is left
alone. A stopped gloo group cannot be used again (its connections are closed, on every rank), so
:func:`renew_groups` makes new ones for the next call.

Note (order): ``dist.new_group`` is collective over the whole job and names groups by a per-process
counter, so every rank must create the same groups in the same order. Both functions here create
them in a fixed order derived from the world size and the pipeline size alone.

Example (inside the loader):
    >>> ctx = own_group(init_distributed())
    >>> dims = ParallelDims.build(ctx, pp_size=2)
    >>> ctx, dims = renew_groups(ctx, dims)    # after a failure, on every rank
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from .context import RankContext
from .dims import ParallelDims

__all__ = ["own_group", "release_groups", "renew_groups"]


def own_group(ctx: RankContext) -> RankContext:
    """``ctx`` with a group of its own over every rank (collective: every rank calls it).

    Args:
        ctx: the job's rank context (its group is usually WORLD).

    Returns:
        A copy whose ``group`` is a new group of all ranks with the context's timeout; ``ctx`` itself
        for a single process.
    """
    if not ctx.is_distributed:
        return ctx
    group = dist.new_group(list(range(ctx.world_size)), timeout=ctx.timeout)
    return dataclasses.replace(ctx, group=group)


def renew_groups(
    ctx: RankContext, dims: ParallelDims, *made: dist.ProcessGroup | None
) -> tuple[RankContext, ParallelDims]:
    """New groups in place of ``ctx``'s and ``dims``'s (collective: every rank calls it, in the same order).

    The old groups are destroyed (:func:`release_groups`): they were stopped, nothing may use them again.

    Args:
        ctx: the model's rank context.
        dims: the model's parallel dims.
        *made: other groups made over the old ones (the training step's), destroyed with them.

    Returns:
        The new context and dims: the same ranks and sizes, fresh groups.
    """
    fresh = own_group(ctx)
    renewed = ParallelDims.build(fresh, dims.pp_size, dims.tp_size, dims.fsdp_size)
    release_groups(ctx.group, dims.pp_group, dims.dp_group, dims.tp_group, dims.fsdp_group, *made)
    return fresh, renewed


def release_groups(*groups: dist.ProcessGroup | None) -> None:
    """Destroy the library's groups in ``groups`` (never WORLD); best effort, a failure is ignored.

    Args:
        *groups: groups this rank no longer uses (a stopped group's connections are already closed).
    """
    seen: set[int] = set()
    for group in groups:
        if group is None or id(group) in seen or group is dist.group.WORLD or not dist.is_initialized():
            continue
        seen.add(id(group))
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - already destroyed, or not a member: nothing to free
            pass
