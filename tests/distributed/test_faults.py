"""Faults in the middle of a pipelined call: a rank killed, raising or hanging; nobody hangs, the culprit is named.

Each case loads a tiny LLaMA on 2 or 3 gloo ranks, runs the call once cleanly (so the runtime and
its P2P buffers exist), then arms a fault on one rank through a forward pre-hook on its stage: it
fires on the n-th stage call, i.e. in the middle of a training step (1F1B over 4 microbatches) or
in the middle of decoding. The surviving ranks must raise within seconds (well below the
collective timeout the case sets) an error that names the failing rank and its stage. After a
rank died or hung, a later call must fail at once (``PipelineBroken``) instead of hanging; after a
rank raised (every process alive) the later call runs (``test_survive.py`` compares its numbers).

Checkpoint faults (killed during ``save_pretrained``, resume) are at the end of this file.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest
import tiny
import torch
from harness import run_distributed

# Far above what detection takes (< 5 s) and far below the harness timeout: a survivor that only
# gave up because of the collective timeout would show it in its elapsed time.
_TIMEOUT_S = 60
_FAST_S = 15.0


class Observed(Exception):
    """Raised by a surviving rank to report what it saw: a failed rank makes the harness stop waiting
    for ranks still hanging (after ``failure_grace``) instead of waiting out the whole timeout."""


def _arm(model, action: str, at_call: int) -> None:
    """Make this rank's first stage do ``action`` on its ``at_call``-th call from now."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] != at_call:
            return None
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "hang":
            time.sleep(3600)
        raise ValueError("labels hold token id 977 but the vocabulary has 96 entries (found on the last stage)")

    model.stages[0].register_forward_pre_hook(hook, with_kwargs=True)


def _call(model, what: str):
    if what == "train":
        batch = tiny.sample_inputs("llama", batch=4, seq=9)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return model.train_step(batch)
    if what == "generate":
        inputs = tiny.sample_inputs("llama", batch=4, seq=6)
        return model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return model(**tiny.sample_inputs("llama", batch=4, seq=9)).logits


