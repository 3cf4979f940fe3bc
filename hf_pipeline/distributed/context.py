"""One rank context: process group and device from the environment, timeouts, and error agreement.

``init_distributed()`` works the same under ``torchrun``, ``accelerate launch --multi_gpu`` (which
starts torchrun) and a plain ``python script.py``: it reuses a default process group that already
exists, else creates one from the launcher's env (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``), else runs as a single process with no group at all. The device
comes from ``LOCAL_RANK`` (never the global rank, which is wrong on every host but the first).

A failure on one rank must become a clear error on every rank instead of a hang in the next
collective: ``collective_errors`` / ``raise_on_any_rank`` agree on failures after a local step,
and ``check_same_on_all_ranks`` catches inputs that differ across ranks before they are used.

Example (``torchrun --nproc-per-node 2 script.py``):
    >>> ctx = init_distributed()
    >>> with collective_errors(ctx, "loading weights", label=f"stage {ctx.rank}"):
    ...     tensors = load_my_stage()          # raises on rank 1 -> RankError on rank 0
    >>> check_same_on_all_ranks(ctx, "input_ids", input_ids)

Environment:
    HF_PIPELINE_TIMEOUT: collective timeout in seconds (default 300, far below torch's 30 min, so a
        dead peer ends the job in minutes).
    HF_PIPELINE_THREADS: if set, ``torch.set_num_threads`` of every rank (tests set 1).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
import itertools
import os
import pickle
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from ..compat import default_store
from ..errors import RankError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ParallelDims",
    "RankContext",
    "RankError",
    "check_same_on_all_ranks",
    "collective_errors",
    "communication_failure",
    "destroy_distributed",
    "get_rank_context",
    "init_distributed",
    "lost_peer_error",
    "raise_on_any_rank",
]

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "HF_PIPELINE_TIMEOUT"
THREADS_ENV = "HF_PIPELINE_THREADS"
_MAX_MESSAGE = 2000  # characters of a remote error message carried to the other ranks
_HASH_ALL_BYTES = 1 << 20  # tensors up to 1 MiB are hashed byte for byte; larger ones get a cheaper checksum
_EDGE_BYTES = 1 << 16  # of a large tensor: hash its first and last 64 KiB plus a sum over all of it
_MAX_SUMMARY = 300  # characters of a value's description in a mismatch message
_MAX_FIELDS = 6  # differing fields named in a mismatch message
_LOST_WAIT_S = 3.0  # after a failed agreement: how long a rank waits for the live peers to say so
_LOST_POLL_S = 0.02
_LOST_PREFIX = "hf_pipeline/agreement"
# Substrings of backend errors that mean "no answer in time" / "the peer went away".
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Socket Timeout", "timeout")
_CLOSED_MARKERS = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused", "recvValue failed", "failed to recv")

_CONTEXT: RankContext | None = None  # the context created last (get_rank_context)
_OWNS_GROUP = False  # True when init_distributed created the default group (destroy_distributed may destroy it)
_AGREEMENTS = itertools.count()  # agreements this process entered: the same sequence on every rank
_EXIT_HOOKED = False  # the exit handler (_settle_at_exit) is registered
_SETTLE_TIMEOUT_S = 2.0  # at exit: the longest wait for the groups' worker threads to go idle


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
            raise ValueError(f"rank {self.rank} is outside [0, world_size={self.world_size}); check RANK and WORLD_SIZE")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
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
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def _resolve_timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None or raw.strip() == "":
            timeout = DEFAULT_TIMEOUT_S
        else:
            try:
                timeout = float(raw)
            except ValueError:
                raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a number of seconds, e.g. {TIMEOUT_ENV}=600") from None
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout.total_seconds()} s; pass e.g. timeout=300")
    return timeout


def _apply_threads() -> None:
    threads = _env_int(THREADS_ENV)
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"{THREADS_ENV}={threads} must be >= 1")
    torch.set_num_threads(threads)


def _resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` if CUDA is wanted and available, else cpu; an explicit index is kept."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} was asked for but CUDA is not available; pass device='cpu'")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(
                f"local rank {local_rank} wants {device} but this host has {count} GPU(s); launch at most {count} "
                "processes per host (torchrun --nproc-per-node) or set LOCAL_RANK correctly"
            )
    elif device.type != "cpu":
        raise ValueError(f"device {str(device)!r} is not supported; use 'cpu', 'cuda' or 'cuda:<index>'")
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
    global _CONTEXT, _OWNS_GROUP, _EXIT_HOOKED
    _apply_threads()
    resolved_timeout = _resolve_timeout(timeout)
    if not _EXIT_HOOKED:
        atexit.register(_settle_at_exit)
        _EXIT_HOOKED = True

    if dist.is_available() and dist.is_initialized():
        # Someone (accelerate, the user, an earlier call) already made the group: join it as it is.
        group = dist.group.WORLD
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
        local_rank = _env_int("LOCAL_RANK", rank % local_world_size)
        backend = str(dist.get_backend(group))
        if device is None and "nccl" not in backend:
            device = "cpu"  # a gloo-only group cannot move CUDA tensors
        resolved = _resolve_device(device, local_rank)
        if resolved.type == "cpu" and "gloo" not in backend:
            raise ValueError(
                f"the existing process group uses backend {backend!r}, which cannot run collectives on CPU tensors; "
                "initialize it with 'gloo' (or 'cpu:gloo,cuda:nccl'), or pass device='cuda'"
            )
        existing = _group_timeout(group)
        ctx = RankContext(
            rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
            device=resolved, backend=backend, group=group, timeout=existing or resolved_timeout,
        )
    else:
        world_size = _env_int("WORLD_SIZE", 1)
        if world_size < 1:
            raise ValueError(f"WORLD_SIZE={world_size} must be >= 1")
        if world_size == 1:
            local_rank = _env_int("LOCAL_RANK", 0)  # kept: it still picks the GPU
            ctx = RankContext(
                rank=0, world_size=1, local_rank=local_rank,
                local_world_size=_env_int("LOCAL_WORLD_SIZE", local_rank + 1),
                device=_resolve_device(device, local_rank), backend="none", group=None, timeout=resolved_timeout,
            )
        else:
            ctx = _create_group(world_size, device, resolved_timeout)
            _OWNS_GROUP = True
    _CONTEXT = ctx
    return ctx


def _create_group(world_size: int, device: str | torch.device | None, timeout: datetime.timedelta) -> RankContext:
    rank = _env_int("RANK")
    if rank is None:
        raise ValueError(f"WORLD_SIZE={world_size} is set but RANK is not; start the script with torchrun or accelerate launch")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={world_size} is set but {' and '.join(missing)} is not; start the script with torchrun or "
            "accelerate launch, or set MASTER_ADDR/MASTER_PORT to rank 0's address and a free port"
        )
    # LOCAL_RANK is set by every launcher we support; without it assume one host (rank == local rank).
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    local_rank = _env_int("LOCAL_RANK", rank % local_world_size)
    resolved = _resolve_device(device, local_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)  # all_gather_object on nccl uses the current device
        dist.init_process_group("nccl", init_method="env://", timeout=timeout, device_id=resolved)
        backend = "nccl"
    else:
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        backend = "gloo"
    return RankContext(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
        local_world_size=local_world_size, device=resolved, backend=backend, group=dist.group.WORLD,
        timeout=timeout,
    )


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout a group was created with (None if its backend does not say)."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 - private API, backend not registered for this device
            continue
    return None


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How the job's ranks form pipelines: ``dp_size`` replicas of a ``pp_size``-rank pipeline.

    Global ranks ``[d * pp_size, (d + 1) * pp_size)`` form pipeline replica ``d``; with one
    replica the pipeline uses the default group (``pp_group`` None) and no mesh is made.

    Attributes:
        pp_size, dp_size: ranks per pipeline, pipeline replicas.
        pp_rank, dp_rank: this rank's place in its pipeline, and its replica.
        pp_group, dp_group: this rank's pipeline group and data-parallel group (None when not needed).
        mesh: the (dp, pp) device mesh with several replicas, else None.
    """

    pp_size: int
    dp_size: int = 1
    pp_rank: int = 0
    dp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    mesh: Any = None

    @classmethod
    def build(cls, ctx: RankContext, pp_size: int) -> "ParallelDims":
        """The dims of ``ctx``'s job for ``pp_size``-rank pipelines (collective with several replicas)."""
        if ctx.world_size % pp_size:
            raise ValueError(
                f"world size {ctx.world_size} is not a multiple of the pipeline size {pp_size} (= num_stages / "
                f"virtual_stages); launch a multiple of {pp_size} processes or change num_stages"
            )
        dp_size = ctx.world_size // pp_size
        if not ctx.is_distributed:
            return cls(pp_size=pp_size)
        if dp_size == 1:
            return cls(pp_size=pp_size, pp_rank=ctx.rank)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ctx.device.type, (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
        # Sub-groups get torch's 30-minute default, not the job's timeout: a dead peer must not hang them.
        ctx.apply_timeout(mesh.get_group("pp"), mesh.get_group("dp"))
        return cls(
            pp_size=pp_size, dp_size=dp_size, pp_rank=mesh.get_local_rank("pp"), dp_rank=mesh.get_local_rank("dp"),
            pp_group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"), mesh=mesh,
        )

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's replica."""
        return pp_rank if self.pp_group is None else dist.get_global_rank(self.pp_group, pp_rank)


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
        # while the interpreter can still run what those threads release (see _settle_at_exit).
        gc.collect()
        _settle_threads()


def _settle_at_exit() -> None:
    """At interpreter exit, before finalization: destroy our group and let its threads go idle.

    A gloo worker thread releases each collective's tensors after the caller's ``wait`` has
    returned, and releasing a tensor Python has seen takes the GIL. If the interpreter is already
    finalizing at that moment (a script that ends right after ``generate``'s final broadcast), the
    thread is killed inside a destructor and the process aborts with "terminate called without an
    active exception". torch cannot wait for this itself while the group may still be referenced,
    so the exit handler waits, with the GIL released, until no other thread of the process runs.
    """
    # After an uncaught exception a peer may be gone, and destroying a group with a dead peer can
    # block on some backends: then only wait for the threads.
    if getattr(sys, "last_value", None) is None:
        try:
            destroy_distributed()
        except Exception:  # exiting: a failed destroy must not hide the program's own result
            pass
    gc.collect()
    _settle_threads()


def _settle_threads(timeout: float = _SETTLE_TIMEOUT_S) -> None:
    """Sleep until no thread of this process but the caller is running or runnable (Linux), at most ``timeout`` s.

    An idle worker sleeps in a wait (state S); one still finishing a collective is running (R).
    Two idle looks in a row, 1 ms apart, count as settled (an event loop waking for a moment is
    not work in flight). Elsewhere: one short sleep.
    """
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        time.sleep(0.05)
        return
    me = str(threading.get_native_id())
    deadline, idle = time.monotonic() + timeout, 0
    while idle < 2 and time.monotonic() < deadline:
        busy = False
        for tid in os.listdir(tasks):
            if tid == me:
                continue
            try:
                with open(f"{tasks}/{tid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
            busy = busy or state == b"R"
        idle = 0 if busy else idle + 1
        time.sleep(0.001)


# ---------------------------------------------------------------------------------------------
# Error agreement
# ---------------------------------------------------------------------------------------------


def _describe(error: BaseException) -> tuple[str, str, str]:
    """(type name, message, innermost frame) of a local exception, small enough to all-gather."""
    message = str(error)
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + f"... ({len(message) - _MAX_MESSAGE} more characters)"
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return type(error).__name__, message, where


def communication_failure(error: BaseException, timeout_s: float) -> str:
    """What a communication error means, in the library's words (the backend's text stays in ``__cause__``).

    Args:
        error: the error a collective or a receive raised.
        timeout_s: the collective timeout, for the message.

    Returns:
        A short reason, e.g. ``"no answer within the collective timeout of 300 s ..."``.
    """
    text = str(error)
    if any(marker in text for marker in _TIMEOUT_MARKERS):
        return (
            f"no answer before the collective timeout {timeout_s:.0f} s ran out: the process hangs, was stopped or is "
            f"far behind (set {TIMEOUT_ENV} to change the timeout)"
        )
    if any(marker in text for marker in _CLOSED_MARKERS):
        return "its connection closed: the process exited, crashed or was killed (out of memory, a signal)"
    return f"communication with it failed ({type(error).__name__})"


def _default_store():
    try:
        return default_store()
    except Exception:  # noqa: BLE001 - no default group / store
        return None


def _silent_peers(ctx: RankContext, group: dist.ProcessGroup, number: int) -> tuple[list[int], str | None]:
    """After a failed agreement: the group's global ranks that did not say they are alive (and a store error).

    Every live rank whose agreement failed writes one key to the rendezvous store (the channel that
    still works when the group does not) and waits up to ``_LOST_WAIT_S`` for the others' keys; the
    ranks whose key never comes are the ones that died, hang or were stopped.
    """
    ranks = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]
    others = [r for r in ranks if r != ctx.rank]
    store = _default_store()
    if store is None:
        return others, "no rendezvous store"
    prefix = f"{_LOST_PREFIX}/{number}"
    try:
        store.set(f"{prefix}/rank{ctx.rank}", b"1")
        seen: set[int] = set()
        deadline = time.monotonic() + _LOST_WAIT_S
        while True:
            seen |= {r for r in others if r not in seen and store.check([f"{prefix}/rank{r}"])}
            if len(seen) == len(others) or time.monotonic() >= deadline:
                return [r for r in others if r not in seen], None
            time.sleep(_LOST_POLL_S)
    except Exception as e:  # noqa: BLE001 - the store's host (rank 0 under env:// init) is gone too
        return ([ranks[0]] if ranks[0] != ctx.rank else others), f"{type(e).__name__}: {str(e)[:200]}"


def _name(rank: int, describe: Callable[[int], str] | None) -> str:
    label = describe(rank) if describe is not None else ""
    return f"rank {rank}" + (f" ({label})" if label else "")


def lost_peer_error(
    ctx: RankContext,
    error: BaseException,
    *,
    what: str,
    group: dist.ProcessGroup | None = None,
    describe: Callable[[int], str] | None = None,
    number: int | None = None,
) -> RankError:
    """The :class:`RankError` for an agreement whose collective failed: which peers stopped answering, and why.

    Call it on every rank whose collective raised (it waits up to a few seconds for the other live
    ranks). The backend's message is not repeated (raise the result ``from error`` to keep it).

    Args:
        ctx: the rank context.
        error: what the collective raised.
        what: the step, for the message ("loading weights").
        group: the group of the collective; default ``ctx.group``.
        describe: global rank -> its role (``"stage 1"``), for the message.
        number: the agreement's number (from the same sequence on every rank); default a fresh one.

    Returns:
        The error (``failures`` maps each silent peer to ``("ConnectionError", ..., its role)``),
        marked so that :func:`hf_pipeline.distributed.faults.step_errors` treats this rank's group as stopped.
    """
    group = group if group is not None else ctx.group
    silent, store_error = _silent_peers(ctx, group, next(_AGREEMENTS) if number is None else number)
    reason = communication_failure(error, ctx.timeout.total_seconds())
    if silent:
        names = ", ".join(_name(r, describe) for r in silent)
        message = f"{names} stopped answering while {what}: {reason}; check its log"
        failures = {r: ("ConnectionError", f"stopped answering while {what}", describe(r) if describe else None) for r in silent}
    else:
        message = f"{_name(ctx.rank, describe)} lost contact with its peers while {what}: {reason}"
        failures = {ctx.rank: ("ConnectionError", message, describe(ctx.rank) if describe else None)}
    if store_error is not None:
        message += (
            f". The rendezvous store is unreachable too ({store_error}): the process hosting it (rank 0, or torchrun's "
            "agent on the first node) has probably died"
        )
    raised = RankError(message, failures=failures)
    raised._hf_pipeline_lost = True
    return raised


def raise_on_any_rank(
    ctx: RankContext,
    error: BaseException | None,
    *,
    what: str,
    label: str | None = None,
    group: dist.ProcessGroup | None = None,
    describe: Callable[[int], str] | None = None,
) -> None:
    """Collective: raise on every rank if the local step just run failed on any rank.

    Every rank of the group must call this, passing the exception it caught (or ``None``). A
    failing rank re-raises its own exception (same type, same traceback; a note names the other
    failing ranks); every other rank raises :class:`RankError` naming the failing rank(s) and
    their messages. With no group this just re-raises ``error`` if there is one.

    Args:
        ctx: the rank context.
        error: the exception this rank caught, or ``None``.
        what: the step, for the message (``"loading weights"`` -> "... failed while loading weights").
        label: this rank's role, shown next to its rank (e.g. ``"stage 2"``).
        group: group to agree in; default ``ctx.group``.
        describe: global rank -> its role, for naming a peer that stopped answering (``label``
            is this rank's when not given).

    Raises:
        BaseException: this rank's own ``error``.
        RankError: another rank failed, or stopped answering (died, hangs, was stopped) before it
            could say.
    """
    group = group if group is not None else ctx.group
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    if label is None and describe is not None:
        label = describe(ctx.rank)
    number = next(_AGREEMENTS)
    mine = (*_describe(error), label) if error is not None else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, mine, group=group)
    except Exception as gather_error:
        lost = lost_peer_error(ctx, gather_error, what=what, group=group, describe=describe, number=number)
        if error is not None:
            error.add_note(f"(the other ranks could not be told: {lost})")
            raise error
        raise lost from gather_error
    # gathered is ordered by rank within the group; messages name global ranks
    failed = {dist.get_global_rank(group, i): item for i, item in enumerate(gathered) if item is not None}
    if not failed:
        return
    failures = {r: (t, m, lab) for r, (t, m, _, lab) in failed.items()}
    lines = [
        f"rank {r}{f' ({lab})' if lab else ''} failed while {what}: {t}: {m}{f' [at {where}]' if where else ''}"
        for r, (t, m, where, lab) in sorted(failed.items())
    ]
    if error is not None:
        others = [line for r, line in zip(sorted(failed), lines) if r != ctx.rank]
        if others:
            error.add_note("other ranks failed too:\n" + "\n".join(others))
        raise error
    message = lines[0] if len(lines) == 1 else f"{len(lines)} ranks failed while {what}:\n" + "\n".join(lines)
    raise RankError(message, failures=failures)


