"""One save at a time into a checkpoint directory, and only inside it.

Two jobs saving into one directory at once would each publish the other's half-moved files and
remove the other's staging directory as a killed save's leftover. So rank 0 of a save holds
``<dir>/.hf_pipeline.lock`` while it stages and publishes: the file is created with ``O_EXCL``
(atomic, also on NFS v3+), names the holder's host, pid and save id, and is removed when the save
ends, whether it succeeded or failed. A second save meanwhile is refused and names the holder. A
lock whose holder died (SIGKILL, power loss) stays behind: one of a dead pid on this host is taken
over; one from another host cannot be checked from here, so the error says to remove it once no
save is running there.

A save writes only inside its directory: an ``optimizer/`` or ``rng/`` there that is a symbolic
link (or any other path the save writes through) would send the files elsewhere, so it is refused
before anything is written (:func:`check_inside`); the link and what it points to are left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
from typing import Iterable

from ..errors import CheckpointExistsError

__all__ = ["LOCK_NAME", "acquire_save_lock", "check_inside", "release_save_lock"]

LOCK_NAME = ".hf_pipeline.lock"


def _holder(token: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "save": token}


def _read(path: pathlib.Path) -> dict | None:
    """The lock's holder, or None when the lock is gone or unreadable (being written: treated as held)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _dead_here(holder: dict) -> bool:
    """True when the holder is a process of this host that no longer runs."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _create(path: pathlib.Path, token: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(_holder(token)) + "\n")
    return True


def _take_over(path: pathlib.Path, holder: dict, token: str) -> bool:
    """Move a dead holder's lock aside and create ours; False when another save was faster."""
    aside = path.with_name(f"{LOCK_NAME}.stale-{token}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return _create(path, token)
    moved = _read(aside)
    if moved != holder:  # another save took it over between our read and the rename: put its lock back
        with contextlib.suppress(OSError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return _create(path, token)


def acquire_save_lock(final: pathlib.Path, token: str) -> str | None:
    """Rank 0: hold ``final``'s save lock for save ``token`` (``final`` exists).

    Returns:
        The save id a dead holder's lock named (its staging directory is a leftover), else None.

    Raises:
        CheckpointExistsError: another save into ``final`` is running (or its lock cannot be checked).
    """
    path = final / LOCK_NAME
    for _ in range(3):
        if _create(path, token):
            return None
        holder = _read(path)
        if holder is None:
            continue  # released meanwhile
        if _dead_here(holder) and _take_over(path, holder, token):
            return holder.get("save")
        break
    holder = _read(path) or {}
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (save {holder.get('save', '?')})"
    raise CheckpointExistsError(
        f"another save_pretrained into {final} is running ({who} holds {path}); two saves into one directory "
        "would overwrite each other's files. Save into another directory, or wait for it to finish; if no save is "
        f"running there (its job was killed on another host), remove {path}"
    )


def release_save_lock(final: pathlib.Path, token: str) -> None:
    """Remove ``final``'s save lock if save ``token`` holds it (never another save's)."""
    path = final / LOCK_NAME
    holder = _read(path)
    if holder and holder.get("save") == token:
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