def _fault(path: str, what: str, victim: int, action: str, at_call: int):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", n_microbatches=4, progress=False
    )
    _call(model, what)  # cleanly once: the runtime exists, the fault hits a warm pipeline
    if model.ctx.rank == victim:
        _arm(model, action, at_call)
    start = time.monotonic()
    try:
        _call(model, what)
    except Exception as e:  # noqa: BLE001 - what this test is about
        first = {"type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start,
                 "cls": type(e), "failures": getattr(e, "failures", None)}
    else:
        return {"type": None}
    start = time.monotonic()
    try:
        _call(model, what)
        later = None
    except Exception as e:  # noqa: BLE001
        later = {"type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start}
    raise Observed({**first, "later": later})


def _observed(results):
    return [r.args[0] if isinstance(r, Observed) else r for r in results]


@pytest.mark.dist
@pytest.mark.parametrize(
    "what,world,victim,at_call",
    [("train", 3, 1, 2), ("generate", 2, 0, 5)],
    ids=["train-3ranks-kill-middle", "generate-kill-first-stage"],
)
def test_killed_rank_is_named_by_every_survivor(tmp_path, what, world, victim, at_call):
    from hf_pipeline.errors import RankError

    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = _observed(run_distributed(
        _fault, world, str(path), what, victim, "kill", at_call, timeout=120, return_exceptions=True,
        env={"HF_PIPELINE_TIMEOUT": str(_TIMEOUT_S)}, failure_grace=60,
    ))
    assert "died with exit code -9" in str(results[victim])
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(res, dict) and res["type"] == "RankError", (rank, res)
        assert issubclass(res["cls"], RankError)
        assert res["message"].startswith(f"rank {victim} (stage {victim}) stopped answering during "), res["message"]
        assert res["elapsed"] < _FAST_S, f"rank {rank} took {res['elapsed']:.1f} s to notice"
        assert list(res["failures"]) == [victim]
        if victim == 0:  # under plain env:// init rank 0 also hosted the rendezvous store
            assert "The rendezvous store is unreachable too" in res["message"]
        assert res["later"]["type"] == "PipelineBroken" and res["later"]["elapsed"] < 1.0
        assert "restart the job" in res["later"]["message"]


@pytest.mark.dist
@pytest.mark.parametrize(
    "what,label,at_call",
    [("train", "a training step", 2), ("generate", "generate", 3)],
    ids=["train", "generate"],
)
def test_rank_that_raises_mid_step_reaches_every_rank_with_its_message(tmp_path, what, label, at_call):
    # The last of 3 stages raises inside a training step (its 2nd microbatch) or in the middle of
    # decoding (its 3rd call: after prefill and a decode step): rank 1 waits on it directly, rank 0
    # only through rank 1. Both must get the original message.
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    original = "labels hold token id 977 but the vocabulary has 96 entries (found on the last stage)"
    results = _observed(run_distributed(
        _fault, 3, str(path), what, 2, "raise", at_call, timeout=120, return_exceptions=True,
        env={"HF_PIPELINE_TIMEOUT": str(_TIMEOUT_S)},
    ))
    assert results[2]["type"] == "ValueError" and results[2]["message"] == original  # its own error, unwrapped
    for rank in (0, 1):
        res = results[rank]
        assert res["type"] == "RankError", res
        expected = f"rank 2 (stage 2) failed during {label}: ValueError: {original}"
        assert res["message"].startswith(expected), res["message"]
        assert res["failures"] == {2: ("ValueError", original, "stage 2")}
    for rank, res in enumerate(results):
        assert res["elapsed"] < _FAST_S, f"rank {rank} took {res['elapsed']:.1f} s"
        assert res["later"] is None, res["later"]  # every rank is alive: the groups were renewed, the next call runs


@pytest.mark.dist
def test_hanging_rank_is_named_after_the_collective_timeout(tmp_path):
    # A rank that neither dies nor answers: the survivors wait out HF_PIPELINE_TIMEOUT (4 s here),
    # not torch's 30 minutes, then name it. The harness kills the hung rank afterwards.
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = _observed(run_distributed(
        _fault, 2, str(path), "forward", 1, "hang", 2, timeout=120, return_exceptions=True,
        env={"HF_PIPELINE_TIMEOUT": "4"}, failure_grace=3,
    ))
    res = results[0]
    assert isinstance(res, dict) and res["type"] == "RankError", res
    assert res["message"].startswith("rank 1 (stage 1) stopped answering during a forward pass"), res["message"]
    assert "collective timeout 4 s" in res["message"]
    assert 3.5 < res["elapsed"] < 4 + _FAST_S
    assert isinstance(results[1], TimeoutError)  # still hanging when the harness gave up on it


# --------------------------------------------------------------------------- checkpoints under faults
_STEPS = 6
_SAVED_AT = 3


def _train_batch(step: int) -> dict[str, torch.Tensor]:
    batch = tiny.sample_inputs("llama", batch=4, seq=9, seed=100 + step)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def _new_run(path: str):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", n_microbatches=2, progress=False
    )
    model.train()  # attention dropout 0.1 in this checkpoint: the RNG state must survive the crash too
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _steps(model, opt, sched, steps) -> list[float]:
    losses = []
    for step in steps:
        losses.append(float(model.train_step(_train_batch(step))))
        model.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def _kill_while_saving(module, original_save_file):
    """save_file that writes half of its shard, then SIGKILLs this process (a crash mid-write)."""

    def save_file(tensors, filename, metadata=None):
        data = module.save(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    return save_file


def _crashing_run(path: str, root: str):
    import safetensors.torch

    torch.manual_seed(0)
    model, opt, sched = _new_run(path)
    losses = _steps(model, opt, sched, range(1, _SAVED_AT + 1))
    model.save_pretrained(
        pathlib.Path(root) / f"checkpoint-{_SAVED_AT}", optimizer=opt, scheduler=sched, step=_SAVED_AT
    )
    losses += _steps(model, opt, sched, range(_SAVED_AT + 1, _STEPS))
    if model.ctx.rank == 1:
        safetensors.torch.save_file = _kill_while_saving(safetensors.torch, safetensors.torch.save_file)
    start = time.monotonic()
    try:
        model.save_pretrained(
            pathlib.Path(root) / f"checkpoint-{_STEPS - 1}", optimizer=opt, scheduler=sched, step=_STEPS - 1
        )
    except Exception as e:  # noqa: BLE001
        raise Observed(
            {"losses": losses, "type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start}
        ) from None
    return {"losses": losses, "type": None}


def _resume_run(path: str, root: str):
    from hf_pipeline.checkpointing.directory import latest_checkpoint
    from hf_pipeline.checkpointing.training_state import load_training_state

    torch.manual_seed(0)
    model, opt, sched = _new_run(path)
    uninterrupted = _steps(model, opt, sched, range(1, _STEPS + 1))
    latest = latest_checkpoint(root)
    model, opt, sched = _new_run(str(latest))
    state = load_training_state(model, latest, optimizer=opt, scheduler=sched)
    resumed = _steps(model, opt, sched, range(state["step"] + 1, _STEPS + 1))
    return {"uninterrupted": uninterrupted, "latest": str(latest), "step": state["step"], "resumed": resumed}


@pytest.mark.dist
def test_killed_during_save_then_resume_gives_the_same_loss_curve(tmp_path):
    # Run 1 saves checkpoint-3, trains on, and rank 1 is SIGKILLed half way through writing its shard
    # of checkpoint-5. Run 2 (new processes, as after a restart) resumes from the latest complete
    # checkpoint; its losses must be those of an uninterrupted run, bit for bit (CPU, same world size).
    import transformers

    from hf_pipeline.checkpointing.directory import is_complete_checkpoint, latest_checkpoint

    path = tiny.make_checkpoint(tmp_path / "llama", "llama", attention_dropout=0.1)
    root = tmp_path / "run"
    crashed = _observed(run_distributed(
        _crashing_run, 2, str(path), str(root), timeout=180, return_exceptions=True,
        env={"HF_PIPELINE_TIMEOUT": str(_TIMEOUT_S)},
    ))
    assert "died with exit code -9" in str(crashed[1])
    res = crashed[0]
    assert isinstance(res, dict) and res["type"] == "RankError", res
    assert res["message"].startswith("rank 1 (stage 1) stopped answering during save_pretrained"), res["message"]
    assert res["elapsed"] < _FAST_S

    # The crash left no complete checkpoint-5; checkpoint-3 is untouched and is what resume picks.
    assert not is_complete_checkpoint(root / f"checkpoint-{_STEPS - 1}")
    leftovers = [p.name for p in root.iterdir() if p.name != f"checkpoint-{_SAVED_AT}"]
    assert all(not is_complete_checkpoint(root / name) for name in leftovers), leftovers
    assert latest_checkpoint(root) == root / f"checkpoint-{_SAVED_AT}"
    # loads: no missing/corrupt shard
    transformers.AutoModelForCausalLM.from_pretrained(root / f"checkpoint-{_SAVED_AT}")

    resumed = run_distributed(_resume_run, 2, str(path), str(root), timeout=180)
    for rank, run in enumerate(resumed):
        assert run["latest"] == str(root / f"checkpoint-{_SAVED_AT}") and run["step"] == _SAVED_AT
        assert run["uninterrupted"][: _STEPS - 1] == res["losses"], (
            f"rank {rank}: the crashed run diverged before the crash"
        )
        assert run["resumed"] == run["uninterrupted"][_SAVED_AT:], (
            f"rank {rank}: resumed losses {run['resumed']} != uninterrupted {run['uninterrupted'][_SAVED_AT:]}"
        )
    assert len(set(resumed[0]["uninterrupted"])) == _STEPS  # the curve moves: the comparison means something


# --------------------------------------------------------------------------- pieces, in one process
def test_communication_errors_are_told_from_local_ones():
    import torch.distributed as dist

    from hf_pipeline.distributed.faults import PipelineBroken, _original, is_communication_error

    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.250.0.2]:4021"
    )
    assert is_communication_error(gloo)
    assert is_communication_error(
        RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    )
    assert is_communication_error(dist.DistNetworkError("store"))
    assert is_communication_error(PipelineBroken("earlier failure"))
    assert not is_communication_error(ValueError("labels shape (2, 7) does not match input_ids (2, 9)"))
    assert not is_communication_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x32)"))

    # torch.distributed.pipelining wraps a stage's exception; the stage's own one is what is reported
    cause = ValueError("the original")
    try:
        try:
            raise cause
        except ValueError as e:
            raise RuntimeError("\n  [Stage 2] failed to run forward:\n  args: (...)") from e
    except RuntimeError as wrapped:
        assert _original(wrapped) is cause
    plain = RuntimeError("[Stage 2] failed to run forward")  # no cause: kept as is
    assert _original(plain) is plain


