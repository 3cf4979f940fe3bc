"""Checkpoints from anywhere: nothing read from one runs code, a save writes only inside its directory,
two saves into one directory do not mix, and another model's training state is refused at load.

Training state is stored as safetensors (RNG tables) and JSON (scheduler, index); a pickle that
would run code (``os.system`` through ``__reduce__``), put where an earlier version kept
``scheduler.pt``, ``rng/rank-*.pt`` or the optimizer state, is refused with a CheckpointError and
never executed (its marker file never appears). The saved state restores exactly: RNG draws,
scheduler and optimizer state equal the saved run's.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import random
import threading

import numpy as np
import pytest
import tiny
import torch
from tiny import make_batch

from hf_pipeline.errors import CheckpointError, CheckpointExistsError, InputError


def _load_1(path, **kwargs):
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", n_microbatches=2, **kwargs
    )


def _trained(src):
    model = _load_1(src)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model.train_step(make_batch("llama", rows=4))
    opt.step()
    sched.step()
    opt.zero_grad()
    return model, opt, sched


def _draws():
    return random.random(), torch.rand(3).tolist(), np.random.rand(2).tolist()


class _RunsCode:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("trust")
    src = tiny.make_checkpoint(root / "src", "llama")
    model, opt, sched = _trained(src)
    random.seed(3), torch.manual_seed(3), np.random.seed(3)
    random.gauss(0, 1)  # a cached Gaussian in Python's state
    target = root / "checkpoint-1"
    model.save_pretrained(target, optimizer=opt, scheduler=sched, step=1)
    return src, target, model, opt, sched, _draws()


def test_training_state_is_stored_without_pickles_and_restores_exactly(checkpoint):
    from hf_pipeline.checkpointing.training_state import load_training_state

    src, target, model, opt, sched, draws = checkpoint
    assert (target / "scheduler.json").is_file() and not (target / "scheduler.pt").exists()
    assert sorted(p.name for p in (target / "rng").iterdir()) == ["rank-00000.safetensors"]
    model2 = _load_1(target)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    random.seed(0), torch.manual_seed(0), np.random.seed(0)
    assert load_training_state(model2, target, optimizer=opt2, scheduler=sched2)["step"] == 1
    assert _draws() == draws, "the RNG states were not restored exactly"
    assert sched2.state_dict() == sched.state_dict()
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i, s in a["state"].items():
        for name, v in s.items():
            assert torch.equal(v, b["state"][i][name]), f"optimizer state {i}.{name} differs"


@pytest.mark.parametrize("where", ["scheduler.pt", "rng/rank-00000.pt", "optimizer/pp-00000.pt"])
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickle_that_runs_code_is_refused_not_run(checkpoint, tmp_path, where, how):
    import shutil

    from hf_pipeline.checkpointing.training_state import load_training_state

    src, target, model, *_ = checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(target, ckpt)
    marker = tmp_path / "code-ran"
    (ckpt / "scheduler.json").unlink()  # an earlier version's checkpoint: the pickles only
    (ckpt / "rng" / "rank-00000.safetensors").unlink()
    with open(ckpt / where, "wb") as f:
        if how == "pickle":
            pickle.dump({"state": _RunsCode(marker)}, f, protocol=2)
        else:
            torch.save({"state": _RunsCode(marker)}, f)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    kwargs = {"scheduler": sched} if where == "scheduler.pt" else {"optimizer": opt} if "optimizer" in where else {}
    refused = r"not loaded \(unpickling it could run code\): it names (posix|os|nt)\.system\. Re-save the checkpoint"
    with pytest.raises(CheckpointError, match=refused):
        load_training_state(model, ckpt, **kwargs)
    assert not marker.exists(), "loading the checkpoint ran code"


def test_earlier_versions_pickles_of_plain_data_still_load(checkpoint, tmp_path):
    import shutil

    from hf_pipeline.checkpointing.training_state import load_training_state

    src, target, model, opt, sched, _ = checkpoint
    ckpt = tmp_path / "old"
    shutil.copytree(target, ckpt)
    (ckpt / "scheduler.json").unlink()
    torch.save(sched.state_dict(), ckpt / "scheduler.pt")
    (ckpt / "rng" / "rank-00000.safetensors").unlink()
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, ckpt / "rng" / "rank-00000.pt")
    sched2 = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1e-3), lambda s: 1.0)
    load_training_state(model, ckpt, scheduler=sched2)
    assert sched2.state_dict() == sched.state_dict()


def test_scheduler_state_json_cannot_hold_is_refused_naming_its_key(tmp_path):
    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    model = _load_1(src)

    class TensorScheduler:
        def state_dict(self):
            return {"base_lrs": [0.1], "extra": {"warmup": torch.zeros(2)}}

    with pytest.raises(InputError, match=r"holds a Tensor under 'extra.warmup'.*JSON"):
        model.save_pretrained(tmp_path / "out", scheduler=TensorScheduler(), step=1)
    assert not (tmp_path / "out").exists(), "a refused save left its directory"


def test_another_models_training_state_is_refused_at_load_naming_key_and_shape(checkpoint, tmp_path):
    from hf_pipeline.checkpointing.training_state import load_training_state

    src, target, *_ = checkpoint
    wider = tiny.make_checkpoint(tmp_path / "wider", "llama", intermediate_size=48)
    model = _load_1(wider)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(
        CheckpointError,
        match=r"of another model: 'model.layers.0.mlp.gate_proj.weight' has 'exp_avg' of shape \[64, 32\] but the "
        r"parameter has shape \[48, 32\]",
    ):
        load_training_state(model, target, optimizer=opt)
    gpt2 = _load_1(tiny.make_checkpoint(tmp_path / "gpt2", "gpt2"))
    with pytest.raises(CheckpointError, match=r"of another model: it holds state for 'lm_head.weight'"):
        load_training_state(gpt2, target, optimizer=torch.optim.AdamW(gpt2.parameters(), lr=1e-3))
    model.train_step(make_batch("llama", rows=4))  # the model stays usable
    opt.step()


@pytest.mark.parametrize("link", ["optimizer", "rng"])
def test_save_never_writes_through_a_symlinked_subdirectory(checkpoint, tmp_path, link):
    src, target, model, opt, sched, _ = checkpoint
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / link).symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointExistsError, match=rf"{out / link} is a symbolic link .*writes only inside"):
        model.save_pretrained(out, optimizer=opt, step=1)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"], "the save wrote outside its directory"
    assert (out / link).is_symlink() and sorted(p.name for p in out.iterdir()) == [link]
    model.save_pretrained(out)  # no training state: the link is not written through, the save goes ahead
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


def test_second_save_into_a_directory_being_saved_is_refused_and_leaves_the_first_intact(checkpoint, tmp_path):
    import hf_pipeline.checkpointing.save as ckpt
    from hf_pipeline.checkpointing.directory import is_complete_checkpoint

    src, target, model, opt, sched, _ = checkpoint
    out = tmp_path / "out"
    first_holds_lock, second_done = threading.Event(), threading.Event()
    errors: dict[str, BaseException] = {}

    def hook(name):
        if name == "written" and threading.current_thread().name == "first":
            first_holds_lock.set()
            second_done.wait(60)

    def first():
        try:
            model.save_pretrained(out, optimizer=opt, step=1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors["first"] = e

    ckpt.save_phase_hook = hook
    try:
        t = threading.Thread(target=first, name="first")
        t.start()
        assert first_holds_lock.wait(60)
        staging = [p.name for p in out.iterdir() if p.name.startswith(".hf_pipeline.tmp-")]
        try:
            with pytest.raises(CheckpointExistsError, match=rf"another save_pretrained into {out} is running \(pid "):
                model.save_pretrained(out, optimizer=opt, step=2)
            assert [p.name for p in out.iterdir() if p.name.startswith(".hf_pipeline.tmp-")] == staging
        finally:
            second_done.set()
            t.join(60)
    finally:
        ckpt.save_phase_hook = None
    assert not errors, errors
    assert is_complete_checkpoint(out) and json.loads((out / "trainer_state.json").read_text())["step"] == 1
    assert not (out / ".hf_pipeline.lock").exists(), "the lock was not removed at the end of the save"


def test_a_dead_saves_lock_is_taken_over_and_a_live_ones_refuses(checkpoint, tmp_path):
    import socket

    src, target, model, *_ = checkpoint
    out = tmp_path / "out"
    out.mkdir()
    dead_pid = int(pathlib.Path("/proc/sys/kernel/pid_max").read_text())  # pids stay below it: never a live one
    lock = out / ".hf_pipeline.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid, "save": "0123456789ab"}))
    model.save_pretrained(out)  # a killed save's lock: taken over
    assert not lock.exists()
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "save": "0123456789ab"}))
    elsewhere = rf"{lock} says .* pid 1 on host elsewhere .* delete {lock} and save again"
    with pytest.raises(CheckpointExistsError, match=elsewhere):
        model.save_pretrained(out)
    assert lock.exists(), "another save's lock was removed"


def _racing_job(src: str, root: str):
    """One of two independent single-process jobs saving into the same directory at once."""
    import time

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)  # two separate jobs, not two ranks of one
    me = os.getpid()
    model, opt, sched = _trained(src)
    root = pathlib.Path(root)
    (root / f"ready-{me}").touch()
    deadline = time.monotonic() + 120
    while len(list(root.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    outcomes = []
    for step in range(8):
        try:
            model.save_pretrained(root / "shared", optimizer=opt, scheduler=sched, step=step)
            outcomes.append("saved")
        except CheckpointExistsError as e:
            assert "another save_pretrained into" in str(e), e
            outcomes.append("refused")
        except Exception as e:  # noqa: BLE001 - any other error is the failure tested for
            outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes


@pytest.mark.dist
def test_two_jobs_saving_into_one_directory_at_once(tmp_path):
    from harness import run_distributed

    from hf_pipeline.checkpointing.directory import is_complete_checkpoint
    from hf_pipeline.checkpointing.training_state import load_training_state

    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    results = run_distributed(_racing_job, 2, str(src), str(tmp_path), timeout=300)
    bad = [o for r in results for o in r if o not in ("saved", "refused")]
    assert not bad, bad
    assert any(o == "saved" for r in results for o in r), results
    shared = tmp_path / "shared"
    assert is_complete_checkpoint(shared) and not (shared / ".hf_pipeline.lock").exists()
    assert not [p.name for p in shared.iterdir() if p.name.startswith(".hf_pipeline")], "a staging directory was left"
    model = _load_1(shared)
    load_training_state(model, shared, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))


def test_a_load_racing_a_save_says_the_checkpoint_changed(checkpoint, tmp_path, monkeypatch):
    import shutil

    import hf_pipeline.checkpointing.training_state as ts
    from hf_pipeline.checkpointing.training_state import load_training_state

    src, target, model, opt, sched, _ = checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(target, ckpt)
    real = ts._load_optimizer

    def save_meanwhile(model_, optimizer, directory):  # another job's save lands while this load reads
        real(model_, optimizer, directory)
        model.save_pretrained(ckpt, optimizer=opt, step=5)

    monkeypatch.setattr(ts, "_load_optimizer", save_meanwhile)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match=rf"{ckpt} changed while its training state was read: a save_pretrained"):
        load_training_state(model, ckpt, optimizer=opt2)
    monkeypatch.undo()
    assert load_training_state(model, ckpt, optimizer=opt2)["step"] == 5  # read again once the save finished
    # a save running (its lock held) when the training state and the index disagree: the same message
    (ckpt / ".hf_pipeline.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "save": "0123456789ab"}))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "hf_pipeline_save_id": "0123456789ab"}))
    with pytest.raises(CheckpointError, match="changed while its training state was read"):
        load_training_state(model, ckpt, optimizer=opt2)


def test_an_earlier_versions_numpy_rng_pickle_is_refused_with_a_way_out(checkpoint, tmp_path):
    import shutil

    from hf_pipeline.checkpointing.training_state import load_training_state

    src, target, model, *_ = checkpoint
    ckpt = tmp_path / "old"
    shutil.copytree(target, ckpt)
    (ckpt / "rng" / "rank-00000.safetensors").unlink()
    old_state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    torch.save(old_state, ckpt / "rng" / "rank-00000.pt")  # what earlier versions wrote: an ndarray inside
    with pytest.raises(CheckpointError, match=r"it names numpy\..*Re-save the checkpoint .*, or pass rng=False"):
        load_training_state(model, ckpt)
    assert load_training_state(model, ckpt, rng=False)["step"] == 1
