"""The one multi-process harness: run a function on N gloo ranks on this machine, collect results.

``run_distributed(fn, 2, *args)`` spawns two processes with the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, a free port on 127.0.0.1, GLOO_SOCKET_IFNAME=lo, one
thread each), calls ``fn(*args)`` in each and returns the per-rank return values. A failure on any
rank raises :class:`ChildFailed` with every failed rank's traceback; a rank that does not finish
in ``timeout`` seconds is killed (SIGKILL) and reported, so a test never hangs.

``timeout`` counts from the moment every rank is up (spawned, torch imported, ``fn`` unpickled), so
a loaded machine's slow start-up does not eat it; start-up has its own allowance,
:data:`STARTUP_TIMEOUT_S`. :func:`last_run_timing` says how long the latest run's start-up and
run took, for tests that bound a run's duration without counting start-up.

``fn`` must be a module-level function (it is pickled by name into the ranks); the tests
directory and the repository root are on ``sys.path`` in every child, so test modules import.

The ranks are forked from one server process (multiprocessing's ``forkserver``) that imported torch,
transformers and hf_pipeline once, when the first run started: a fresh interpreter per rank spent
about 5 s of CPU importing them, which over the suite's hundreds of ranks was most of its time on a
2-core machine. Each rank still gets the environment the parent has at the call (plus the rank's
own); a run whose environment differs from the server's in a variable libraries read at import
(``HF_*``, ``TRANSFORMERS_*``, ``TORCH*``, ``OMP_*``, ...) is spawned fresh instead
(:func:`_start_method`), so no test sees a value imported under another environment.

Example:
    >>> def _ranks():
    ...     from hf_pipeline.distributed.context import init_distributed
    ...     return init_distributed().rank
    >>> run_distributed(_ranks, 2)
    [0, 1]
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
import pathlib
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "STARTUP_TIMEOUT_S",
    "ChildFailed",
    "RunTiming",
    "expect_errors",
    "free_port",
    "last_run_timing",
    "run_distributed",
]

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TESTS = pathlib.Path(__file__).resolve().parent
# Spawned children get the parent's sys.path before they unpickle their target (``harness._child``).
for _p in (str(_ROOT), str(_TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

_POLL_S = 0.2  # how often the parent checks for results and dead children
_JOIN_S = 10.0  # time a finished child gets to exit (destroying its process group) before SIGKILL
# Spawning, importing torch and unpickling fn (which imports its test module) on every rank, before
# ``timeout`` starts: seconds when idle, ten times that on a busy 2-core machine. Only a rank stuck
# in start-up ever waits this long; one that crashes is seen at once by its exit code.
STARTUP_TIMEOUT_S = 300.0
# What the fork server imports once for every rank (module names; ``tiny`` and ``harness`` live in tests/).
_PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.pipelining", "torch.distributed.tensor", "torch.distributed.fsdp",
    "transformers", "safetensors", "hf_pipeline", "tiny", "harness",
)
# Environment variables read when a library is imported (not when it is called): a rank whose value differs
# from the fork server's must import afresh. hf_pipeline's own (HF_PIPELINE_*) are read at call time.
_IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_", "PYTHON")
# The rank defaults the fork server is started with, so its imports see what every rank has.
_SERVER_DEFAULTS = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
_SERVER_ENV: dict[str, str] | None = None  # the fork server's environment, once it runs
# Set by tests/conftest.py around each test: the node id of a test *not* marked ``dist`` (which must not
# spawn ranks: ``-m unit`` would run it), None otherwise or outside pytest.
SPAWN_GUARD: str | None = None


@dataclass(frozen=True)
class RunTiming:
    """Durations of one :func:`run_distributed` call, measured in the parent.

    ``startup_s``: from spawning the ranks until every rank was up (or until the run ended, if some
    never came up). ``run_s``: from then until the parent had every result or gave up on the rest
    (killing and reaping the children is not counted).
    """

    startup_s: float
    run_s: float


_LAST_RUN: RunTiming | None = None


class ChildFailed(AssertionError):
    """One or more ranks raised, died or timed out; the message has every failed rank's traceback."""


