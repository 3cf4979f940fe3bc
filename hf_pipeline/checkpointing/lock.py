"""One save at a time into a checkpoint directory, and only inside it.

Two jobs saving into one directory at once would each publish the other's half-moved files and
remove the other's staging directory as a killed save's leftover. So rank 0 of a save holds
``<dir>/.hf_pipeline.lock`` while it stages and publishes: the lock names the holder (host, pid,
the pid's start time, boot and pid namespace) and its save id, and is removed when the save ends,
whether it succeeded or failed. A second save meanwhile is refused and names the holder.

Note: a lock is never seen half-written. Its text goes to a file of the save's own
(``.hf_pipeline.lock.<save id>``), which is then hard-linked to the lock's name: the link is
atomic and fails when a lock exists (also on NFS). A writer that dies on the way (a full disk
while writing, SIGKILL) leaves no lock, only its own file, which the next save removes. On a
filesystem without hard links the lock is created with ``O_EXCL`` and written in place, and
removed again when writing it fails.

A lock whose holder cannot be alive is taken over with a warning naming it and why: one that names
no holder (empty, truncated, not the JSON a save writes: a writer of an earlier version killed or
out of disk space between creating and writing it), or whose holder is a process of this host
(same boot, same pid namespace) that no longer runs, or whose pid now belongs to another process
(another start time). A lock of another host cannot be checked from here: it is refused, and the
error names the lock's full path and the host and pid in it, and says to delete that file once no
save runs there. An unreadable lock (another user's) is refused.

A save writes only inside its directory: an ``optimizer/`` or ``rng/`` there that is a symbolic
link (or any other path the save writes through) would send the files elsewhere, so it is refused
before anything is written (:func:`check_inside`); the link and what it points to are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import re
import socket
from typing import Iterable

from ..errors import CheckpointExistsError
from ..log import get_logger
from .durable import reporting_full_disk

__all__ = ["LOCK_NAME", "acquire_save_lock", "check_inside", "release_save_lock"]

logger = get_logger(__name__)

LOCK_NAME = ".hf_pipeline.lock"
# A save's own file for writing its lock, and a taken-over lock moved aside: leftovers when killed.
_OWN_FILES = re.compile(re.escape(LOCK_NAME) + r"\.(stale-)?[0-9a-f]{12}")
# link() errors that mean "no hard links on this filesystem" (FAT, some FUSE and SMB mounts).
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK}


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks after boot; Linux), which tells a reused pid from the holder."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None  # field 22 of proc(5)


def _here() -> dict:
    """Where a pid means this process table: the host, and (Linux) the boot and the pid namespace."""
    out: dict = {"host": socket.gethostname()}
    with contextlib.suppress(OSError):
        out["boot"] = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        out["pidns"] = os.readlink("/proc/self/ns/pid")  # containers sharing the host's name have their own
    return out


def _holder(token: str) -> dict:
    return {**_here(), "pid": os.getpid(), "started": _started(os.getpid()), "save": token}


def _names_holder(data: object) -> bool:
    """True for the JSON a save writes: a host name and a pid (an int above 0: 0 and -1 would name groups)."""
    if not isinstance(data, dict):
        return False
    pid = data.get("pid")
    return isinstance(data.get("host"), str) and type(pid) is int and pid > 0


def _elsewhere(data: dict) -> str | None:
    """Why the pid a lock names (``data``) cannot be checked from here, or None when it is a pid of this table."""
    here = _here()
    if data.get("host") != here["host"]:
        return f"that is not this host ({here['host']})"
    if "boot" in data and data["boot"] != here.get("boot"):
        return "its boot id is not this host's (another machine of the same name, or this one rebooted)"
    if "pidns" in data and data["pidns"] != here.get("pidns"):
        return "it ran in another pid namespace (another container of this host)"
    return None


def _stale(text: str) -> str | None:
    """Why the lock with ``text`` cannot belong to a running save, or None when it may."""
    if not text.strip():
        return "it is empty (its save died before writing its holder: a full disk, or killed)"
    try:
        data = json.loads(text)
    except ValueError as e:
        return f"it is not complete JSON ({e}: its save died while writing it)"
    if not _names_holder(data):
        return "it names no holder (no host and pid), so no save can be holding it"
    if _elsewhere(data) is not None:
        return None  # another host, boot or pid namespace: its pid cannot be checked from here
    pid = data["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its holder, pid {pid} on this host, no longer runs"
    except PermissionError:
        pass  # alive, another user's
    now = _started(pid)
    if data.get("started") is not None and now is not None and now != data["started"]:
        return f"its holder, pid {pid} on this host, no longer runs (the pid is now another process's)"
    return None


def _read(path: pathlib.Path) -> str | None:
    """The lock's text, or None when there is no lock. OSError: it exists but cannot be read."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None


def _write_holder(fd: int, text: str) -> None:
    """Write the lock's text (a function of its own: tests make it fail or die here)."""
    data = text.encode()
    while data:
        data = data[os.write(fd, data):]


def _create(path: pathlib.Path, token: str) -> bool:
    """Create the lock naming this save, whole or not at all; False when one exists."""
    own = path.with_name(f"{LOCK_NAME}.{token}")
    text = json.dumps(_holder(token)) + "\n"
    with reporting_full_disk(path):
        try:
            fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_holder(fd, text)
            finally:
                os.close(fd)
            try:
                os.link(own, path)
            except FileExistsError:  # a lost NFS reply to a link that was made shows as EEXIST: count the links
                with contextlib.suppress(FileNotFoundError):  # removed by the save holding the lock
                    return os.stat(own).st_nlink == 2
                return False
            except FileNotFoundError:
                return False  # our file was removed by the save that holds the lock: it is not free
            except OSError as e:
                if e.errno not in _NO_LINKS:
                    raise
                return _create_in_place(path, text)
            return True
        finally:
            own.unlink(missing_ok=True)


