"""Gradients summed over a process group in flat buckets: one collective per bucket, not per tensor;
and, under FSDP, the groups that still need a sum."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..compat import flatten_dense_tensors, unflatten_dense_tensors
from ..distributed.context import RankContext
from ..distributed.dims import ParallelDims
from ..distributed.shards import is_sharded
from ..errors import TrainingError

__all__ = ["BUCKET_BYTES", "all_reduce_flat", "fsdp_sync_group", "refuse_unsharded"]

BUCKET_BYTES = 32 << 20  # gradients are all-reduced in flat buckets of at most this size


def all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """In-place sum over ``group``, in flat buckets (one collective per bucket, not per tensor)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        bucket: list[torch.Tensor] = []
        size = 0
        items = by_dtype[dtype]
        for i, t in enumerate(items):
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= BUCKET_BYTES or i == len(items) - 1:
                flat = flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                for dst, src in zip(bucket, unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(src)
                bucket, size = [], 0


def fsdp_sync_group(
    ctx: RankContext, dims: ParallelDims, pp_ranks: tuple[int, ...], made: dict
) -> dist.ProcessGroup | None:
    """The group summing a key held on pipeline ranks ``pp_ranks`` when stages are FSDP-sharded (None:
    nothing to sum). Each stage's reduce-scatter has already summed its fsdp ranks' gradients into
    their chunks, so summing them again here would count them twice; only a key held on several
    pipeline ranks (a tied embedding and LM head) is summed, between the ranks at the same fsdp rank,
    which hold the same chunk of it (under HSDP: of the same replica; FSDP2 has summed the replicas).
    Collective over the world the first time (every rank makes every
    fsdp rank's group, in order); ``made`` keeps the groups made."""
    if len(pp_ranks) == 1:
        return None
    if len(pp_ranks) == dims.pp_size:
        return dims.pp_group
    for d in range(dims.dp_size):
        for t in range(dims.tp_size):  # with tensor parallelism: between the ranks of the same tp slot too
            key = dims.ranks(pp_ranks, t, (d,))
            if key not in made:
                made[key] = dist.new_group(list(key))
                if isinstance(made[key], dist.ProcessGroup):  # non-members get a placeholder
                    ctx.apply_timeout(made[key])
    return made[dims.ranks(pp_ranks, dims.tp_rank, (dims.dp_rank,))]


def refuse_unsharded(named: list[tuple[str, torch.Tensor]]) -> None:
    """Under FSDP every trainable parameter must be one of FSDP's shards: a plain one added after loading
    (a LoRA adapter) would get no reduce-scatter and, its key held on one pipeline rank, no sum here, so
    each fsdp rank would step it with its own rows' gradient alone."""
    plain = [name for name, p in named if not is_sharded(p)]
    if plain:
        raise TrainingError(
            f"training with fsdp_size > 1 needs every trainable parameter sharded by FSDP, but {plain[:3]} "
            f"({len(plain)} in all) were added after loading (an adapter?); train them without fsdp_size"
        )
