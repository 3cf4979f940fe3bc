"""The one multi-process harness: run a function on N gloo ranks on this machine, collect results.

``run_distributed(fn, 2, *args)`` spawns two processes with the torchrun environment (free port on
127.0.0.1, GLOO_SOCKET_IFNAME=lo, one thread each), calls ``fn(*args)`` in each and returns the
per-rank return values. A failure on any rank raises with every failed rank's traceback; a rank
that does not finish in ``timeout`` seconds is killed and reported, so a test never hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

__all__ = ["ChildFailed", "free_port", "run_distributed"]

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TESTS = pathlib.Path(__file__).resolve().parent


class ChildFailed(AssertionError):
    """One or more ranks raised or timed out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, env: dict, fn: Callable, args: tuple, kwargs: dict, out: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
        HF_PIPELINE_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
    )
    os.environ.update(env)
    for p in (str(_ROOT), str(_TESTS)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(*args, **kwargs)
        # Plain pickle bytes: tensors go by value, not as shared-memory handles that die with the child.
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put((rank, "error", pickle.dumps((type(e).__name__, str(e), traceback.format_exc(), e if _picklable(e) else None))))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may already be gone
                pass


def _picklable(obj: Any) -> bool:
    try:
        pickle.loads(pickle.dumps(obj))
        return True
    except Exception:  # noqa: BLE001
        return False


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 180, env: dict | None = None,
    return_exceptions: bool = False, **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return results ordered by rank.

    Args:
        fn: a module-level function (it is pickled into spawned processes).
        timeout: seconds for the whole job; ranks still running are killed and reported.
        env: extra environment variables for every rank.
        return_exceptions: return each failed rank's exception (or a ChildFailed describing it)
            in its slot instead of raising; timed-out ranks get a TimeoutError.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, dict(env or {}), fn, args, kwargs, out), daemon=True)
        for r in range(world_size)
    ]
    results: dict[int, tuple[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, payload = out.get(timeout=min(left, 0.5))
                results[rank] = (status, pickle.loads(payload))
            except queue.Empty:
                # a child that died without reporting (SIGKILL, segfault) will never report
                for r, p in enumerate(procs):
                    if r not in results and not p.is_alive() and p.exitcode not in (0, None):
                        try:
                            rank, status, payload = out.get(timeout=1.0)
                            results[rank] = (status, pickle.loads(payload))
                        except queue.Empty:
                            results[r] = ("died", p.exitcode)
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failures = []
    values: list[Any] = []
    for r in range(world_size):
        status, payload = results.get(r, ("timeout", None))
        if status == "ok":
            values.append(payload)
            continue
        if status == "timeout":
            msg = f"rank {r} timed out after {timeout:.0f} s"
            exc: BaseException = TimeoutError(msg)
        elif status == "died":
            msg = f"rank {r} died with exit code {payload}"
            exc = ChildFailed(msg)
        else:
            name, text, tb, original = payload
            msg = f"rank {r} raised {name}: {text}\n{tb}"
            exc = original if original is not None else ChildFailed(msg)
        failures.append(msg)
        values.append(exc)
    if failures and not return_exceptions:
        raise ChildFailed("distributed run failed:\n" + "\n".join(failures))
    return values
