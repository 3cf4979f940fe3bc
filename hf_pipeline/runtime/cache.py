"""What every pipelined call shares: torch's stages and schedules per input shape, padding, gathering.

Torch's ``PipelineStage`` fixes its P2P buffers to the shapes of the first microbatch it runs,
so a pipelined call needs one set of ``PipelineStage`` objects and one schedule per input
signature (names, shapes and dtypes of the inputs, training or not). :class:`PipelineRuntime`
keeps them in a small LRU cache: dynamic padding makes every batch a new shape, and an unbounded
cache grows by the P2P buffers of every shape ever seen. The oldest entry is dropped when the
cache is full; a later call with its shape builds it again (cheap next to the step itself).

It also holds the call plumbing that forward, training and generation share: the input
signature, padding a batch to a multiple of the microbatch count (repeating the last row) and
giving the last stage's outputs to every rank of the pipeline.

Example:
    >>> runtime = PipelineRuntime(stages=stages, plan=plan, schedule=spec, n_microbatches=4, dims=dims, device=device)
    >>> pstages, schedule = runtime.get(runtime.signature(inputs), training=False)
    >>> out = schedule.step(**inputs)
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..distributed.dims import ParallelDims
from ..errors import InputError
from ..planning.actions import fuse_schedule_backward
from ..planning.plan import StagePlan
from ..planning.schedules import ScheduleSpec
from . import weight_pass
from .chunk_marks import MarkedStage
from .forward_schedule import forward_schedule

__all__ = [
    "CACHE_ENV", "DEFAULT_CACHE_SIZE", "PipelineRuntime", "cache_size", "pad_batch", "run_local_stages", "signature",
    "split_microbatches",
]

DEFAULT_CACHE_SIZE = 8  # input shapes whose built stages, schedules (and traces) are kept
CACHE_ENV = "HF_PIPELINE_RUNTIME_CACHE"


def cache_size() -> int:
    """How many input shapes keep their built pipeline (here) and trace (``loading/trace.py``).

    Returns:
        ``$HF_PIPELINE_RUNTIME_CACHE`` as a positive integer, or :data:`DEFAULT_CACHE_SIZE` when unset.
    """
    raw = os.environ.get(CACHE_ENV)
    if raw is None:
        return DEFAULT_CACHE_SIZE
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1:
        raise InputError(f"{CACHE_ENV}={raw!r} must be a positive integer (input shapes kept built)")
    return size


def signature(inputs: dict[str, Any]) -> tuple:
    """A hashable key for the inputs' names, shapes and dtypes (non-tensors by value)."""
    return tuple(
        (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v)) for k, v in sorted(inputs.items())
    )


def split_microbatches(inputs: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """``inputs`` cut into ``n`` microbatches as torch's schedules cut them (``tensor_split``; non-tensors to each)."""
    chunks = {k: torch.tensor_split(v, n) if isinstance(v, torch.Tensor) else [v] * n for k, v in inputs.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(n)]


def run_local_stages(stages, inputs: dict[str, Any]) -> tuple:
    """Every stage of a pipeline of size 1, one after another on ``inputs``: the last stage's outputs, a tuple."""
    x: tuple = ()
    for stage in stages:
        x = stage(*x, **inputs)
        x = x if isinstance(x, tuple) else (x,)
    return x


def pad_batch(inputs: dict[str, Any], batch: int, multiple: int) -> dict[str, Any]:
    """``inputs`` with every batch-major tensor padded to a multiple of ``multiple`` rows by repeating its last row.

    Torch's schedules need equal microbatches; the caller drops the padded rows' outputs.
    """
    pad = (-batch) % multiple
    if not pad:
        return inputs
    return {
        k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])])
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch
        else v
        for k, v in inputs.items()
    }


class PipelineRuntime:
    """This rank's torch pipeline objects, built per input signature and kept in a bounded LRU.

    Attributes:
        max_cached: how many signatures stay built (default 8, or ``$HF_PIPELINE_RUNTIME_CACHE``);
            may be changed at any time (the next call trims the cache).
        builds: how many times stages and a schedule were built (for tests and profiling).
    """

    def __init__(
        self, *, stages: Sequence[nn.Module], plan: StagePlan, schedule: ScheduleSpec, n_microbatches: int,
        dims: ParallelDims, device: torch.device, max_cached: int | None = None,
    ):
        self.stages = list(stages)
        self.plan = plan
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        self.dims = dims
        self.device = device
        self.max_cached = cache_size() if max_cached is None else max_cached
        self.builds = 0
        self._cache: OrderedDict[Any, tuple[list[PipelineStage], Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        """Drop every built stage and schedule (their P2P buffers with them)."""
        self._cache.clear()

    def get(
        self, key: Any, *, training: bool, loss_fn=None, scale_grads: bool = True, n_microbatches: int | None = None
    ) -> tuple[list[PipelineStage], Any]:
        """``PipelineStage`` objects and the torch schedule for one input signature (built on first use).

        Args:
            key: the input signature (:func:`signature`, plus anything else that changes the graph).
            training: the training schedule (with ``loss_fn``) instead of the forward-only one.
            scale_grads: False: torch does not divide gradients by n_microbatches (the loss
                already is each microbatch's share of the global mean, see ``train.py``).
            n_microbatches: this call's (default: the model's; a count the default chose adapts to each batch).
        """
        m = self.n_microbatches if n_microbatches is None else n_microbatches
        full_key = (key, training, scale_grads, m)
        found = self._cache.get(full_key)
        if found is not None:
            self._cache.move_to_end(full_key)
            return found
        spec = self.schedule
        # Zero-bubble: W = the linears' deferred weight gradients (weight_pass.py), not torch's graph split.
        deferred = training and spec.zero_bubble
        stage_class = weight_pass.WeightDeferringStage if deferred else MarkedStage
        pstages = [
            stage_class(stage, stage.spec.index, self.plan.num_stages, self.device, group=self.dims.pp_group)
            for stage in self.stages
        ]
        # Note: torch's single-stage schedules divide every .grad by n_microbatches at the end of each step when
        # scale_grads=True, also a step without backward: a forward-only call between two accumulated training
        # steps (a Trainer's evaluation, DPO's reference pass) would scale the gradients kept so far.
        kwargs = {"n_microbatches": m, "loss_fn": loss_fn, "scale_grads": scale_grads and training}
        if training:
            schedule = spec.cls(pstages if spec.multi else pstages[0], **kwargs)
            if spec.zero_bubble:
                fuse_schedule_backward(schedule)  # adjacent I + W as one backward where no rank waits between
        else:
            stage_to_rank = {s.index: s.rank for s in self.plan.stages}
            schedule = forward_schedule(spec, pstages, stage_to_rank=stage_to_rank, **kwargs)
        self._cache[full_key] = (pstages, schedule)
        self.builds += 1
        while len(self._cache) > max(1, self.max_cached):
            self._cache.popitem(last=False)
        return pstages, schedule

    def broadcast_from_last(self, tensors: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
        """The last stage's output tensors on every rank of this pipeline (``None`` on the others)."""
        src = self.dims.global_rank(self.plan.last_rank)
        meta = [None if tensors is None else [(tuple(t.shape), t.dtype) for t in tensors]]
        dist.broadcast_object_list(meta, src=src, group=self.dims.pp_group)
        if tensors is None:
            tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[0])
        else:
            tensors = tuple(t.contiguous() for t in tensors)
        for t in tensors:
            dist.broadcast(t, src=src, group=self.dims.pp_group)
        return tensors
