"""This process's resident memory and its high-water mark, the figures the benchmark and the device check report.

Read from Linux's ``/proc/self/status`` (psutil / ``getrusage`` elsewhere). The high-water mark is reset
through ``/proc/self/clear_refs`` before a measured load, and the memory glibc keeps after frees can be
given back first, so a later peak counts every byte it touches.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import resource

__all__ = ["host_peak_rss", "host_rss", "reset_host_peak", "trim_host_heap"]


def _status_bytes(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", pathlib.Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def host_rss() -> int:
    """Bytes of this process's resident memory now."""
    found = _status_bytes("VmRSS")
    if found is not None:
        return found
    import psutil

    return psutil.Process().memory_info().rss


def host_peak_rss() -> int:
    """Bytes of this process's resident-memory high-water mark (since the last :func:`reset_host_peak`)."""
    found = _status_bytes("VmHWM")
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_host_peak() -> bool:
    """Reset the high-water mark to the current RSS (Linux: ``5`` to ``clear_refs``); False where that is impossible."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def trim_host_heap() -> None:
    """Give memory glibc keeps after frees back to the OS, so a later peak counts every byte it touches."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
