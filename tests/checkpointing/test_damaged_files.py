"""A damaged file in a checkpoint or its training state is named, with what is wrong, on every rank.

Every file read from a checkpoint goes through hf_pipeline.checked_files (tested alone in
tests/test_checked_files.py). Here, members of each class through the entry points a user calls:

- truncated, empty, binary or foreign training-state files (``optimizer/index.json``, ``pp-*.pt``,
  ``scheduler.json``, ``trainer_state.json``, ``rng/rank-*.safetensors``, the index) through
  ``load_training_state``: a CheckpointError naming the file and saying "truncated" or "not written by
  hf_pipeline / transformers", never a raw JSONDecodeError / UnicodeDecodeError / SafetensorError, and a
  truncated ``pp-*.pt`` never called a possible malicious pickle;
- a FIFO, a directory or a device in the place of a shard, the index, config.json or
  generation_config.json: ``from_pretrained`` refuses it by name instead of hanging;
- the Trainer's resume (``restore_rng``, ``reload_weights``): one rank's truncated RNG file fails
  on every rank (2 ranks), and a truncated ``trainer_state.json`` is named before transformers reads it.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil

import pytest
import tiny
import torch
from test_checked_files import unblocked
from tiny import make_batch

from hf_pipeline.errors import CheckpointError, RankError


def _load(path, **kwargs):
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", n_microbatches=2, progress=False, **kwargs
    )


def _trained(src):
    model = _load(src)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model.train_step(make_batch("llama", rows=4))
    opt.step()
    sched.step()
    opt.zero_grad()
    return model, opt, sched


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    src = tiny.make_checkpoint(root / "src", "llama")
    model, opt, sched = _trained(src)
    target = root / "checkpoint-1"
    model.save_pretrained(target, optimizer=opt, scheduler=sched, step=1)
    return src, target, model


def _cut(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


_DAMAGE = {
    "truncated": _cut,
    "empty": lambda p: p.write_bytes(b""),
    "binary": lambda p: p.write_bytes(bytes(range(256)) * 4),
    "a JSON list": lambda p: p.write_text("[1, 2, 3]"),
    "a directory": lambda p: (p.unlink(), p.mkdir()),
    "a FIFO": lambda p: (p.unlink(), os.mkfifo(p)),
}
_TRUNCATED = r"it is truncated \(a save or download that did not finish\)"
_NOT_OURS = r"it was not written by hf_pipeline / transformers"

# (file, damage, what load_training_state is asked for, what the error says after the file's path)
CASES = [
    ("optimizer/index.json", "truncated", "optimizer", rf"\(the optimizer state index\) ends in the middle of its "
     rf"JSON .*{_TRUNCATED}"),
    ("optimizer/index.json", "binary", "optimizer", rf"\(the optimizer state index\) holds binary data.*{_NOT_OURS}"),
    ("optimizer/index.json", "a JSON list", "optimizer", rf"holds a JSON list where a dict belongs: {_NOT_OURS}"),
    ("optimizer/pp-00000.pt", "truncated", "optimizer", rf"\(optimizer state\) ends before its zip directory: "
     rf"{_TRUNCATED}"),
    ("optimizer/pp-00000.pt", "empty", "optimizer", rf"\(optimizer state\) is empty \(0 bytes\): {_TRUNCATED}"),
    ("optimizer/pp-00000.pt", "binary", "optimizer", rf"is no torch.save file .*: {_NOT_OURS}"),
    ("optimizer/pp-00000.pt", "a directory", "optimizer", r"is a directory, not a regular file"),
    ("scheduler.json", "empty", "scheduler", rf"\(the scheduler state\) is empty \(0 bytes\): {_TRUNCATED}"),
    ("scheduler.json", "a FIFO", "scheduler", r"is a FIFO \(named pipe\), not a regular file"),
    ("trainer_state.json", "truncated", "rng", rf"\(the trainer state\) ends in the middle of its JSON .*{_TRUNCATED}"),
    ("rng/rank-00000.safetensors", "truncated", "rng", r"is truncated \(expected \d+ bytes, found \d+\).*rng=False"),
    ("rng/rank-00000.safetensors", "binary", "rng", r"is truncated or its header is corrupted"),
    ("rng/rank-00000.safetensors", "a FIFO", "rng", r"is a FIFO \(named pipe\), not a regular file"),
    ("model.safetensors.index.json", "binary", "rng", rf"not a complete checkpoint: .* holds binary data.*{_NOT_OURS}"),
]


@pytest.mark.parametrize("name, damage, asked, said", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_damaged_training_state_file_is_named_with_what_is_wrong(saved, tmp_path, name, damage, asked, said):
    from hf_pipeline.checkpointing.training_state import load_training_state

    src, target, model = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(target, ckpt)
    path = ckpt / name
    _DAMAGE[damage](path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kwargs = {
        "optimizer": {"optimizer": opt, "rng": False},
        "scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), "rng": False},
        "rng": {},
    }[asked]
    with unblocked(path) if damage == "a FIFO" else contextlib.nullcontext(), pytest.raises(CheckpointError) as info:
        load_training_state(model, ckpt, **kwargs)
    message = str(info.value)
    assert path.name in message and str(path.parent) in message and re.search(said, message), message
    assert "could run code" not in message, message
    model.train_step(make_batch("llama", rows=4))  # the model stays usable


def _put(path: pathlib.Path, kind: str) -> None:
    path.unlink()
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")


_SAID = {"a FIFO": r"a FIFO \(named pipe\)", "a directory": "a directory", "a device": "a character device"}


@pytest.mark.parametrize(
    "name, kind",
    [
        ("a shard", "a FIFO"),
        ("a shard", "a directory"),
        ("a shard", "a device"),
        ("model.safetensors.index.json", "a FIFO"),
        ("config.json", "a FIFO"),
        ("generation_config.json", "a device"),
    ],
)
def test_a_file_that_is_not_regular_is_refused_by_name_not_read(saved, tmp_path, name, kind):
    src = saved[0]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    if name == "a shard":
        name = sorted(p.name for p in ckpt.glob("model-*.safetensors"))[1]
    path = ckpt / name
    _put(path, kind)
    with unblocked(path) if kind == "a FIFO" else contextlib.nullcontext():
        with pytest.raises(CheckpointError, match=rf"{path} \(.*\) is {_SAID[kind]}, not a regular file"):
            _load(ckpt)


def test_latest_checkpoint_skips_one_whose_index_is_a_fifo(saved, tmp_path):
    from hf_pipeline.checkpointing.directory import latest_checkpoint

    target = saved[1]
    shutil.copytree(target, tmp_path / "checkpoint-1")
    shutil.copytree(target, tmp_path / "checkpoint-2")
    index = tmp_path / "checkpoint-2" / "model.safetensors.index.json"
    _put(index, "a FIFO")
    with unblocked(index):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"


def test_the_trainers_resume_names_a_truncated_trainer_state_and_rng_file(saved, tmp_path):
    from hf_pipeline.integrations.trainer_checkpoints import reload_weights, restore_rng

    src, target, model = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(target, ckpt)
    _cut(ckpt / "trainer_state.json")  # transformers' TrainerState.load_from_json would raise a raw JSONDecodeError
    with pytest.raises(CheckpointError, match=rf"{ckpt / 'trainer_state.json'} \(the Trainer's state\) ends in the "):
        reload_weights(model, ckpt)
    _cut(ckpt / "rng" / "rank-00000.safetensors")
    with pytest.raises(CheckpointError, match=r"the RNG state rank-00000.safetensors in .*/rng is truncated"):
        restore_rng(model, ckpt)


def _one_rank_damaged(src: str, root: str) -> dict:
    """2 ranks: save, then rank 1's RNG file truncated, then the index of the optimizer state (read by both)."""
    import torch.distributed as dist

    from hf_pipeline.checkpointing.training_state import load_training_state
    from hf_pipeline.integrations.trainer_checkpoints import restore_rng

    model, opt, sched = _trained(src)
    ckpt = pathlib.Path(root) / "ckpt"
    model.save_pretrained(ckpt, optimizer=opt, scheduler=sched, step=1)
    rank = model.ctx.rank
    if rank == 1:
        _cut(ckpt / "rng" / "rank-00001.safetensors")
    dist.barrier()
    out = {}

    def attempt(name, call):
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = (type(e).__name__, str(e))

    attempt("restore_rng", lambda: restore_rng(model, ckpt))
    attempt("load_training_state", lambda: load_training_state(model, ckpt))
    dist.barrier()
    if rank == 0:
        _cut(ckpt / "optimizer" / "index.json")
    dist.barrier()
    attempt("optimizer index", lambda: load_training_state(model, ckpt, optimizer=opt, rng=False))
    out["loss"] = float(model.train_step(make_batch("llama", rows=4)))  # usable after: no rank is left behind
    return out


