"""A save's lock survives its writer's death: a lock no running save can hold is taken over with a warning.

A writer can die between creating ``<dir>/.hf_pipeline.lock`` and writing its holder into it (a full
disk, SIGKILL), and a lock's holder can die while holding it. Every such lock is taken over by the
next save, with a warning naming the lock and why: one that names no holder (empty, truncated, not
a save's JSON) and one whose pid no longer runs on this host. A lock held by a live process of this
host, one of another host (its pid cannot be checked from here) and one that cannot be read are
refused as before, and the writer itself never leaves an empty or partial lock behind.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest
import tiny

from hf_pipeline.checkpointing import lock as lock_module
from hf_pipeline.checkpointing.lock import LOCK_NAME, acquire_save_lock, release_save_lock
from hf_pipeline.errors import CheckpointExistsError

TOKEN = "0123456789ab"  # save ids are 12 hex digits


@pytest.fixture
def warnings_logged():
    """The lock module's warnings (the library logger does not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger(lock_module.__name__)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _holds(directory, token) -> bool:
    return json.loads((directory / LOCK_NAME).read_text()).get("save") == token


def _took_over(directory, records, why: str) -> None:
    """``directory``'s lock is ours (save TOKEN), one warning named the lock and ``why``, and nothing is left."""
    assert _holds(directory, TOKEN), (directory / LOCK_NAME).read_text()
    messages = [r.getMessage() for r in records]
    assert len(messages) == 1 and str(directory / LOCK_NAME) in messages[0] and why in messages[0], messages
    release_save_lock(directory, TOKEN)
    assert sorted(p.name for p in directory.iterdir()) == [], "the lock or a file of it was left behind"


NO_HOLDER = [  # (what a dead writer left in the lock, what the warning says)
    (b"", "it is empty"),  # ENOSPC or SIGKILL after creating it, before writing it (earlier versions)
    (b'{"host": "node1", "pid": 12', "not complete JSON"),  # a full disk while writing the pid
    (b'\x00\x00\x00\x00', "not complete JSON"),  # a power loss: the size grew, the data never came
    (b"[1, 2]", "names no holder"),
    (b'{"save": "0123456789ab"}', "names no holder"),
    (json.dumps({"host": socket.gethostname(), "pid": 0}).encode(), "names no holder"),  # 0 would be a group
]


@pytest.mark.parametrize("left, why", NO_HOLDER, ids=["empty", "truncated", "zeros", "list", "no-pid", "pid-0"])
def test_a_lock_that_names_no_holder_is_taken_over_with_a_warning(tmp_path, warnings_logged, left, why):
    (tmp_path / LOCK_NAME).write_bytes(left)
    acquire_save_lock(tmp_path, TOKEN)
    _took_over(tmp_path, warnings_logged, why)


def test_a_lock_of_a_pid_that_cannot_run_here_is_taken_over(tmp_path, warnings_logged):
    dead = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text())  # pids stay below it: never a live one
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "save": "aaaaaaaaaaaa"}))
    acquire_save_lock(tmp_path, TOKEN)
    _took_over(tmp_path, warnings_logged, f"pid {dead} on this host, no longer runs")


def test_a_lock_whose_pid_is_now_another_process_is_taken_over(tmp_path, warnings_logged):
    # This process's pid with another start time: its holder died and the pid was given to this process.
    holder = lock_module._holder("aaaaaaaaaaaa")
    (tmp_path / LOCK_NAME).write_text(json.dumps({**holder, "started": "1"}))
    acquire_save_lock(tmp_path, TOKEN)
    _took_over(tmp_path, warnings_logged, "the pid is now another process's")


ELSEWHERE = [  # (a holder whose pid cannot be checked from here, why the message says so)
    ({"host": "elsewhere", "pid": 1, "save": "aaaaaaaaaaaa"}, "that is not this host"),
    ({**lock_module._holder("aaaaaaaaaaaa"), "pidns": "pid:[1]"}, "another pid namespace"),  # a container
    ({**lock_module._holder("aaaaaaaaaaaa"), "boot": "another-boot"}, "boot id is not this host's"),  # same name
]


@pytest.mark.parametrize("holder, why", ELSEWHERE, ids=["other-host", "other-pid-namespace", "other-boot"])
def test_a_lock_of_another_host_is_refused_naming_the_file_its_holder_and_what_to_do(
        tmp_path, warnings_logged, holder, why):
    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps(holder))
    with pytest.raises(CheckpointExistsError) as refused:
        acquire_save_lock(tmp_path, TOKEN)
    message = str(refused.value)
    # the lock's full path, the holder it names, why it cannot be checked, and the way on: delete that file
    assert message.startswith(f"{lock} says a save_pretrained into {tmp_path} runs as "), message
    assert f"pid {holder['pid']} on host {holder['host']} (save aaaaaaaaaaaa)" in message, message
    assert "cannot be checked from here: " in message and why in message, message
    assert (f"Once you are sure no save is running as pid {holder['pid']} on host {holder['host']} (its job ended "
            f"or was killed), delete {lock} and save again") in message, message
    assert json.loads(lock.read_text()) == holder and not warnings_logged


def test_a_lock_of_a_live_process_here_is_refused(tmp_path, warnings_logged):
    lock = tmp_path / LOCK_NAME
    holder = lock_module._holder("aaaaaaaaaaaa")  # this very process: alive
    lock.write_text(json.dumps(holder))
    with pytest.raises(CheckpointExistsError, match=rf"is running \(pid {holder['pid']} on host .* holds {lock}\)"
                       r".* Wait for it to finish"):
        acquire_save_lock(tmp_path, TOKEN)
    assert json.loads(lock.read_text()) == holder and not warnings_logged