@contextmanager
def collective_errors(
    ctx: RankContext, what: str, *, label: str | None = None, group: dist.ProcessGroup | None = None,
    describe: Callable[[int], str] | None = None,
) -> Iterator[None]:
    """Run a local step on every rank; if it raises on any rank, raise on all (see :func:`raise_on_any_rank`).

    Note: the block must not itself run collectives that a failing rank would skip — a rank that
    raised early and reached the agreement would otherwise wait for peers stuck in the skipped
    collective until the timeout.

    Args:
        ctx: the rank context.
        what: the step, for the message.
        label: this rank's role, for the message (e.g. ``"stage 1"``).
        group: group to agree in; default ``ctx.group``.
        describe: global rank -> its role, for the messages (see :func:`raise_on_any_rank`).

    Example:
        >>> with collective_errors(ctx, "loading weights"):
        ...     tensors, report = load_tensors(index, wanted, device=ctx.device)
    """
    error: Exception | None = None
    try:
        yield
    except Exception as caught:  # KeyboardInterrupt/SystemExit propagate: launchers stop every rank for those
        error = caught
    raise_on_any_rank(ctx, error, what=what, label=label, group=group, describe=describe)


def _tensor_fingerprint(t: torch.Tensor) -> tuple[str, str]:
    """(digest, summary) of a tensor: shape, dtype and a checksum of its bytes."""
    head = f"Tensor(shape={tuple(t.shape)}, dtype={t.dtype}"
    if t.is_meta or t.layout != torch.strided or t.is_quantized:
        return f"{head},{t.layout}", head + ")"
    flat = t.detach().contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    h = hashlib.blake2b(digest_size=8)
    if nbytes <= _HASH_ALL_BYTES:
        h.update(raw.cpu().numpy().tobytes())
    else:
        # Large: hash both ends exactly and sum every byte on the tensor's own device (no full copy).
        h.update(raw[:_EDGE_BYTES].cpu().numpy().tobytes())
        h.update(raw[-_EDGE_BYTES:].cpu().numpy().tobytes())
        words = raw.view(torch.int64) if nbytes % 8 == 0 else raw
        h.update(str(int(words.sum(dtype=torch.int64))).encode())
    checksum = h.hexdigest()
    return f"{head},{checksum}", f"{head}, checksum={checksum[:8]})"


