"""A weight load that races a save: the files changing under the reader are named as such, not as damage.

A save into the directory being loaded (another job's ``save_pretrained``) replaces shards, rewrites
the index or rewrites a shard's bytes while the loader reads. Without a check that shows up as a
"missing" or "truncated" shard (and the advice to re-download a checkpoint that is fine), or as no
error at all and a stage holding tensors of two saves. The loader compares each file's stamp (inode,
size, modification time) from before its read with its stamp after: a change names the file and
says to load again once the save has finished; a file damaged at rest keeps its own message.
Each race is made deterministic by doing the "save" from inside the reader, between two tensors.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import tiny
import torch
from safetensors import safe_open

from hf_pipeline.errors import CheckpointChangedError, CheckpointError
from hf_pipeline.loading import checkpoint_files, weights
from hf_pipeline.loading.checkpoint_files import CheckpointIndex
from hf_pipeline.loading.weights import load_tensors

_CHANGED = r"the checkpoint .* changed while it was read: {file} {how}.*Wait for the save to finish and load again"


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Two saves of one architecture (same shard layout and sizes, other weights): what a racing save writes."""
    root = tmp_path_factory.mktemp("races")
    return tiny.make_checkpoint(root / "first", "llama", seed=0), tiny.make_checkpoint(root / "second", "llama", seed=1)


@pytest.fixture
def ckpt(saves, tmp_path):
    return pathlib.Path(shutil.copytree(saves[0], tmp_path / "ckpt"))


def _shards(directory: pathlib.Path) -> list[str]:
    return sorted(set(json.loads((directory / checkpoint_files.INDEX_NAME).read_text())["weight_map"].values()))


def _wanted(directory: pathlib.Path) -> dict:
    wanted = {}
    for shard in _shards(directory):
        with safe_open(str(directory / shard), "pt") as f:
            wanted.update({k: (tuple(f.get_slice(k).get_shape()), torch.float32) for k in f.keys()})
    return wanted


def _during_read(monkeypatch, save) -> None:
    """Run ``save()`` once, while the reader is between the first tensor and the second."""
    real = weights._TensorReader.read
    done = []

    def read(self, f, t, **kwargs):
        out = real(self, f, t, **kwargs)
        if not done:
            done.append(save())
        return out

    monkeypatch.setattr(weights._TensorReader, "read", read)


def test_a_shard_replaced_during_the_read_is_named_not_mixed_in(ckpt, saves, monkeypatch):
    # The new shard has the old one's layout and size: without the check this loads silently, half
    # of the tensors from each save.
    last = _shards(ckpt)[-1]
    staged = ckpt / "staged.tmp"
    shutil.copy(saves[1] / last, staged)
    _during_read(monkeypatch, lambda: os.replace(staged, ckpt / last))  # as a save's atomic rename does
    replaced = _CHANGED.format(file=last, how="was replaced by another file during the read")
    with pytest.raises(CheckpointChangedError, match=replaced):
        load_tensors(CheckpointIndex.from_directory(ckpt), _wanted(ckpt))


def test_the_index_rewritten_during_the_read_is_named(ckpt, monkeypatch):
    # A save that lands writes its index and removes the shards the new index no longer lists.
    last = _shards(ckpt)[-1]

    def save():
        index = json.loads((ckpt / checkpoint_files.INDEX_NAME).read_text())
        index["metadata"]["total_size"] += 1
        (ckpt / checkpoint_files.INDEX_NAME).write_text(json.dumps(index))
        (ckpt / last).unlink()

    _during_read(monkeypatch, save)
    with pytest.raises(CheckpointChangedError, match=_CHANGED.format(file=r"model\.safetensors\.index\.json",
                                                                     how=r"was rewritten")):
        load_tensors(CheckpointIndex.from_directory(ckpt), _wanted(ckpt))


def test_a_shard_missing_because_the_index_changed_while_it_was_checked(ckpt, monkeypatch):
    # from_directory reads the index, then looks for its shards: a save landing in between removed one.
    last = _shards(ckpt)[-1]
    real_loads = json.loads

    def loads(text, *args, **kwargs):
        out = real_loads(text, *args, **kwargs)
        (ckpt / checkpoint_files.INDEX_NAME).write_text(text.replace('"metadata": {', '"metadata": {"x": 1, ', 1))
        (ckpt / last).unlink(missing_ok=True)
        return out

    monkeypatch.setattr(json, "loads", loads)  # the one json module, as read through checked_files
    with pytest.raises(CheckpointChangedError, match=_CHANGED.format(file=r"model\.safetensors\.index\.json",
                                                                     how="was rewritten")):
        CheckpointIndex.from_directory(ckpt)


def test_a_shard_rewritten_in_place_under_the_reader_is_named(ckpt, monkeypatch):
    # transformers' save opens each shard with "wb": the reader finds it shorter than its header said.
    first = _shards(ckpt)[0]

    def save():
        with open(ckpt / first, "r+b") as f:
            f.truncate(100)

    _during_read(monkeypatch, save)
    rewritten = _CHANGED.format(file=first, how=r"was rewritten during the read \(its size")
    with pytest.raises(CheckpointChangedError, match=rewritten):
        load_tensors(CheckpointIndex.from_directory(ckpt), _wanted(ckpt))


def test_damage_at_rest_keeps_its_own_message(ckpt, monkeypatch):
    # The same symptoms without a change under the reader: a damaged file, to re-download or re-save.
    wanted = _wanted(ckpt)
    first, last = _shards(ckpt)[0], _shards(ckpt)[-1]
    data = (ckpt / last).read_bytes()
    (ckpt / last).write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=rf"{last} .* is truncated .*re-download or re-save it") as info:
        load_tensors(CheckpointIndex.from_directory(ckpt), wanted)
    assert not isinstance(info.value, CheckpointChangedError)
    (ckpt / last).write_bytes(data)
    # A file that ends early during the read but has not changed (a bad disk, a broken network mount).
    monkeypatch.setattr(weights, "_readinto", lambda f, offset, buffer: (_ for _ in ()).throw(weights._ShortRead("x")))
    with pytest.raises(CheckpointError, match=rf"shard '{first}' .* ended while reading .*re-download") as info:
        load_tensors(CheckpointIndex.from_directory(ckpt), wanted)
    assert not isinstance(info.value, CheckpointChangedError)
    monkeypatch.undo()
    tensors, _ = load_tensors(CheckpointIndex.from_directory(ckpt), wanted)  # and the intact files load
    assert len(tensors) == len(wanted)
