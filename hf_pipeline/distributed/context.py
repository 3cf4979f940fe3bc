"""One rank context: process group and device from the environment, and the collective timeout.

``init_distributed()`` works the same under ``torchrun``, ``accelerate launch --multi_gpu`` (which
starts torchrun) and a plain ``python script.py``: it reuses a default process group that already
exists, else creates one from the launcher's env (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``), else runs as a single process with no group at all. The device
comes from ``LOCAL_RANK`` (never the global rank, which is wrong on every host but the first).

The rest of the room builds on it: :mod:`.dims` (how ranks form pipeline replicas),
:mod:`.agreement` (a failure or a differing input on one rank becomes an error on every rank),
:mod:`.faults` (the same inside a pipelined call) and :mod:`.shutdown` (a clean interpreter exit).

Example (``torchrun --nproc-per-node 2 script.py``):
    >>> ctx = init_distributed()
    >>> ctx.rank, ctx.world_size, ctx.device   # (1, 2, device(type='cuda', index=1)) on the second process

Environment:
    HF_PIPELINE_TIMEOUT: collective timeout in seconds (default 300, far below torch's 30 min, so a
        dead peer ends the job in minutes); a positive, finite number up to a week (604800).
    HF_PIPELINE_THREADS: if set, ``torch.set_num_threads`` of every rank (tests set 1).
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compat import group_timeout
from ..errors import InputError
from .shutdown import register_exit_handler, settle_threads

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_TIMEOUT_S",
    "RankContext",
    "destroy_distributed",
    "get_rank_context",
    "init_distributed",
]

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is a typo (or overflows a timedelta, 1e30)
TIMEOUT_ENV = "HF_PIPELINE_TIMEOUT"
THREADS_ENV = "HF_PIPELINE_THREADS"

_CONTEXT: RankContext | None = None  # the context created last (get_rank_context)
_OWNS_GROUP = False  # True when init_distributed created the default group (destroy_distributed may destroy it)

@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Who this process is and where its tensors live; the one place per-rank facts are read from.

    Attributes:
        rank: global rank in ``[0, world_size)``.
        world_size: number of processes in the job.
        local_rank: rank on this host (picks the GPU).
        local_world_size: processes on this host.
        device: ``cuda:<local_rank>`` when CUDA is used, else ``cpu``.
        backend: ``"nccl"``, ``"gloo"`` (or another backend of a reused group), or ``"none"`` for a
            single process without a group.
        group: the default process group; ``None`` for a single process (unless a one-process
            group already existed and was reused).
        timeout: collective timeout of the group (also what :meth:`apply_timeout` gives subgroups).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None
    timeout: datetime.timedelta = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise InputError(
                f"rank {self.rank} is outside [0, world_size={self.world_size}); check RANK and WORLD_SIZE"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise InputError(
                f"local rank {self.local_rank} is outside [0, local_world_size={self.local_world_size}); "
                "check LOCAL_RANK and LOCAL_WORLD_SIZE"
            )

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0 (logging, saving, progress bars)."""
        return self.rank == 0

    @property
    def is_last_process(self) -> bool:
        """True on the last global rank."""
        return self.rank == self.world_size - 1

    @property
    def is_distributed(self) -> bool:
        """True with more than one process (collectives must then be called on every rank)."""
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait for every rank; a no-op for a single process."""
        if self.group is None:
            return
        if self.device.type == "cuda" and self.backend == "nccl":
            dist.barrier(group=self.group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.group)

    def apply_timeout(self, *groups: dist.ProcessGroup) -> None:
        """Give subgroups this context's timeout.

        Note: ``dist.new_group`` and ``init_device_mesh`` create groups with torch's default timeout
        (30 min), not the default group's; call this on every subgroup you create.

        Args:
            *groups: process groups this rank belongs to.
        """
        for group in groups:
            if group is not None:
                group.set_timeout(self.timeout)


# ---------------------------------------------------------------------------------------------
# Set-up and tear-down
# ---------------------------------------------------------------------------------------------


def _env_int(name: str, default: int | None = None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"environment variable {name}={raw!r} must be an integer") from None


def _timeout_error(source: str, value: object, example: str) -> InputError:
    return InputError(
        f"{source}={value!r} is not a usable timeout: it must be a positive, finite number of seconds, at most "
        f"{MAX_TIMEOUT_S:.0f} (a week); e.g. {example}"
    )


def _resolve_timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    """The collective timeout from ``timeout`` or ``$HF_PIPELINE_TIMEOUT``: in (0, MAX_TIMEOUT_S] seconds.

    ``nan``, ``inf``, ``1e30`` or a negative value would otherwise pass ``float()`` and fail later
    (timedelta overflow, a group that never times out, or one that times out at once).
    """
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None or raw.strip() == "":
            return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
        source, value, example = TIMEOUT_ENV, raw, f"{TIMEOUT_ENV}=600"
        try:
            seconds = float(raw)
        except ValueError:
            raise _timeout_error(source, value, example) from None
    else:
        source, value, example = "timeout", timeout, "timeout=300"
        if isinstance(timeout, datetime.timedelta):
            seconds = timeout.total_seconds()
        elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            seconds = float(timeout)
        else:
            raise _timeout_error(source, value, example)
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise _timeout_error(source, value, example)
    return datetime.timedelta(seconds=seconds)


def _apply_threads() -> None:
    threads = _env_int(THREADS_ENV)
    if threads is None:
        return
    if threads < 1:
        raise InputError(f"{THREADS_ENV}={threads} must be >= 1")
    torch.set_num_threads(threads)


def _resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` if CUDA is wanted and available, else cpu; an explicit index is kept."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device={str(device)!r} was asked for but CUDA is not available; pass device='cpu'")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        count = torch.cuda.device_count()
        if device.index >= count:
            raise InputError(
                f"local rank {local_rank} wants {device} but this host has {count} GPU(s); launch at most {count} "
                "processes per host (torchrun --nproc-per-node) or set LOCAL_RANK correctly"
            )
    elif device.type != "cpu":
        raise InputError(f"device {str(device)!r} is not supported; use 'cpu', 'cuda' or 'cuda:<index>'")
    return device


def init_distributed(
    *, device: str | torch.device | None = None, timeout: float | datetime.timedelta | None = None
) -> RankContext:
    """Join (or create) the process group this job runs in and return the rank context.

    Args:
        device: ``None`` picks ``cuda:<LOCAL_RANK>`` when CUDA is available, else cpu; ``"cpu"``
            forces CPU (gloo); ``"cuda"`` or ``"cuda:<i>"`` forces CUDA.
        timeout: collective timeout in seconds or as a timedelta; default ``$HF_PIPELINE_TIMEOUT``
            or 300 s. Ignored when an existing group is reused (its own timeout stays).

    Returns:
        The :class:`RankContext`, also cached for :func:`get_rank_context`.

    Example:
        >>> ctx = init_distributed(device="cpu")     # under torchrun --nproc-per-node 2
        >>> ctx.rank, ctx.world_size, ctx.backend     # (1, 2, 'gloo') on the second process
    """
    global _CONTEXT, _OWNS_GROUP
    _apply_threads()
    resolved_timeout = _resolve_timeout(timeout)
    register_exit_handler(destroy_distributed)

    if dist.is_available() and dist.is_initialized():
        # Someone (accelerate, the user, an earlier call) already made the group: join it as it is.
        ctx = _join_existing_group(device, resolved_timeout)
    else:
        world_size = _env_int("WORLD_SIZE", 1)
        if world_size < 1:
            raise InputError(f"WORLD_SIZE={world_size} must be >= 1")
        if world_size == 1:
            ctx = _single_process(device, resolved_timeout)
        else:
            ctx = _create_group(world_size, device, resolved_timeout)
            _OWNS_GROUP = True
    _CONTEXT = ctx
    return ctx


def _join_existing_group(device: str | torch.device | None, timeout: datetime.timedelta) -> RankContext:
    """The context of a default group made before us (by accelerate, the user or an earlier call)."""
    group = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    local_rank = _env_int("LOCAL_RANK", rank % local_world_size)
    backend = str(dist.get_backend(group))
    if device is None and "nccl" not in backend:
        device = "cpu"  # a gloo-only group cannot move CUDA tensors
    resolved = _resolve_device(device, local_rank)
    if resolved.type == "cpu" and "gloo" not in backend:
        raise InputError(
            f"the existing process group uses backend {backend!r}, which cannot run collectives on CPU tensors; "
            "initialize it with 'gloo' (or 'cpu:gloo,cuda:nccl'), or pass device='cuda'"
        )
    existing = _group_timeout(group)
    return RankContext(
        rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
        device=resolved, backend=backend, group=group, timeout=existing or timeout,
    )


def _single_process(device: str | torch.device | None, timeout: datetime.timedelta) -> RankContext:
    """The context of a job of one process: no group at all."""
    local_rank = _env_int("LOCAL_RANK", 0)  # kept: it still picks the GPU
    return RankContext(
        rank=0, world_size=1, local_rank=local_rank,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", local_rank + 1),
        device=_resolve_device(device, local_rank), backend="none", group=None, timeout=timeout,
    )


def _create_group(world_size: int, device: str | torch.device | None, timeout: datetime.timedelta) -> RankContext:
    """The context of a default group this call creates from the launcher's env (``RANK``, ``MASTER_ADDR``, ...)."""
    rank = _env_int("RANK")
    if rank is None:
        raise InputError(
            f"WORLD_SIZE={world_size} is set but RANK is not; start the script with torchrun or accelerate launch"
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise InputError(
            f"WORLD_SIZE={world_size} is set but {' and '.join(missing)} is not; start the script with torchrun or "
            "accelerate launch, or set MASTER_ADDR/MASTER_PORT to rank 0's address and a free port"
        )
    # LOCAL_RANK is set by every launcher we support; without it assume one host (rank == local rank).
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    local_rank = _env_int("LOCAL_RANK", rank % local_world_size)
    resolved = _resolve_device(device, local_rank)
    store = _rendezvous(rank, world_size, timeout)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)  # all_gather_object on nccl uses the current device
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=resolved
        )
        backend = "nccl"
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        backend = "gloo"
    return RankContext(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
        local_world_size=local_world_size, device=resolved, backend=backend, group=dist.group.WORLD,
        timeout=timeout,
    )