@pytest.mark.dist
def test_one_ranks_truncated_rng_file_fails_on_every_rank_naming_it(tmp_path):
    from harness import run_distributed

    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    results = run_distributed(_one_rank_damaged, 2, str(src), str(tmp_path), timeout=300)
    rng = tmp_path / "ckpt" / "rng"
    for call in ("restore_rng", "load_training_state"):
        assert results[1][call][0] == "CheckpointError", results[1][call]
        assert f"the RNG state rank-00001.safetensors in {rng} is truncated" in results[1][call][1]
        assert results[0][call] is not None, f"{call}: rank 0 went on while rank 1 failed"
        kind, message = results[0][call]
        assert kind == RankError.__name__ and "rank 1" in message and "rank-00001.safetensors" in message, message
        assert "truncated" in message, message
    index = tmp_path / "ckpt" / "optimizer" / "index.json"
    for r in (0, 1):
        kind, message = results[r]["optimizer index"]
        assert kind == "CheckpointError" and f"{index} (the optimizer state index) ends in the middle" in message, (
            r, kind, message)
    # one all-reduce gives every rank the last stage's loss (the others add 0): the same float, so the default
    # 1e-6 relative allows nothing real; a rank left behind on another batch differs by 1e-2 or more.
    assert results[0]["loss"] == pytest.approx(results[1]["loss"])
