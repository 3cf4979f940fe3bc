"""Writing files that survive a crash, and a full disk reported by name.

A checkpoint is only as safe as its files: every file a save stages is flushed to disk
(:func:`fsync`) before it is renamed into place, since a rename is durable only once both the file
and its directory are. A disk that fills up while writing shows as a dozen different errors
(``OSError`` ENOSPC, safetensors' ``os error 28``, torch.save's short write); :func:`reporting_full_disk`
turns each into one ``OSError`` (ENOSPC) that names the file and the disk, with its free space.

:func:`replace_file` replaces one small file whole; the benchmark's README and results and the
device check's JSON are written with it too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Iterator

import torch

__all__ = ["fsync", "replace_file", "reporting_full_disk", "save_torch", "write_json"]

# How a full disk (or quota) shows: OSError ENOSPC/EDQUOT, safetensors' "... (os error 28)", and
# torch.save's short write "[enforce fail at inline_container.cc] unexpected pos".
_DISK_FULL = ("No space left on device", "os error 28", "StorageFull", "Disk quota exceeded", "unexpected pos")


def fsync(path: pathlib.Path) -> None:
    """Flush a file's data (or a directory's entries) to disk: a rename is durable only after both."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _disk_of(path: pathlib.Path) -> str:
    """``the disk mounted at /x (tmpfs, tmpfs, 2.0 KiB free of 64.0 KiB)``: the filesystem holding ``path``."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    device = ""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[1] == str(mount):
                device = f"{fields[0]}, {fields[2]}, "  # the last entry wins: it is the one mounted on top
    try:
        usage = shutil.disk_usage(p)
        space = f"{_human(usage.free)} free of {_human(usage.total)}"
    except OSError:
        space = "free space unknown"
    return f"the disk mounted at {mount} ({device}{space})"


@contextlib.contextmanager
def reporting_full_disk(path: pathlib.Path) -> Iterator[None]:
    """Turn a full disk while writing ``path`` into an ``OSError`` (ENOSPC) that names the disk and the file."""
    try:
        yield
    except Exception as e:
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if not (full or any(s in str(e) for s in _DISK_FULL)):
            raise
        # An OSError, as the write raised it (no library class has that base): callers test its errno.
        error = OSError(
            f"No space left on device: writing {path} failed on {_disk_of(path)}; free space there or save to "
            "another disk"
        )
        error.errno = errno.ENOSPC
        raise error from e


def replace_file(path: str | os.PathLike, text: str) -> None:
    """Replace the file ``path`` with ``text`` all at once: a process stopped while writing leaves the
    old file or the new one, never part of one.

    The text goes to a temporary file of its own beside ``path`` (unique per call, so two threads
    writing the same file never share one: with a shared name, one writer's rename can publish the
    file the other has just truncated), renamed over ``path`` once complete and removed if the write
    fails. A full disk is an ``OSError`` naming the disk.

    Args:
        path: the file to replace (its directory must exist).
        text: its new contents.
    """
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with reporting_full_disk(path), os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def save_torch(obj: Any, path: pathlib.Path) -> None:
    """``torch.save`` of ``obj`` to ``path``, flushed to disk."""
    with reporting_full_disk(path):
        torch.save(obj, path)
        fsync(path)


def write_json(path: pathlib.Path, data: Any) -> None:
    """``data`` as indented, key-sorted JSON in ``path``, flushed to disk."""
    with reporting_full_disk(path):
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        fsync(path)