def _rendezvous(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The job's store from the launcher's env (``env://``), within the collective timeout or an error.

    Note (a rendezvous that never ends): torch's ``timeout`` does not bound every wait of the store's
    client. When ``MASTER_PORT`` is held by a program that accepts connections but is not the job's
    store, a client waits for its answer forever (torch 2.13), so rank 0 fails ("address already in
    use") while the other ranks hang. The rendezvous therefore runs in a daemon thread that this
    rank stops waiting for after ``_rendezvous_deadline_s``; the thread stays blocked in the
    socket, which costs nothing and ends with the process.
    """
    where = f"MASTER_ADDR:MASTER_PORT={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    outcome: dict[str, object] = {}

    def connect() -> None:
        try:
            outcome["store"] = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))[0]
        except Exception as e:  # noqa: BLE001 - handed to the waiting thread below
            outcome["error"] = e

    thread = threading.Thread(target=connect, name="hf_pipeline-rendezvous", daemon=True)
    thread.start()
    thread.join(_rendezvous_deadline_s(timeout))
    joining = f"rank {rank} could not join the job's rendezvous at {where} within {timeout.total_seconds():g} s"
    advice = (
        "Check that rank 0 started and reached this point, that every rank has the same MASTER_ADDR and "
        f"MASTER_PORT, and that no other program holds that port ({TIMEOUT_ENV} sets the time allowed)"
    )
    error = outcome.get("error")
    if isinstance(error, Exception):
        text = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        if "EADDRINUSE" in str(error) or "address already in use" in str(error).lower():
            raise InputError(
                f"rank {rank} cannot host the job's rendezvous store: MASTER_PORT={os.environ.get('MASTER_PORT')} "
                "is already in use on this host; pick a free port (MASTER_PORT=<port>, torchrun --master-port) "
                "or stop the program that holds it, on every rank"
            ) from error
        raise InputError(f"{joining}: {text}. {advice}") from error
    if "store" not in outcome:
        raise InputError(
            f"{joining}: the port accepted the connection but never answered as the job's store (another program "
            f"listens there, or rank 0 hangs). {advice}"
        )
    store = outcome["store"]
    store.set_timeout(timeout)  # as init_process_group(init_method=...) does: later waits get the same bound
    return store


def _rendezvous_deadline_s(timeout: datetime.timedelta) -> float:
    """How long a rank waits for its rendezvous: the store's own timeout plus room for it to say so itself
    (a client's connection retries overrun ``timeout`` by a few seconds) -- at most about 2x ``timeout``."""
    seconds = timeout.total_seconds()
    return seconds + min(seconds, 5.0 + 0.5 * seconds)


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout a group was created with (None if its backend does not say)."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group_timeout(group, device)
        except Exception:  # noqa: BLE001 - no backend registered for this device
            continue
    return None


def get_rank_context() -> RankContext:
    """The context the last :func:`init_distributed` call returned, made now (with defaults) if none.

    Returns:
        The cached :class:`RankContext`; a fresh one if its group has been destroyed since.
    """
    global _CONTEXT
    if _CONTEXT is not None and _CONTEXT.group is not None and not dist.is_initialized():
        destroy_distributed()  # the group was destroyed behind our back; the context is stale
    return _CONTEXT if _CONTEXT is not None else init_distributed()


def destroy_distributed() -> None:
    """Destroy the process group if :func:`init_distributed` created it, and clear the cached context.

    A group that existed before (made by accelerate or the user) is left alone. Safe to call twice.
    """
    global _CONTEXT, _OWNS_GROUP
    destroyed = _OWNS_GROUP and dist.is_available() and dist.is_initialized()
    if destroyed:
        dist.destroy_process_group()
    _OWNS_GROUP = False
    _CONTEXT = None
    if destroyed:
        # A destroyed group's worker threads stop only when its last reference goes; references held
        # in reference cycles (a model that went out of scope) go at the next collection. Collect now,
        # while the interpreter can still run what those threads release (see shutdown.py).
        gc.collect()
        settle_threads()

