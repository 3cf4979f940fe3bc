"""hf_pipeline.checked_files: every file of a checkpoint is read as a regular file, and damage is named.

One reader for every file of a checkpoint or training state: a FIFO, a directory or a device in a
file's place is refused by name (never opened for a blocking read), a JSON file says whether it is
truncated or not ours, and a ``torch.save`` file whether it is truncated, not a torch file at all, or
a pickle that would run code. The checkpoint-level cases (``load_training_state``, ``from_pretrained``,
the Trainer's resume) are in tests/checkpointing/test_damaged_files.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import threading

import pytest
import torch

from hf_pipeline.checked_files import is_regular_file, load_torch_data, open_regular, read_json
from hf_pipeline.errors import CheckpointError, CheckpointNotFoundError
from hf_pipeline.loading.safetensors_header import read_shard_header


@contextlib.contextmanager
def unblocked(fifo):
    """Fails the test if anything opened ``fifo`` for reading (and so waited for a writer).

    A writer opens the FIFO's write end whenever a reader waits, so code that blocks on it goes on
    (and fails otherwise) instead of hanging the suite; that it had to is the failure. No time is asserted.
    """
    done, waited = threading.Event(), []

    def writer():
        while not done.wait(0.2):
            try:  # succeeds only while a reader waits in open(); ENXIO otherwise
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                waited.append(True)
            except OSError:
                pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
    assert not waited, f"{fifo} was opened for reading: the load waited for a writer to the FIFO"


def _place(path, kind):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    return path


_KIND = {"fifo": r"a FIFO \(named pipe\)", "directory": "a directory", "device": "a character device"}
_READERS = {
    "open": lambda p: open_regular(p, "a file").close(),
    "json": lambda p: read_json(p, "a file"),
    "torch": lambda p: load_torch_data(p, "a file"),
    "safetensors": lambda p: read_shard_header(p),
}


@pytest.mark.parametrize("reader", sorted(_READERS))
@pytest.mark.parametrize("kind", sorted(_KIND))
def test_only_regular_files_are_read(tmp_path, kind, reader):
    path = _place(tmp_path / "file", kind)
    with unblocked(path), pytest.raises(CheckpointError, match=rf"{path} \(.*\) is {_KIND[kind]}, not a regular file"):
        _READERS[reader](path)
    with pytest.raises(CheckpointError, match=_KIND[kind]):
        is_regular_file(path, "a file")
    assert not is_regular_file(tmp_path / "nothing", "a file")  # missing: False, for the caller to say


@pytest.mark.parametrize(
    "content, expect, said",
    [
        (b"", dict, r"is empty \(0 bytes\): it is truncated"),
        (b"  \n", dict, r"is empty \(3 bytes\): it is truncated"),
        (b'{"state_files": {"a": "pp-0', dict, r"ends in the middle of its JSON \(\d+ bytes\): it is truncated"),
        (b'{"state_files": {"a": 1}, ', dict, r"ends in the middle of its JSON .*: it is truncated"),
        (bytes(range(256)), dict, r"holds binary data, not JSON text .*not written by hf_pipeline / transformers"),
        (b'{"a": 1} x', dict, r"is not valid JSON \(Extra data, .*\): it is truncated or was not written by hf_pipel"),
        (b"[1, 2]", dict, r"holds a JSON list where a dict belongs: it was not written by hf_pipeline / transformers"),
        (b'{"other": 1}', dict, r"has no 'state_files' entry: it was not written by hf_pipeline / transformers"),
    ],
)
def test_json_damage_is_named(tmp_path, content, expect, said):
    path = tmp_path / "index.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"^{path} \(the optimizer state index\) {said}"):
        read_json(path, "the optimizer state index", expect=expect, keys=("state_files",))


def test_good_json_reads_and_missing_is_not_found(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"state_files": {"a": "pp-00000.pt"}}))
    assert read_json(path, "x", expect=dict, keys=("state_files",)) == {"state_files": {"a": "pp-00000.pt"}}
    with pytest.raises(CheckpointNotFoundError, match=rf"{tmp_path / 'no.json'} \(x\) does not exist"):
        read_json(tmp_path / "no.json", "x")


class _RunsCode:
    def __reduce__(self):
        return os.system, ("true",)


@pytest.mark.parametrize(
    "make, said",
    [
        ("zip, cut in half", r"ends before its zip directory: it is truncated"),
        ("zip, last byte cut", r"ends before its zip directory: it is truncated"),
        ("legacy pickle, cut", r"ends in the middle of its pickle: it is truncated"),
        ("empty", r"is empty \(0 bytes\): it is truncated"),
        ("json text", r"is no torch.save file \(it starts with b'\{\"a\"', .*\): it was not written by hf_pipeline"),
        ("code", r"holds more than tensors, .*could run code\): it names (posix|os|nt)\.system"),
    ],
)
def test_torch_file_damage_is_named_truncated_not_ours_or_code(tmp_path, make, said):
    path = tmp_path / "pp-00000.pt"
    state = {"state": {"w": {"exp_avg": torch.zeros(64)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    if make.startswith("zip"):
        torch.save(state, path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if "half" in make else data[:-1])
    elif make.startswith("legacy"):
        torch.save(state, path, _use_new_zipfile_serialization=False)
        path.write_bytes(path.read_bytes()[:300])
    elif make == "empty":
        path.write_bytes(b"")
    elif make == "json text":
        path.write_text('{"a": 1}')
    else:
        torch.save({"state": _RunsCode()}, path)
    with pytest.raises(CheckpointError, match=rf"^{path} \(optimizer state\) {said}") as info:
        load_torch_data(path, "optimizer state")
    if make != "code":  # a truncated or foreign file is never called a possible malicious pickle
        assert "could run code" not in str(info.value)
        assert "weights_only=False" not in str(info.value)


def test_a_plain_pickle_that_runs_code_is_refused(tmp_path):
    path = tmp_path / "scheduler.pt"
    with open(path, "wb") as f:
        pickle.dump({"x": _RunsCode()}, f, protocol=2)
    with pytest.raises(CheckpointError, match=r"could run code\): it names (posix|os|nt)\.system"):
        load_torch_data(path, "the scheduler state")


def test_good_torch_file_reads_memory_mapped_or_not(tmp_path):
    path = tmp_path / "w.bin"
    torch.save({"w": torch.arange(4.0)}, path)
    for mmap in (False, True):
        assert torch.equal(load_torch_data(path, "x", mmap=mmap)["w"], torch.arange(4.0))
    torch.save({"w": torch.arange(4.0)}, path, _use_new_zipfile_serialization=False)  # cannot be memory-mapped
    assert torch.equal(load_torch_data(path, "x", mmap=True)["w"], torch.arange(4.0))
