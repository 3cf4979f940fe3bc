"""Reading the files of a checkpoint or a training state: regular files only, and what is wrong named.

A checkpoint comes from anywhere (a hub download, a shared disk, a copy that stopped half-way), so
every file read from one goes through here and fails, when bad, with a
:class:`~hf_pipeline.errors.CheckpointError` that names the file and says which of three things is
wrong with it:

* **truncated**: empty, or ending before its content does (a save or a download that did not finish);
* **not ours**: binary where JSON belongs, a JSON of another shape, a file that is no ``torch.save``
  output (not written by hf_pipeline / transformers, or damaged);
* **could run code**: a pickle naming a class or function beyond tensors, numbers and containers.

Only regular files are read (a link is followed to its target): opening a FIFO blocks until a writer
comes, a character device (``/dev/zero``) never ends, and a directory has no contents to read. Files
are opened non-blocking and checked with ``fstat`` on the open descriptor, so nothing swapped in
between a check and the open can block the load either. Every caller reads inside an agreement across
ranks (``collective_errors``), so a file bad on one rank's copy is an error on every rank.

This module imports only :mod:`hf_pipeline.errors` (and torch): every room that reads a checkpoint may use it.

Example:
    >>> state = read_json(path / "scheduler.json", "the scheduler state", expect=dict)
    >>> with open_regular(shard, "shard") as f:
    ...     prefix = f.read(8)
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import stat
import zipfile
from typing import Any, BinaryIO

from .errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "NOT_OURS",
    "TRUNCATED",
    "is_regular_file",
    "load_torch_data",
    "not_regular_error",
    "open_regular",
    "read_json",
]

TRUNCATED = "is truncated (a save or download that did not finish)"
NOT_OURS = "was not written by hf_pipeline / transformers (or is damaged)"
_REDO = "re-save or re-download it"

# What a file that is not regular is, for the message (a link is followed to what it points to).
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular_error(path: str | os.PathLike, what: str, mode: int) -> CheckpointError:
    """The error for ``path`` (``what`` it should hold) being no regular file (``mode``: its ``st_mode``)."""
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return CheckpointError(
        f"{path} ({what}) is {kind}, not a regular file: hf_pipeline reads only regular files from a checkpoint "
        "(reading a pipe or a device could block the load or never end); put the file itself there"
    )


def is_regular_file(path: str | os.PathLike, what: str) -> bool:
    """Whether ``path`` is a regular file (after links); False when nothing is there.

    Raises:
        CheckpointError: something else is there (a directory, a FIFO, a device, a socket), or it cannot
            be looked at (permissions).
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # a dangling link is no file either
        return False
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({what}): {type(e).__name__}: {e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise not_regular_error(path, what, st.st_mode)
    return True


def open_regular(path: str | os.PathLike, what: str, *, buffering: int = -1) -> BinaryIO:
    """``path`` opened for binary reading, refused unless it is a regular file.

    Opened ``O_NONBLOCK`` (a FIFO's open does not wait for a writer) and checked with ``fstat`` on the
    open descriptor; reads are blocking again once it is known to be a regular file.

    Args:
        path: the file.
        what: what it holds, for the error ("the optimizer state index").
        buffering: as for ``open`` (0: unbuffered).

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        CheckpointError: it is no regular file, or cannot be opened.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CheckpointNotFoundError(f"{path} ({what}) does not exist") from e
    except OSError as e:
        raise CheckpointError(f"cannot open {path} ({what}): {type(e).__name__}: {e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular_error(path, what, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def _parse_json(path: str | os.PathLike, what: str, raw: bytes, hint: str) -> Any:
    """The JSON document ``raw``, or a :class:`CheckpointError` saying why it is none."""
    redo = f"; {_REDO}{hint}"
    if not raw.strip():
        raise CheckpointError(f"{path} ({what}) is empty ({len(raw)} bytes): it {TRUNCATED}{redo}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path} ({what}) holds binary data, not JSON text (byte {e.start} is no UTF-8): it {NOT_OURS}{redo}"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        # A document cut short fails at (or in a string running to) its end; anything else is malformed.
        if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
            message = f"{path} ({what}) ends in the middle of its JSON ({len(raw)} bytes): it {TRUNCATED}"
        else:
            message = (
                f"{path} ({what}) is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}): it is truncated or "
                "was not written by hf_pipeline / transformers"
            )
        raise CheckpointError(message + redo) from None


def read_json(
    path: str | os.PathLike, what: str, *, expect: type | None = None, keys: tuple[str, ...] = (), hint: str = ""
) -> Any:
    """The JSON document in ``path``, read only from a regular file, damage named.

    Args:
        path: the file.
        what: what it holds, for the error ("the scheduler state").
        expect: the type the document must be (``dict``), else it is not ours.
        keys: keys the (dict) document must have.
        hint: another way out, appended to the error (``", or pass rng=False ..."``).

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        CheckpointError: not a regular file, empty, truncated, not JSON, or not of the expected shape.
    """
    with open_regular(path, what) as f:
        try:
            raw = f.read()
        except OSError as e:
            raise CheckpointError(f"cannot read {path} ({what}): {type(e).__name__}: {e}{hint}") from e
    value = _parse_json(path, what, raw, hint)
    if expect is not None and not isinstance(value, expect):
        raise CheckpointError(
            f"{path} ({what}) holds a JSON {type(value).__name__} where a {expect.__name__} belongs: it {NOT_OURS}; "
            f"{_REDO}{hint}"
        )
    missing = [k for k in keys if k not in value]
    if missing:
        raise CheckpointError(f"{path} ({what}) has no {missing[0]!r} entry: it {NOT_OURS}; {_REDO}{hint}")
    return value


# How a torch.save file starts: a zip archive (the default since torch 1.6), or a pickle (protocol 2+).
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = 0x80
_WEIGHTS_ONLY_REFUSAL = "Weights only load failed"
_END_OF_DATA = ("unexpected EOF", "Ran out of input", "truncated", "pickle data was truncated")


def _torch_damage(path: pathlib.Path, what: str, head: bytes, error: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed: code it would run, a cut-short file, or no torch file."""
    text = str(error)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    code = (
        f"{path} ({what}) holds more than tensors, numbers and containers, so it is not loaded (unpickling it could "
        "run code): {found}. Re-save the checkpoint with this version of hf_pipeline (it writes safetensors and "
        "JSON) from a run you trust"
    )
    if named:
        return code.format(found=f"it names {named.group(1)}")
    if head.startswith(_ZIP_MAGIC):
        if not zipfile.is_zipfile(path):  # the zip directory is written last: a cut-short file has none
            return f"{path} ({what}) ends before its zip directory: it {TRUNCATED}; {_REDO}"
        if _WEIGHTS_ONLY_REFUSAL in text:
            return code.format(found=f"{type(error).__name__} while reading it")
        return f"{path} ({what}) is a damaged torch.save archive ({type(error).__name__}): it {NOT_OURS}; {_REDO}"
    if head[:1] == bytes([_PICKLE_PROTO]):
        if isinstance(error, (EOFError, IndexError)) or any(m in text for m in _END_OF_DATA):
            return f"{path} ({what}) ends in the middle of its pickle: it {TRUNCATED}; {_REDO}"
        if _WEIGHTS_ONLY_REFUSAL in text:
            return code.format(found=f"{type(error).__name__} while reading it")
        return f"{path} ({what}) is a damaged pickle ({type(error).__name__}): it {NOT_OURS}; {_REDO}"
    return (
        f"{path} ({what}) is no torch.save file (it starts with {head!r}, neither a zip archive nor a pickle): it "
        f"{NOT_OURS}; {_REDO}"
    )


def load_torch_data(path: str | os.PathLike, what: str, *, hint: str = "", mmap: bool = False, **kwargs) -> Any:
    """``torch.load(path, weights_only=True)`` of a regular file: tensors, numbers, strings and containers only.

    Args:
        path: the file.
        what: what it holds, for the error ("optimizer state").
        hint: another way out, appended to the error (``", or pass rng=False ..."``).
        mmap: memory-map the file where its format allows (torch then opens it by name, after it was checked
            here); a legacy (pre-zip) file is read whole.
        **kwargs: more ``torch.load`` arguments (``map_location``).

    Raises:
        CheckpointError: the file is no regular file, empty or truncated, no ``torch.save`` output, or holds
            more than plain data (a pickle of another class, or one that would run code); never unpickled
            beyond ``weights_only``.
    """
    import torch  # here, not at import: errors-level modules stay light

    path = pathlib.Path(path)
    with open_regular(path, what) as f:
        head = f.read(4)
        if not head:
            raise CheckpointError(f"{path} ({what}) is empty (0 bytes): it {TRUNCATED}; {_REDO}{hint}")
        f.seek(0)
        try:
            if mmap and head.startswith(_ZIP_MAGIC):  # the legacy (pickle) format cannot be memory-mapped
                return torch.load(path, weights_only=True, mmap=True, **kwargs)
            return torch.load(f, weights_only=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - torch raises many types here; each is named, none is unpickled
            # torch's own message advises weights_only=False, the one thing not to do here: say what is wrong.
            raise CheckpointError(_torch_damage(path, what, head, e) + hint) from e