def test_spread_failures_is_transparent_for_one_process():
    from hf_pipeline.distributed.context import init_distributed
    from hf_pipeline.distributed.faults import spread_failures

    ctx = init_distributed(device="cpu")
    with pytest.raises(KeyError, match="no such layer"):
        with spread_failures(ctx, "a forward pass"):
            raise KeyError("no such layer")
    with spread_failures(ctx, "a forward pass"):
        pass


def test_recovery_waits_for_every_rank_at_most_the_timeout_else_the_groups_stay_stopped(monkeypatch):
    import datetime

    import torch.distributed as dist

    from hf_pipeline.distributed import faults
    from hf_pipeline.distributed.context import RankContext

    store = dist.HashStore()
    monkeypatch.setattr(faults, "default_store", lambda: store)
    monkeypatch.setattr(faults, "_STATE", faults._FaultState())
    ctx = RankContext(
        rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"), backend="gloo",
        group=None, timeout=datetime.timedelta(seconds=0.3),
    )
    renewed = []
    # The peer never comes (it died after the culprit's record): bounded by the timeout, then PipelineBroken.
    faults._STATE.stop("rank 1 (stage 1) failed during a forward pass: ValueError: x.")
    error = ValueError("x")
    start = time.monotonic()
    faults._recover(ctx, lambda: renewed.append(1), error)
    assert 0.3 <= time.monotonic() - start < 5.0
    assert not renewed and faults._STATE.broken is not None
    assert "1 of 2 ranks came to recover within the collective timeout 0.3 s" in error.__notes__[-1]
    assert "restart the job" in error.__notes__[-1]
    # Every rank comes (the peer reached the next rendezvous first): the groups are renewed, calls run again.
    store.add("hf_pipeline/faults/recover1", 1)
    error = ValueError("y")
    faults._recover(ctx, lambda: renewed.append(1), error)
    assert renewed == [1] and faults._STATE.broken is None
    assert "the process groups were made afresh" in error.__notes__[-1]
