"""Object collectives over the default process group, for tools that run with or without ``torchrun``.

Without a process group of more than one rank each is the one-process answer: a barrier does nothing,
a gather is this rank's object alone, a broadcast returns the object as it is.
"""

from __future__ import annotations

from typing import Any

__all__ = ["barrier", "broadcast_object", "gather_objects", "is_distributed"]


def is_distributed() -> bool:
    """Whether a default process group of more than one rank is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """``dist.barrier()`` when distributed, else nothing."""
    import torch.distributed as dist

    if is_distributed():
        dist.barrier()


def gather_objects(obj: Any, *, who: str = "script") -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; a broken group gives this rank's alone.

    Args:
        obj: this rank's object.
        who: the script's name, for the line printed when the group is broken.
    """
    import torch.distributed as dist

    if not is_distributed():
        return [obj]
    try:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    except Exception as e:  # noqa: BLE001 - the group is gone (an earlier failure): keep going locally
        print(f"[{who}] gathering from the other ranks failed ({type(e).__name__}: {e}); this rank's figures only",
              flush=True)
        return [obj]


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` as it is when not distributed)."""
    import torch.distributed as dist

    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
