"""One rank context: process group, device and error agreement for every rank of a job.

``init_distributed()`` works the same under ``torchrun``, ``accelerate launch --multi_gpu`` (both set
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR) and a plain ``python script.py`` (world size 1, no
process group). Devices come from LOCAL_RANK, never the global rank, so multi-host jobs place
stages on the right GPU. A failure detected on one rank is turned into an error on every rank
(``collective_errors``) instead of leaving the others blocked in a receive.

Example:
    >>> ctx = init_distributed()
    >>> with collective_errors(ctx, "loading weights"):
    ...     tensors = load_my_shards()
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankContext",
    "RankError",
    "check_same_on_all_ranks",
    "collective_errors",
    "destroy_distributed",
    "get_rank_context",
    "init_distributed",
    "raise_on_any_rank",
]

# Well under torch's 30 minutes: a dead peer must not hold a job for half an hour.
DEFAULT_TIMEOUT_S = 300.0


class RankError(RuntimeError):
    """Another rank failed; the message names it and carries its original message."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), original_type: str = ""):
        super().__init__(message)
        self.ranks = ranks
        self.rank = ranks[0] if ranks else None
        self.original_type = original_type


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str  # "gloo", "nccl" or "none" (single process)
    group: Any = None  # the default process group, or None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.rank == self.world_size - 1

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()


_CONTEXT: RankContext | None = None
_CREATED_GROUP = False


def _timeout_from_env(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout is None:
        timeout = float(os.environ.get("HF_PIPELINE_TIMEOUT", DEFAULT_TIMEOUT_S))
    return datetime.timedelta(seconds=float(timeout))


def init_distributed(*, device: str | torch.device | None = None, timeout: float | datetime.timedelta | None = None) -> RankContext:
    """Join (or create) the default process group and pick this rank's device.

    Args:
        device: force a device type ("cpu", "cuda"); default cuda:LOCAL_RANK when CUDA is available.
        timeout: collective timeout (seconds); default env HF_PIPELINE_TIMEOUT, else 300 s.
    Returns:
        The :class:`RankContext` (also kept for :func:`get_rank_context`).
    """
    global _CONTEXT, _CREATED_GROUP
    if os.environ.get("HF_PIPELINE_THREADS"):
        torch.set_num_threads(int(os.environ["HF_PIPELINE_THREADS"]))
    td = _timeout_from_env(timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    want = torch.device(device) if device is not None else None
    use_cuda = (want is None and torch.cuda.is_available()) or (want is not None and want.type == "cuda")
    if use_cuda:
        dev = torch.device("cuda", want.index if want is not None and want.index is not None else local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")

    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        world, rank = dist.get_world_size(), dist.get_rank()
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, init_method="env://", timeout=td, **kwargs)
        _CREATED_GROUP = True
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        backend, world, rank = "none", 1, 0
    _CONTEXT = RankContext(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, device=dev,
        backend=backend, group=dist.group.WORLD if world > 1 else None, timeout_s=td.total_seconds(),
    )
    return _CONTEXT


def get_rank_context() -> RankContext:
    """The context made by the last :func:`init_distributed` (made now if there is none)."""
    return _CONTEXT if _CONTEXT is not None else init_distributed()


def destroy_distributed() -> None:
    """Tear down the process group this module created, and forget the context."""
    global _CONTEXT, _CREATED_GROUP
    if _CREATED_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _CREATED_GROUP = False
    _CONTEXT = None


def raise_on_any_rank(ctx: RankContext, error: BaseException | None, *, what: str) -> None:
    """Collective: if any rank failed at ``what``, raise on every rank.

    The failing rank re-raises its own exception (type and traceback kept); the others raise
    :class:`RankError` naming the failing rank(s) and their messages.
    """
    if not ctx.is_distributed:
        if error is not None:
            raise error
        return
    mine = None if error is None else (type(error).__name__, str(error))
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
    if not failed:
        return
    if error is not None:
        raise error
    detail = "; ".join(f"rank {r} raised {t}: {m}" for r, (t, m) in failed)
    raise RankError(f"{what} failed on another rank: {detail}", ranks=tuple(r for r, _ in failed), original_type=failed[0][1][0])


@contextlib.contextmanager
def collective_errors(ctx: RankContext, what: str) -> Iterator[None]:
    """Run a local step on every rank; an exception on any rank becomes an error on all of them."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised below, on this rank and (as RankError) on the others
        raise_on_any_rank(ctx, e, what=what)
        raise
    raise_on_any_rank(ctx, None, what=what)


def _fingerprint(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest = hashlib.sha1(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16]
        return ("tensor", tuple(t.shape), str(t.dtype), digest)
    if isinstance(value, dict):
        return tuple((k, _fingerprint(v)) for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_fingerprint(v) for v in value)
    return repr(value)


def check_same_on_all_ranks(ctx: RankContext, name: str, value: Any, *, group: Any = None) -> None:
    """Collective: raise ValueError on every rank if ``value`` differs between ranks.

    For inputs of collective calls (every rank must pass the same ``input_ids``): a silent
    difference would give wrong results or a hang, so it is detected from a cheap fingerprint.
    """
    if not ctx.is_distributed:
        return
    size = dist.get_world_size(group)
    prints: list[Any] = [None] * size
    dist.all_gather_object(prints, _fingerprint(value), group=group)
    if any(p != prints[0] for p in prints):
        differ = [r for r, p in enumerate(prints) if p != prints[0]]
        raise ValueError(
            f"{name} differ between ranks (ranks {differ} differ from rank 0); a pipelined call is collective and "
            f"every rank must pass the same {name}"
        )