def fingerprint(value: Any) -> tuple[str, str]:
    """(digest material, readable summary) of a value; recursive over containers."""
    if isinstance(value, torch.Tensor):
        return _tensor_fingerprint(value)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.Size)):
        r = repr(value)
        return r, r if len(r) <= 60 else r[:57] + "..."
    if isinstance(value, torch.device):
        return repr(value), str(value)
    if isinstance(value, Mapping):
        items = [(repr(k), fingerprint(v)) for k, v in value.items()]
        items.sort(key=lambda kv: kv[0])
        return (
            "{" + ",".join(f"{k}:{d}" for k, (d, _) in items) + "}",
            "{" + ", ".join(f"{k}: {s}" for k, (_, s) in items) + "}",
        )
    if isinstance(value, (list, tuple)):
        parts = [fingerprint(v) for v in value]
        open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        return open_ + ",".join(d for d, _ in parts) + close, open_ + ", ".join(s for _, s in parts) + close
    if is_dataclass(value) and not isinstance(value, type):
        return fingerprint({f.name: getattr(value, f.name) for f in fields(value)})
    try:  # any other picklable object: compare its pickle (repr may contain per-process addresses)
        digest = hashlib.blake2b(pickle.dumps(value), digest_size=8).hexdigest()
    except Exception:  # noqa: BLE001 - unpicklable: compare the type only
        digest = "unpicklable"
    name = type(value).__qualname__
    return f"{name}:{digest}", f"{name}(#{digest[:8]})"


