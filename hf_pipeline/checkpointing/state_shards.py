"""Optimizer state of sharded parameters: gathered whole to save, cut to the parameter's shard to load.

A parameter sharded over a device mesh (a tensor-parallel ``DTensor``, or any other placement such
as FSDP2's ``Shard(0)`` over an "fsdp" dimension, alone or beside tensor parallelism) gets optimizer
state of the same placement from ``torch.optim`` (``exp_avg`` is ``zeros_like(param)``). The
checkpoint keeps every state tensor whole, keyed by checkpoint key, as for an unsharded model: so a
run saved on one mesh resumes on any other (pp2 x tp2 -> pp4 -> one process) and the file format
is the same with or without sharding. These two functions are the only place that knows how a
state tensor is sharded; a layout of another kind (a packed projection) replaces them alone.

Saving gathers one tensor at a time (``full_tensor``, collective over the parameter's mesh): a rank
that does not write drops each whole tensor at once, so it never holds more than one beyond its own
shards; the one rank per pipeline rank that writes its file (:func:`writes_pipeline_state`) keeps
them for it, the size of that file, as an unsharded run's writer does. Loading cuts the whole
tensor read from the file with torch's own ``distribute_tensor(..., src_data_rank=None)``: each rank
keeps its slice of the tensor it read itself, with no communication.

Example:
    >>> whole = gathered_state(param, opt.state[param]["exp_avg"])     # collective over param's mesh
    >>> opt_state["exp_avg"] = sharded_state(param, whole)             # this rank's shard again
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["gathered_state", "sharded_state", "writes_pipeline_state"]


def gathered_state(param: torch.Tensor, value: object) -> object:
    """An optimizer state value of ``param``, whole: gathered over its mesh when it is a ``DTensor``.

    Collective over the value's mesh for a ``DTensor`` (every rank of it calls, in the same order);
    anything else (a plain tensor, a 0-d ``step``, a number) comes back as it is.

    Args:
        param: the parameter the state belongs to (its placement decides nothing here; kept for a
            packed layout, whose whole tensor is not a plain concatenation).
        value: one entry of ``optimizer.state[param]``.

    Returns:
        A plain tensor (or ``value`` itself when not sharded).
    """
    del param  # the DTensor value carries its own placements
    return value.full_tensor() if isinstance(value, DTensor) else value


def sharded_state(param: torch.Tensor, value: object) -> object:
    """A whole optimizer state value read from a checkpoint, as ``param`` holds it: its shard on this rank.

    No communication: each rank slices the whole tensor it read. A state smaller than the
    parameter along a sharded dimension (a factored statistic of size 1 there, Adafactor's) is
    replicated along that dimension instead.

    Args:
        param: this rank's parameter (a ``DTensor`` when sharded, else a plain tensor).
        value: the saved value (a whole tensor, a 0-d ``step`` or a number).

    Returns:
        A ``DTensor`` of ``param``'s mesh for a sharded parameter's non-scalar tensor state, else ``value``.
    """
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    placements = [
        Replicate() if isinstance(p, Shard) and value.shape[p.dim] != param.shape[p.dim] else p
        for p in param.placements
    ]
    return distribute_tensor(value, param.device_mesh, placements, src_data_rank=None)


def writes_pipeline_state(dims) -> bool:
    """Whether this rank writes its pipeline rank's optimizer file: the first replica's first rank of
    every dimension other than the pipeline's (tensor-parallel, fsdp), which hold the same whole tensors."""
    others = ("dp_rank", "tp_rank", "fsdp_rank")
    return all(getattr(dims, name, 0) == 0 for name in others)
