"""Tensor-parallel shards (torch ``DTensor``) seen from code written for plain tensors.

A stage under tensor parallelism holds some parameters as ``DTensor`` shards (``parallelize_module``
makes them); the gradient sync, the norm and the checkpoint writer work on the local shard or on
the whole tensor gathered from the stage's tensor-parallel ranks.

Example:
    >>> [local_tensor(p.grad) for p in stage.parameters()]   # what this rank holds, plain tensors
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = [
    "EXPERT_MESH_DIMS", "full_tensor", "is_replicated", "is_sharded", "local_tensor", "mesh_norm_power", "norm_power",
    "on_expert_mesh",
]

# The dim names of the 1-D mesh experts spread over data-parallel ranks are sharded on (``ParallelDims.ep_mesh``).
EXPERT_MESH_DIMS = ("ep",)


def is_sharded(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a tensor-parallel ``DTensor`` (a parameter or a gradient)."""
    return isinstance(t, DTensor)


def is_replicated(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a ``DTensor`` whose every rank holds all of it (Replicate on every mesh dim)."""
    return isinstance(t, DTensor) and all(p.is_replicate() for p in t.placements)


def on_expert_mesh(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a ``DTensor`` on an experts-over-data mesh (:data:`EXPERT_MESH_DIMS`). By the mesh's dim
    names, not its identity: after fresh groups, or in a later load, the stages hold mesh objects of their own."""
    return isinstance(t, DTensor) and t.device_mesh.mesh_dim_names == EXPERT_MESH_DIMS


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` as a plain tensor sharing its storage (``t`` itself when plain)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from the tensor-parallel ranks for a ``DTensor`` (collective over
    them: every one of them must call it, in the same order), ``t`` itself when plain."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def norm_power(
    grads: list[torch.Tensor], norm_type: float, *, device: torch.device, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``||grads||_p ** p`` (the max for p = inf) of one pipeline rank's gradients, as float32 on ``device``:
    the plain ones as they are, the shards' part summed (max) over the stage's tensor-parallel group
    (collective over it when given), so that a replicated tensor counts once and a sharded one whole."""
    inf = norm_type == float("inf")
    parts = []
    # A DTensor replicated on every dim (torch's RowwiseParallel bias, a user plan's Replicate) is whole on each
    # rank: it counts as a plain tensor, or the sum over the group would count it once per rank.
    whole = [local_tensor(g) for g in grads if not is_sharded(g) or is_replicated(g)]
    for group in (whole, [g.to_local() for g in grads if is_sharded(g) and not is_replicated(g)]):
        norm = torch.nn.utils.get_total_norm(group, norm_type).to(device, torch.float32) if group else None
        parts.append(torch.zeros((), device=device) if norm is None else (norm if inf else norm**norm_type))
    plain, sharded = parts
    if tp_group is not None:
        dist.all_reduce(sharded, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=tp_group)
    return torch.maximum(plain, sharded) if inf else plain + sharded


def mesh_norm_power(grads: list[torch.Tensor], norm_type: float, *, device: torch.device) -> torch.Tensor:
    """:func:`norm_power` for shards of several meshes at once (FSDP over tensor-parallel shards: a
    parameter sharded on (fsdp, tp), another on fsdp alone): each shard's part is summed (max) over
    the groups of exactly the mesh dims it is split on (collective over them, in a fixed order)."""
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    by_dims: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if is_sharded(g) and not is_replicated(g):
            split = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
            by_dims.setdefault((g.device_mesh.mesh_dim_names, split), []).append(g)
    total = norm_power([g for g in grads if not is_sharded(g) or is_replicated(g)], norm_type, device=device,
                       tp_group=None)
    for (_, split), group in sorted(by_dims.items(), key=lambda kv: str(kv[0])):
        power = norm_power([g.to_local() for g in group], norm_type, device=device, tp_group=None)
        for dim in split:
            dist.all_reduce(power, op=op, group=group[0].device_mesh.get_group(dim))
        total = torch.maximum(total, power) if inf else total + power
    return total