def last_run_timing() -> RunTiming:
    """Start-up and run time of the latest :func:`run_distributed` (or :func:`expect_errors`) call.

    Returns:
        Its :class:`RunTiming`.

    Example:
        >>> run_distributed(_ranks, 2)
        >>> assert last_run_timing().run_s < 10  # however long spawning and importing took
    """
    if _LAST_RUN is None:
        raise RuntimeError("last_run_timing() needs a run_distributed call first")
    return _LAST_RUN


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released).

    Returns:
        The port number.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world_size: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "HF_PIPELINE_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.update(extra)
    return env


def _import_time_changes(env: dict[str, str], server: dict[str, str]) -> list[str]:
    """Variables libraries read at import whose value in ``env`` is not the fork server's ``server``."""
    names = set(env) | set(server)
    return sorted(
        n for n in names
        if n.startswith(_IMPORT_TIME_ENV) and not n.startswith("HF_PIPELINE_") and env.get(n) != server.get(n)
    )


def _start_method(env: dict[str, str]) -> str:
    """``"forkserver"`` (ranks forked from the server that imported the libraries once), or ``"spawn"``
    when ``env`` changes a variable read at import (see :data:`_IMPORT_TIME_ENV`)."""
    global _SERVER_ENV
    if _SERVER_ENV is None:
        server = {**os.environ, **_SERVER_DEFAULTS}
        saved = dict(os.environ)
        os.environ.update(server)  # the server inherits the environment it is started in
        try:
            mp.set_forkserver_preload(list(_PRELOAD))
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _SERVER_ENV = server
    return "spawn" if _import_time_changes(env, _SERVER_ENV) else "forkserver"


def _child(rank: int, env: dict[str, str], payload: bytes, out: Any, release: Any) -> None:
    """Body of one rank: set the env, unpickle and run ``fn``, report back, destroy the group."""
    # The whole environment, as a spawned child inherits it: a forked one has the server's from its start.
    os.environ.clear()
    os.environ.update(env)  # before fn is unpickled: importing its module may read the env
    try:
        import torch

        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(payload)
        out.put((rank, "up", b""))  # start-up is over: the parent's ``timeout`` clock starts when all are up
        result = fn(*args, **kwargs)
        # Plain pickle bytes: tensors go by value, not as shared-memory handles that die with the child.
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
        original = e if _round_trips(e) else None
        out.put((rank, "error", pickle.dumps((type(e).__name__, str(e), traceback.format_exc(), original))))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may already be gone
                pass
        # Then stay up until every rank has reported or the parent gave up: rank 0 hosts the rendezvous
        # store, and a rank that left at once would take it from peers still naming who failed. (A forked
        # rank exits in no time; a spawned one used to linger in interpreter teardown, which hid this.)
        release.wait(STARTUP_TIMEOUT_S)


def _round_trips(obj: Any) -> bool:
    try:
        pickle.loads(pickle.dumps(obj))
        return True
    except Exception:  # noqa: BLE001 - some exceptions pickle but cannot be rebuilt
        return False