def _fields(value: Any, prefix: str = "", depth: int = 2) -> dict[str, Any]:
    """The named parts of ``value`` to tell apart in a mismatch message: mapping keys and dataclass
    fields, ``depth`` levels deep (``config.rope_scaling``); anything else is one unnamed part."""
    if depth and is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if not depth or not isinstance(value, Mapping):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(_fields(v, f"{prefix}.{k}" if prefix else str(k), depth - 1))
    return out


def _short(summary: str, limit: int) -> str:
    return summary if len(summary) <= limit else summary[: limit - 3] + "..."


def _variants(values: list[tuple[int, str, str]]) -> str:
    """``rank 0: a; ranks 1, 2: b`` from (rank, digest, summary), grouped by digest in rank order."""
    by_digest: dict[str, list[int]] = {}
    summaries: dict[str, str] = {}
    for rank, d, summary in values:
        by_digest.setdefault(d, []).append(rank)
        summaries[d] = summary
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {summaries[d]}"
        for d, ranks in sorted(by_digest.items(), key=lambda item: item[1][0])
    )


def check_same_on_all_ranks(
    ctx: RankContext,
    name: str,
    value: Any,
    *,
    group: dist.ProcessGroup | None = None,
    describe: Callable[[int], str] | None = None,
    hint: str | None = None,
) -> None:
    """Collective: raise on every rank if ``value`` is not the same on all of them.

    Compares one cheap digest (structure; for tensors shape, dtype and a checksum of the bytes; for
    other leaves their repr or pickle), not the full values: a mismatch is always reported,
    equality is overwhelmingly likely but not proven for tensors over 1 MiB. Only when the digests
    differ is a second, larger exchange made, to name what differs: for a mapping or a dataclass
    the keys (two levels deep, ``config.hidden_size``) whose values differ, and which ranks hold
    which value. A no-op without a group.

    Args:
        ctx: the rank context.
        name: what the value is, for the message (e.g. ``"input_ids"``).
        value: a tensor, number, string, or a dict/list/tuple/dataclass of those.
        group: group that must agree; default ``ctx.group``.
        describe: global rank -> its role, for naming a peer that stopped answering.
        hint: what to do, for the message (default: pass the same inputs and seed everywhere).

    Raises:
        ValueError: on every rank, naming ``name``, the differing keys and which ranks hold which value.
        RankError: a peer stopped answering (died, hangs, was stopped) during the exchange.

    Example:
        >>> check_same_on_all_ranks(ctx, "input_ids", input_ids)
    """
    group = group if group is not None else ctx.group
    if group is None or dist.get_world_size(group) == 1:
        return
    number = next(_AGREEMENTS)
    digest_material, summary = fingerprint(value)
    digest = hashlib.blake2b(digest_material.encode(), digest_size=16).hexdigest()
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    try:
        dist.all_gather_object(gathered, digest, group=group)
        if len(set(gathered)) == 1:
            return
        # They differ (every rank sees it): exchange the parts, to say which differ.
        parts = {}
        for path, part in _fields(value).items():
            material, part_summary = fingerprint(part)
            parts[path] = (hashlib.blake2b(material.encode(), digest_size=8).hexdigest(), _short(part_summary, 160))
        details: list[Any] = [None] * world
        dist.all_gather_object(details, (_short(summary, _MAX_SUMMARY), parts), group=group)
    except Exception as e:
        raise lost_peer_error(ctx, e, what=f"comparing {name} across ranks", group=group, describe=describe, number=number) from e
    ranks = [dist.get_global_rank(group, i) for i in range(world)]
    hint = hint or f"Pass the same {name} on every rank (same inputs and seed everywhere, or broadcast them from rank 0)"
    paths = list(dict.fromkeys(path for _, p in details for path in p))
    differing = [
        path for path in paths
        if len({p.get(path, ("<absent>", ""))[0] for _, p in details}) > 1
    ]
    if differing == [""] or not differing:
        variants = _variants([(r, d, summ) for r, d, (summ, _) in zip(ranks, gathered, details)])
        raise ValueError(f"{name} must be the same on every rank but differs: {variants}. {hint}")
    shown = differing[:_MAX_FIELDS]
    per_field = " | ".join(
        f"{path}: " + _variants([(r, *p.get(path, ("<absent>", "(not given)"))) for r, (_, p) in zip(ranks, details)])
        for path in shown
    )
    more = f" (and {len(differing) - len(shown)} more)" if len(differing) > len(shown) else ""
    which = shown[0] if len(differing) == 1 else ", ".join(shown[:-1]) + (" and " if not more else ", ") + shown[-1] + more
    raise ValueError(
        f"{name} must be the same on every rank but {which} differ{'s' if len(differing) == 1 else ''}: {per_field}. {hint}"
    )