def _create_in_place(path: pathlib.Path, text: str) -> bool:
    """No hard links here: ``O_EXCL`` and write, removing the lock again when writing it fails."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        try:
            _write_holder(fd, text)
        except BaseException:
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:  # still ours: remove it
                    path.unlink()
            raise
        try:
            return os.stat(path).st_ino == os.fstat(fd).st_ino  # not taken over (as empty) while we wrote it
        except FileNotFoundError:
            return False
    finally:
        os.close(fd)


def _take_over(path: pathlib.Path, text: str, token: str) -> bool:
    """Move a stale lock (as read: ``text``) aside and create ours; False when another save was faster."""
    aside = path.with_name(f"{LOCK_NAME}.stale-{token}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return _create(path, token)
    try:
        moved = _read(aside)
    except OSError:
        moved = None
    if moved != text:  # another save took it over between our read and the rename: put its lock back
        with contextlib.suppress(OSError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return _create(path, token)


def _remove_leftovers(final: pathlib.Path) -> None:
    """The files killed saves left while writing or taking over a lock (this save's own are gone already).

    A save writing its lock right now loses its file: its link then fails, and it finds this save's lock.
    """
    for p in final.iterdir():
        if _OWN_FILES.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def acquire_save_lock(final: pathlib.Path, token: str) -> None:
    """Rank 0: hold ``final``'s save lock for save ``token`` (``final`` exists).

    A stale lock (see the module docstring) is taken over, with a warning naming it and why.

    Raises:
        CheckpointExistsError: another save into ``final`` is running (or its lock cannot be checked).
        OSError: the disk is full (ENOSPC, naming the disk); no lock is left behind.
    """
    path = final / LOCK_NAME
    text = None
    for _ in range(3):
        if _create(path, token):
            _remove_leftovers(final)
            return
        try:
            text = _read(path)
        except OSError as e:
            raise CheckpointExistsError(
                f"another save_pretrained into {final} may be running: its lock {path} cannot be read: {e}. Two "
                "saves into one directory would overwrite each other's files. Save into another directory, or "
                f"once you are sure no save is running there, delete {path}"
            ) from e
        if text is None:
            continue  # released meanwhile
        why = _stale(text)
        if why is None:
            break
        if _take_over(path, text, token):
            logger.warning("took over the save lock %s, which no running save can hold: %s", path, why)
            _remove_leftovers(final)
            return
    raise _refusal(final, path, text)


def _refusal(final: pathlib.Path, path: pathlib.Path, text: str | None) -> CheckpointExistsError:
    """The error for a lock (as read: ``text``) whose holder may be running: it names the lock and its holder.

    A holder of this host is checked alive; one of another host cannot be, so the message says how to
    proceed once the user knows it ended.
    """
    try:
        holder = json.loads(text or "")
    except ValueError:
        holder = {}
    holder = holder if isinstance(holder, dict) else {}
    pid, host, save = (holder.get(k, "?") for k in ("pid", "host", "save"))
    where = _elsewhere(holder) if _names_holder(holder) else None
    if where is not None:
        return CheckpointExistsError(
            f"{path} says a save_pretrained into {final} runs as pid {pid} on host {host} (save {save}), and "
            f"whether it still runs cannot be checked from here: {where}. Two saves into one directory would "
            f"overwrite each other's files. Once you are sure no save is running as pid {pid} on host {host} "
            f"(its job ended or was killed), delete {path} and save again; until then, save into another directory"
        )
    return CheckpointExistsError(
        f"another save_pretrained into {final} is running (pid {pid} on host {host} (save {save}) holds {path}); "
        "two saves into one directory would overwrite each other's files. Wait for it to finish or save into "
        f"another directory; if pid {pid} is no save (its pid was given to another program), delete {path}"
    )


def release_save_lock(final: pathlib.Path, token: str) -> None:
    """Remove ``final``'s save lock if save ``token`` holds it (never another save's)."""
    path = final / LOCK_NAME
    try:
        holder = json.loads(_read(path) or "")
    except (OSError, ValueError):
        return
    if isinstance(holder, dict) and holder.get("save") == token:
        path.unlink(missing_ok=True)


def check_inside(final: pathlib.Path, relative: Iterable[str]) -> None:
    """Refuse a save whose files would be written through a symbolic link out of ``final``.

    Args:
        final: the checkpoint directory (itself may be a link: the user chose it).
        relative: the directories (relative to ``final``) the save writes into.

    Raises:
        CheckpointExistsError: one of them, or a directory on the way, is a symbolic link or not a directory.
    """
    for rel in relative:
        p = final
        for part in pathlib.Path(rel).parts:
            p = p / part
            if p.is_symlink():
                raise CheckpointExistsError(
                    f"{p} is a symbolic link (to {os.readlink(p)}); save_pretrained writes only inside {final}, "
                    "never through a link to elsewhere. Remove the link (its target is left alone) or save into "
                    "another directory"
                )
            if p.exists() and not p.is_dir():
                raise CheckpointExistsError(
                    f"{p} exists and is not a directory, but save_pretrained writes its {part}/ files there; "
                    "move it away or save into another directory"
                )