def _failure(rank: int, status: str, payload: Any, timeout: float, grace: float, first_failed: int | None):
    """(message for ChildFailed, exception for return_exceptions) of one failed rank."""
    if status == "timeout":
        msg = f"rank {rank} timed out after {timeout:g} s (killed)"
        return msg, TimeoutError(msg)
    if status == "startup":
        msg = (
            f"rank {rank} did not start within {STARTUP_TIMEOUT_S:g} s "
            "(killed; spawning, importing torch or unpickling fn hung)"
        )
        return msg, TimeoutError(msg)
    if status == "stuck":
        msg = (
            f"rank {rank} was still running {grace:g} s after rank {first_failed} failed (killed; probably "
            "blocked in a collective the failed rank never reached)"
        )
        return msg, TimeoutError(msg)
    if status == "died":
        msg = f"rank {rank} died with exit code {payload} without reporting a result"
        return msg, ChildFailed(msg)
    name, text, tb, original = payload
    msg = f"rank {rank} raised {name}: {text}\n{tb}"
    if original is None:
        return msg, ChildFailed(msg)
    original.remote_traceback = tb  # the child's traceback does not survive pickling
    original.add_note(f"traceback on rank {rank}:\n{tb}")
    return msg, original


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    return_exceptions: bool = False,
    failure_grace: float = 30,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return the results ordered by rank.

    Args:
        fn: a module-level function (pickled by name); its return value must pickle (tensors do).
        world_size: number of ranks.
        *args, **kwargs: passed to ``fn`` on every rank.
        timeout: seconds from every rank being up (start-up is not counted, see
            :data:`STARTUP_TIMEOUT_S`); ranks still running then are killed and reported.
        env: extra environment variables for every rank (override the defaults).
        return_exceptions: put each failed rank's exception in its slot instead of raising: the
            original exception (with ``.remote_traceback``) when it pickles, ``TimeoutError`` for a
            killed rank, else :class:`ChildFailed`.
        failure_grace: once a rank failed, seconds the others get to finish before they are
            killed (a peer blocked on the failed rank would otherwise hold the test to ``timeout``).

    Returns:
        One entry per rank: ``fn``'s return value (or, with ``return_exceptions``, the exception).

    Raises:
        ChildFailed: some rank raised, died or timed out (and ``return_exceptions`` is False).
        TypeError: ``fn`` or its arguments cannot be pickled (e.g. a lambda or a local function).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if SPAWN_GUARD is not None:
        raise AssertionError(f"{SPAWN_GUARD} starts ranks: mark it @pytest.mark.dist (tests/conftest.py, tiers)")
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001 - turned into a message that says what to change
        raise TypeError(f"run_distributed needs a module-level fn and picklable arguments: {e}") from e
    port = free_port()
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    envs = [{**os.environ, **_rank_env(r, world_size, port, extra)} for r in range(world_size)]
    ctx = mp.get_context(_start_method(envs[0]))
    out, release = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, envs[r], payload, out, release),
            name=f"rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    global _LAST_RUN
    results: dict[int, tuple[str, Any]] = {}
    up: set[int] = set()
    first_failed: int | None = None
    spawned = time.monotonic()
    ready: float | None = None  # when every rank was up
    try:
        for p in procs:
            p.start()
        deadline = spawned + STARTUP_TIMEOUT_S  # until every rank is up; then ``timeout`` from that moment
        while len(results) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, raw = out.get(timeout=min(deadline - now, _POLL_S))
                if status == "up":
                    up.add(rank)
                    if len(up) == world_size:
                        ready = time.monotonic()
                        deadline = min(deadline, ready + timeout) if first_failed is not None else ready + timeout
                    continue
                results[rank] = (status, pickle.loads(raw))
            except queue.Empty:
                # A child that exited without reporting (SIGKILL, segfault, os._exit) never will;
                # anything it did put is read first, on the next loop turn, while it is still queued.
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None and out.empty():
                        results[r] = ("died", p.exitcode)
            failed = [r for r, (status, _) in results.items() if status != "ok"]
            if failed and first_failed is None:
                first_failed = min(failed)
                deadline = min(deadline, time.monotonic() + failure_grace)
    finally:
        ended = time.monotonic()
        release.set()  # every rank reported (or never will): they may leave
        started = ready if ready is not None else ended
        _LAST_RUN = RunTiming(startup_s=started - spawned, run_s=ended - started)
        # Always reap: finished children get time to exit, the rest (or all, on Ctrl-C) are killed.
        for r, p in enumerate(procs):
            if p.pid is None:
                continue
            p.join(timeout=_JOIN_S if r in results else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
    messages: list[str] = []
    values: list[Any] = []
    for r in range(world_size):
        status, value = results.get(
            r, ("stuck" if first_failed is not None else "timeout" if r in up else "startup", None)
        )
        if status == "ok":
            values.append(value)
            continue
        msg, exc = _failure(r, status, value, timeout, failure_grace, first_failed)
        messages.append(msg)
        values.append(exc)
    if messages and not return_exceptions:
        raise ChildFailed(f"distributed run on {world_size} ranks failed:\n" + "\n".join(messages))
    return values


def expect_errors(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60, **kwargs: Any
) -> list[BaseException | None]:
    """Run ``fn`` like :func:`run_distributed` and return each rank's exception, ``None`` where it returned.

    For bad-input tests: assert that every rank raised, and with which message.

    Args:
        fn, world_size, *args, **kwargs: as for :func:`run_distributed` (``env`` and
            ``failure_grace`` included).
        timeout: seconds from every rank being up, as for :func:`run_distributed`.

    Returns:
        Per rank, the exception it raised (``TimeoutError`` if killed) or ``None``.
    """
    values = run_distributed(fn, world_size, *args, timeout=timeout, return_exceptions=True, **kwargs)
    return [v if isinstance(v, BaseException) else None for v in values]
