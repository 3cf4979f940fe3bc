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

Note (tensor parallelism): a stage's ``DTensor`` parameters, their gradients, the optimizer's state
made from them and torch's parallel styles (their hooks, the package's ``LocalParallel``) all hold the
device mesh object the stage was sharded over, which communicates in the groups it names. Rather than
replace each of those (the optimizer's state is out of reach), :func:`renew_groups` points that mesh
object at the fresh mesh's groups (:func:`rebind_meshes`): one change that every holder sees, the
``Parameter`` objects and the optimizer's references untouched. FSDP2 is not renewed: ``fully_shard``
keeps the process group objects themselves (each parameter group's mesh info), not only the mesh, and a
step that failed half-way leaves its per-step state behind (pending reduce-scatters, the root's
post-backward callback, unsharded parameters); resetting those means reaching into FSDP2's private
state, which no public API offers, so a failure under FSDP still ends the job (``PipelineBroken``).

Example (inside the loader):
    >>> ctx = own_group(init_distributed())
    >>> dims = ParallelDims.build(ctx, pp_size=2)
    >>> ctx, dims = renew_groups(ctx, dims, stages=model.stages)    # after a failure, on every rank
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch.distributed as dist
from torch import nn

from ..compat import mesh_group_names, set_mesh_group_names
from ..errors import InternalError
from .context import RankContext
from .dims import ParallelDims
from .shards import EXPERT_MESH_DIMS

__all__ = ["own_group", "rebind_meshes", "release_groups", "renew_groups"]


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
    ctx: RankContext, dims: ParallelDims, *made: dist.ProcessGroup | None, stages: Iterable[nn.Module] = ()
) -> tuple[RankContext, ParallelDims]:
    """New groups in place of ``ctx``'s and ``dims``'s (collective: every rank calls it, in the same order).

    The old groups are destroyed (:func:`release_groups`): they were stopped, nothing may use them again.

    Args:
        ctx: the model's rank context.
        dims: the model's parallel dims.
        *made: other groups made over the old ones (the training step's), destroyed with them.
        stages: this rank's stages; their tensor-parallel meshes are pointed at the fresh groups
            (:func:`rebind_meshes`).

    Returns:
        The new context and dims: the same ranks and sizes, fresh groups.

    Raises:
        InternalError: the stages hold FSDP2 shards (not renewable: see the module Note).
    """
    if dims.fsdp_size > 1:
        raise InternalError("FSDP2 stages keep their process groups themselves; they cannot be given fresh ones")
    fresh = own_group(ctx)
    old_experts = dims.expert_groups  # before rebinding: the stages' ep mesh is dims.ep_mesh itself
    renewed = ParallelDims.build(fresh, dims.pp_size, dims.tp_size, dims.fsdp_size, dims.ep_data)
    rebind_meshes(stages, renewed)
    release_groups(ctx.group, dims.pp_group, dims.dp_group, dims.tp_group, dims.fsdp_group, *old_experts, *made)
    return fresh, renewed


def rebind_meshes(stages: Iterable[nn.Module], dims: ParallelDims) -> int:
    """Point every device mesh the ``DTensor`` parameters of ``stages`` live on at ``dims``'s groups.

    Each such mesh (the tensor-parallel sub-mesh, by its dim names) takes the process group names of
    the same dims of ``dims.mesh``, which has the same ranks; the mesh object stays, so its every
    holder follows (see the module Note).

    Args:
        stages: this rank's stage modules.
        dims: the fresh dims (their ``mesh`` made over the fresh groups).

    Returns:
        How many mesh objects were pointed at the fresh groups (0 without sharded parameters).
    """
    from torch.distributed.tensor import DTensor

    meshes = {id(p.device_mesh): p.device_mesh for s in stages for p in s.parameters() if isinstance(p, DTensor)}
    for mesh in meshes.values():
        names = mesh.mesh_dim_names
        if names == EXPERT_MESH_DIMS:  # experts over replicas: their own 1-D mesh, not a dim of dims.mesh
            set_mesh_group_names(mesh, mesh_group_names(dims.ep_mesh))
            continue
        target = dims.mesh if names == dims.mesh.mesh_dim_names else dims.mesh[names]
        set_mesh_group_names(mesh, mesh_group_names(target))
    return len(meshes)


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
