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

__all__ = ["BUCKET_BYTES", "all_reduce_flat", "fsdp_sync_group", "replicated_keys"]

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


def replicated_keys(dims: ParallelDims, named: list[tuple[str, torch.Tensor]], held_here: set[str]) -> set[str]:
    """Under FSDP, the keys of trainable parameters FSDP does not shard (a LoRA adapter's ``lora_A`` /
    ``lora_B``, added after loading): each rank keeps them whole, as a replica does, and FSDP neither
    reduce-scatters nor all-reduces their gradients, so the step sums them over the data-parallel group
    (:attr:`~hf_pipeline.distributed.dims.ParallelDims.dp_group`: every fsdp rank, and every replica's,
    of this pipeline slot), as it sums plain replicas'. Every microbatch loss is already divided by the
    global batch's item count, so that sum is the whole batch's gradient, the one FSDP's reduce-scatter
    (forced to a sum, ``loading/fsdp.py``) gives the sharded parameters. Empty without FSDP.

    Args:
        dims: the job's ranks.
        named: ``(key, parameter)`` of every trainable parameter this rank holds.
        held_here: the keys this pipeline rank alone holds (a plain key held by several, a tied pair,
            would need a sum over pipeline ranks too, which nothing adds after loading).
    """
    if dims.fsdp_size == 1:
        return set()
    plain = {name for name, p in named if not is_sharded(p)}
    shared = sorted(plain - held_here)
    if shared:
        raise TrainingError(
            f"training with fsdp_size > 1: {shared[:3]} are whole tensors (not sharded by FSDP) held by several "
            "pipeline ranks; untie them or train without fsdp_size"
        )
    return plain