def test_an_unreadable_lock_is_refused(tmp_path, monkeypatch):
    (tmp_path / LOCK_NAME).write_text("")
    real = lock_module._read

    def unreadable(path):  # another user's lock, written under umask 077
        if path.name == LOCK_NAME:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(lock_module, "_read", unreadable)
    with pytest.raises(CheckpointExistsError, match="cannot be read: .*Permission denied"):
        acquire_save_lock(tmp_path, TOKEN)
    assert (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_a_full_disk_while_writing_the_lock_leaves_no_lock(tmp_path, monkeypatch, links):
    def full(fd, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    if not links:  # a filesystem without hard links: the lock is written in place
        monkeypatch.setattr(lock_module.os, "link", _no_link)
    monkeypatch.setattr(lock_module, "_write_holder", full)
    with pytest.raises(OSError, match=f"No space left on device: writing {tmp_path / LOCK_NAME} failed on the disk"):
        acquire_save_lock(tmp_path, TOKEN)
    assert list(tmp_path.iterdir()) == [], "the failed write left a file"
    monkeypatch.undo()  # space freed: the next save takes the lock
    acquire_save_lock(tmp_path, TOKEN)
    assert _holds(tmp_path, TOKEN)


def _no_link(src, dst):
    raise OSError(errno.EPERM, "Operation not permitted")


def test_without_hard_links_one_save_at_a_time_still(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module.os, "link", _no_link)
    acquire_save_lock(tmp_path, TOKEN)
    with pytest.raises(CheckpointExistsError, match="another save_pretrained"):
        acquire_save_lock(tmp_path, "bbbbbbbbbbbb")
    release_save_lock(tmp_path, "bbbbbbbbbbbb")  # not its lock: kept
    assert _holds(tmp_path, TOKEN)
    release_save_lock(tmp_path, TOKEN)
    assert list(tmp_path.iterdir()) == []


def test_without_hard_links_a_lock_taken_over_while_written_is_given_up(tmp_path, monkeypatch, warnings_logged):
    # Written in place, the lock is empty for an instant: a save that takes it over then holds it, and the writer
    # sees its file is no longer the lock and refuses, naming the save that holds it.
    monkeypatch.setattr(lock_module.os, "link", _no_link)
    real = lock_module._write_holder
    calls = []

    def raced(fd, text):
        calls.append(fd)
        if len(calls) == 2:  # the first write is to the save's own file; the second into the lock itself
            acquire_save_lock(tmp_path, "bbbbbbbbbbbb")
        real(fd, text)

    monkeypatch.setattr(lock_module, "_write_holder", raced)
    with pytest.raises(CheckpointExistsError, match=r"\(save bbbbbbbbbbbb\)"):
        acquire_save_lock(tmp_path, TOKEN)
    assert _holds(tmp_path, "bbbbbbbbbbbb") and "it is empty" in warnings_logged[0].getMessage()


def test_a_save_into_a_folder_an_empty_lock_was_left_in_succeeds(tmp_path, warnings_logged):
    # The case end to end: ENOSPC while an earlier save created its lock left it empty.
    import hf_pipeline
    from hf_pipeline.checkpointing.directory import is_complete_checkpoint

    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(src, pipeline=True, device="cpu", n_microbatches=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_bytes(b"")
    model.save_pretrained(out)
    assert is_complete_checkpoint(out) and not (out / LOCK_NAME).exists()
    assert any("it is empty" in r.getMessage() for r in warnings_logged)


# --------------------------------------------------------------------------------------------
# Real processes: one that exited, one that runs, one killed while writing its lock
# --------------------------------------------------------------------------------------------
@pytest.mark.dist
def test_real_processes_dead_live_and_killed_while_writing(tmp_path, warnings_logged):
    here = socket.gethostname()
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": here, "pid": exited.pid, "save": "aaaaaaaaaaaa"}))
    acquire_save_lock(tmp_path, TOKEN)
    _took_over(tmp_path, warnings_logged, f"pid {exited.pid} on this host, no longer runs")
    warnings_logged.clear()

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"host": here, "pid": live.pid, "save": "aaaaaaaaaaaa"}))
        with pytest.raises(CheckpointExistsError, match=rf"pid {live.pid} on host {here} \(save aaaaaaaaaaaa\)"):
            acquire_save_lock(tmp_path, TOKEN)
        assert not warnings_logged
    finally:
        live.kill()
        live.wait()
    (tmp_path / LOCK_NAME).unlink()

    _killed_while_writing(tmp_path)
    acquire_save_lock(tmp_path, TOKEN)  # the killed writer left no lock (or an empty one: taken over)
    assert _holds(tmp_path, TOKEN)
    release_save_lock(tmp_path, TOKEN)
    assert list(tmp_path.iterdir()) == [], "the killed writer's file was left behind"


def _killed_while_writing(directory) -> None:
    """A child that takes the lock and is SIGKILLed after creating its file, before writing its holder."""
    pid = os.fork()
    if pid == 0:  # the child: only file operations, then killed
        try:
            lock_module._write_holder = lambda fd, text: os.kill(os.getpid(), signal.SIGKILL)
            acquire_save_lock(directory, "cccccccccccc")
        finally:
            os._exit(3)  # not reached: killed in _write_holder
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    left = [p.name for p in directory.iterdir()]
    assert left == [f"{LOCK_NAME}.cccccccccccc"], f"killed before writing: only its own file, not {left}"
