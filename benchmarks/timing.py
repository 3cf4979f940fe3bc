"""Timing helpers every section shares: medians, the ranks' start line, one message's hop, the inputs."""

from __future__ import annotations

import statistics
import time

__all__ = ["batch", "hop_seconds", "median", "prompts", "share", "sync"]


def median(xs):
    """The median of ``xs``; NaN for none."""
    return statistics.median(xs) if xs else float("nan")


def share(part: float, whole: float) -> float | None:
    """``part / whole`` for a positive ``whole`` (a cost and what it is a part of); None otherwise."""
    return part / whole if whole > 0 else None


def sync() -> None:
    """Every rank waits for the others (nothing outside a process group): timed work starts together."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def batch(sizes: dict, seed: int = 0):
    """The training batch: random token ids (``batch`` x ``seq``), their own labels."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, sizes["vocab"], (sizes["batch"], sizes["seq"]), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def prompts(sizes: dict, seed: int = 1):
    """The generation prompts: random token ids (``prompts`` x ``prompt_len``) and their attention mask."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, sizes["vocab"], (sizes["prompts"], sizes["prompt_len"]), generator=g)
    return ids, torch.ones_like(ids)


def hop_seconds(shape: tuple[int, ...], rounds: int) -> float:
    """Seconds of one hop of a message with no compute: a float32 tensor of ``shape`` passed around
    every rank ``rounds`` times with the pipeline's own calls (``isend``, ``irecv`` waited on), per
    round over the ranks. What a dependency between two ranks costs beyond the compute on either
    side, on this machine and backend."""
    import torch
    import torch.distributed as dist

    r, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (r + 1) % world, (r - 1) % world
    buf = torch.zeros(shape)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if r == 0:
            dist.isend(buf, nxt).wait()
            dist.irecv(buf, prev).wait()
        else:
            dist.irecv(buf, prev).wait()
            dist.isend(buf, nxt).wait()
    return (time.perf_counter() - start) / (rounds * world)
