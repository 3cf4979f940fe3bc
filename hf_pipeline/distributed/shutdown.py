"""A clean interpreter exit: destroy our process group and let its worker threads go idle first.

A gloo worker thread releases each collective's tensors after the caller's ``wait`` has
returned, and releasing a tensor Python has seen takes the GIL. If the interpreter is already
finalizing at that moment (a script that ends right after ``generate``'s final broadcast), the
thread is killed inside a destructor and the process aborts with "terminate called without an
active exception". torch cannot wait for this itself while the group may still be referenced,
so the exit handler waits, with the GIL released, until no other thread of the process runs.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
from typing import Callable

__all__ = ["register_exit_handler", "settle_threads"]

_SETTLE_TIMEOUT_S = 2.0  # at exit: the longest wait for the groups' worker threads to go idle
_EXIT_HOOKED = False  # the exit handler (_settle_at_exit) is registered


def register_exit_handler(destroy_group: Callable[[], None]) -> None:
    """Register, once per process, the handler that settles the process at interpreter exit.

    Args:
        destroy_group: destroys the process group if this library made it (``destroy_distributed``).
    """
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_settle_at_exit, destroy_group)
        _EXIT_HOOKED = True


def _settle_at_exit(destroy_group: Callable[[], None]) -> None:
    """At interpreter exit, before finalization: destroy our group and let its threads go idle (see the module)."""
    # After an uncaught exception a peer may be gone, and destroying a group with a dead peer can
    # block on some backends: then only wait for the threads.
    if getattr(sys, "last_value", None) is None:
        try:
            destroy_group()
        except Exception:  # exiting: a failed destroy must not hide the program's own result
            pass
    gc.collect()
    settle_threads()


def settle_threads(timeout: float = _SETTLE_TIMEOUT_S) -> None:
    """Sleep until no thread of this process but the caller is running or runnable (Linux), at most ``timeout`` s.

    An idle worker sleeps in a wait (state S); one still finishing a collective is running (R).
    Two idle looks in a row, 1 ms apart, count as settled (an event loop waking for a moment is
    not work in flight). Elsewhere: one short sleep.

    Args:
        timeout: the longest wait, in seconds.
    """
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        time.sleep(0.05)
        return
    caller = str(threading.get_native_id())
    deadline, idle = time.monotonic() + timeout, 0
    while idle < 2 and time.monotonic() < deadline:
        busy = False
        for tid in os.listdir(tasks):
            if tid == caller:
                continue
            try:
                with open(f"{tasks}/{tid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
            busy = busy or state == b"R"
        idle = 0 if busy else idle + 1
        time.sleep(0.001)
