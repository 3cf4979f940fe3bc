"""Gradients summed over a process group in flat buckets: one collective per bucket, not per tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..compat import flatten_dense_tensors, unflatten_dense_tensors

__all__ = ["BUCKET_BYTES", "all_reduce_flat"]

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
