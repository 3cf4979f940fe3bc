"""Rank context, error agreement and the shared harness (hf_pipeline/distributed/{context,agreement,shutdown}.py,
tests/harness.py).

Single-process tests run in this process; multi-rank ones go through ``run_distributed`` on gloo.
Every spawned rank imports this module, so hf_pipeline (whose package import pulls in
transformers, ~1.5 s) is imported inside the functions that need it: the harness's own tests then
start ranks with torch alone. Durations are bounded on the harness's ``last_run_timing()``, which
leaves out spawning the ranks and importing torch, so a loaded machine does not fail them.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
from harness import ChildFailed, expect_errors, last_run_timing, run_distributed

DEFAULT_TIMEOUT_S = 300.0  # the documented default (hf_pipeline.distributed.context.DEFAULT_TIMEOUT_S, checked below)

_LAUNCH_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HF_PIPELINE_TIMEOUT",
)
_FAST = 15  # s: the call, far below the 300 s collective timeout; start-up is not counted (see _fast)


def _fast() -> bool:
    """Whether the latest harness run was quick: ``_FAST`` plus its start-up time again, since the ranks
    import hf_pipeline (transformers) inside the call, which costs about what importing torch did."""
    timing = last_run_timing()
    return timing.run_s < _FAST + timing.startup_s


def _group_timeout_s(group) -> float:
    from hf_pipeline.compat import group_timeout

    return group_timeout(group, torch.device("cpu")).total_seconds()


def _rank() -> int:
    return int(os.environ["RANK"])


# --------------------------------------------------------------------------- single process


@pytest.fixture
def single_process(monkeypatch):
    for name in _LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def test_single_process_context(single_process):
    from hf_pipeline.distributed import context as hd

    assert hd.DEFAULT_TIMEOUT_S == DEFAULT_TIMEOUT_S
    ctx = hd.init_distributed(device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (0, 1, 0, 1)
    assert ctx.device == torch.device("cpu")
    assert ctx.backend == "none" and ctx.group is None
    assert ctx.is_main_process and ctx.is_last_process and not ctx.is_distributed
    assert not dist.is_initialized()  # no group for one process
    assert ctx.timeout == datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    assert hd.get_rank_context() is ctx
    ctx.barrier()
    hd.destroy_distributed()
    assert hd._CONTEXT is None


def test_single_process_helpers_are_noops(single_process):
    from hf_pipeline.distributed.agreement import check_same_on_all_ranks, collective_errors, raise_on_any_rank
    from hf_pipeline.distributed.context import init_distributed

    ctx = init_distributed(device="cpu")
    raise_on_any_rank(ctx, None, what="nothing")
    with collective_errors(ctx, "nothing"):
        pass
    check_same_on_all_ranks(ctx, "x", torch.arange(3))
    with pytest.raises(KeyError, match="own error"):  # the local error, unchanged
        with collective_errors(ctx, "a step"):
            raise KeyError("own error")


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e30", "-5", "0", "abc", "604801"])
def test_unusable_timeout_env_names_the_variable_and_the_range(single_process, monkeypatch, raw):
    from hf_pipeline.distributed.context import init_distributed
    from hf_pipeline.errors import InputError

    monkeypatch.setenv("HF_PIPELINE_TIMEOUT", raw)
    with pytest.raises(InputError) as info:
        init_distributed(device="cpu")
    assert str(info.value) == (
        f"HF_PIPELINE_TIMEOUT={raw!r} is not a usable timeout: it must be a positive, finite number of seconds, "
        "at most 604800 (a week); e.g. HF_PIPELINE_TIMEOUT=600"
    )


@pytest.mark.parametrize("given", [float("nan"), float("inf"), 1e30, -1.0, "300", True])
def test_unusable_timeout_argument_is_refused(single_process, given):
    from hf_pipeline.distributed.context import init_distributed
    from hf_pipeline.errors import InputError

    with pytest.raises(InputError, match=r"^timeout=.* is not a usable timeout: .* e\.g\. timeout=300$"):
        init_distributed(device="cpu", timeout=given)


@pytest.mark.parametrize("raw,seconds", [("42", 42.0), (" 0.5 ", 0.5), ("604800", 604800.0), ("", 300.0)])
def test_usable_timeout_env_still_works(single_process, monkeypatch, raw, seconds):
    from hf_pipeline.distributed.context import init_distributed

    monkeypatch.setenv("HF_PIPELINE_TIMEOUT", raw)
    assert init_distributed(device="cpu").timeout.total_seconds() == seconds
    assert init_distributed(device="cpu", timeout=datetime.timedelta(minutes=2)).timeout.total_seconds() == 120


def test_thread_env_and_bad_settings(single_process, monkeypatch):
    from hf_pipeline.distributed.context import init_distributed

    threads = torch.get_num_threads()
    monkeypatch.setenv("HF_PIPELINE_THREADS", "1")
    try:
        init_distributed(device="cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    monkeypatch.delenv("HF_PIPELINE_THREADS")
    monkeypatch.setenv("HF_PIPELINE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HF_PIPELINE_TIMEOUT"):
        init_distributed(device="cpu")
    monkeypatch.delenv("HF_PIPELINE_TIMEOUT")
    with pytest.raises(ValueError, match="positive"):
        init_distributed(device="cpu", timeout=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        init_distributed(device="cpu")


def test_fingerprint_sees_small_and_large_changes():
    from hf_pipeline.distributed.agreement import fingerprint

    fp = lambda v: fingerprint(v)[0]  # noqa: E731
    a = torch.arange(16, dtype=torch.int64).reshape(2, 8)
    assert fp(a) == fp(a.clone())
    assert fp(a) != fp(a.flip(1))  # same sum, other order
    assert fp(a) != fp(a.to(torch.int32))
    assert fp({"input_ids": a, "n": 3}) == fp({"n": 3, "input_ids": a.clone()})
    assert fp(torch.ones(3, dtype=torch.bfloat16)) != fp(torch.ones(3))
    big = torch.zeros(1 << 19)  # 2 MiB: the cheap checksum path
    changed = big.clone()
    changed[len(big) // 2] = 1.0  # in the middle: only the full-length sum sees it
    assert fp(big) == fp(big.clone()) and fp(big) != fp(changed)


# --------------------------------------------------------------------------- multi-rank


def _context_facts():
    from hf_pipeline.distributed.context import get_rank_context, init_distributed

    ctx = init_distributed()
    ctx.barrier()
    sub = dist.new_group(list(range(ctx.world_size)))
    sub_default = _group_timeout_s(sub)  # torch's default for new groups, not ours
    ctx.apply_timeout(sub)
    again = init_distributed()  # reuses the group we made, keeps its timeout
    assert get_rank_context() is again and again.group is ctx.group
    return {
        "rank": ctx.rank, "world": ctx.world_size, "local": (ctx.local_rank, ctx.local_world_size),
        "device": str(ctx.device), "backend": ctx.backend, "main": ctx.is_main_process,
        "last": ctx.is_last_process, "dist": ctx.is_distributed, "threads": torch.get_num_threads(),
        "timeouts": (_group_timeout_s(ctx.group), ctx.timeout.total_seconds(), _group_timeout_s(sub),
                     again.timeout.total_seconds()),
        "sub_default": sub_default, "tensor": torch.full((2,), float(ctx.rank)),
    }


@pytest.mark.dist
@pytest.mark.parametrize(
    "world, env, timeout_s",
    [(2, {"HF_PIPELINE_TIMEOUT": "42"}, 42.0), (3, {}, DEFAULT_TIMEOUT_S)],
    ids=["2ranks-env-timeout", "3ranks-default-timeout"],
)
def test_context_on_every_rank(world, env, timeout_s):
    results = run_distributed(_context_facts, world, env=env)
    for rank, facts in enumerate(results):
        assert facts["rank"] == rank and facts["world"] == world
        assert facts["local"] == (rank, world)
        assert facts["device"] == "cpu" and facts["backend"] == "gloo" and facts["dist"]
        assert facts["main"] == (rank == 0) and facts["last"] == (rank == world - 1)
        assert facts["threads"] == 1
        # group, context, subgroup after apply_timeout, reused context: ours, not torch's 30 min
        assert facts["timeouts"] == (timeout_s,) * 4
        assert facts["sub_default"] == 1800  # why apply_timeout exists
        assert torch.equal(facts["tensor"], torch.full((2,), float(rank)))  # tensors come back, in rank order


def _load_bad_shard():
    raise ValueError("shard model-00002 has shape (3, 4), expected (4, 4)")


def _agreements():
    """Three collective steps; what each raised, per rank: rank 1 fails, nobody fails, everyone fails."""
    import traceback

    from hf_pipeline.distributed.agreement import collective_errors, raise_on_any_rank
    from hf_pipeline.distributed.context import init_distributed

    ctx = init_distributed()
    caught = {}
    try:
        with collective_errors(ctx, "loading weights", label=f"stage {ctx.rank}"):
            if ctx.rank == 1:
                _load_bad_shard()
    except Exception as e:  # noqa: BLE001 - returned for the test to inspect
        caught["one"] = (e, "".join(traceback.format_exception(e)))
    with collective_errors(ctx, "a step that works"):
        pass
    raise_on_any_rank(ctx, None, what="nothing")
    try:
        raise_on_any_rank(ctx, KeyError(f"missing on rank {ctx.rank}"), what="reading the index")
    except KeyError as e:
        caught["all"] = e
    return caught


@pytest.mark.dist
def test_errors_agreed_on_every_rank():
    from hf_pipeline.errors import RankError

    results = run_distributed(_agreements, 3)
    assert _fast(), last_run_timing()
    own, tb = results[1]["one"]
    assert type(own) is ValueError and "expected (4, 4)" in str(own)  # rank 1 keeps its own error
    assert "_load_bad_shard" in tb  # ... and its original traceback
    for rank in (0, 2):
        err, _ = results[rank]["one"]
        assert isinstance(err, RankError) and isinstance(err, RuntimeError)
        assert err.rank == 1 and err.ranks == (1,) and err.original_type == "ValueError"
        assert str(err).startswith("rank 1 (stage 1) failed while loading weights: ValueError: shard model-00002")
    for rank, result in enumerate(results):  # everyone failed: each keeps its error, notes name the others
        err = result["all"]
        assert f"missing on rank {rank}" in str(err)
        notes = "\n".join(err.__notes__)
        assert all(f"rank {r} failed while reading the index" in notes for r in range(3) if r != rank)


def _check_inputs(bad_rank: int):
    from hf_pipeline.distributed.agreement import check_same_on_all_ranks
    from hf_pipeline.distributed.context import init_distributed

    ctx = init_distributed()
    ids = torch.arange(12).reshape(2, 6)
    check_same_on_all_ranks(ctx, "model inputs", {"input_ids": ids, "attention_mask": torch.ones_like(ids), "n": 4})
    if ctx.rank == bad_rank:
        ids = ids.flip(0)
    check_same_on_all_ranks(ctx, "input_ids", ids)


@pytest.mark.dist
def test_check_same_on_all_ranks_mismatch_raises_everywhere():
    from hf_pipeline.errors import InputError

    errors = expect_errors(_check_inputs, 2, 1)
    assert _fast(), last_run_timing()
    for err in errors:
        assert type(err) is InputError and isinstance(err, ValueError)  # the library's ValueError
        msg = str(err)
        assert msg.startswith("input_ids must be the same on every rank")
        assert "rank 0: Tensor(shape=(2, 6), dtype=torch.int64" in msg and "rank 1: Tensor" in msg


def _dead_peer():
    from hf_pipeline.distributed.agreement import collective_errors
    from hf_pipeline.distributed.context import init_distributed

    ctx = init_distributed()
    ctx.barrier()
    if ctx.rank == 1:
        os._exit(3)  # crash without a word: no exception, no agreement
    with collective_errors(ctx, "loading weights"):
        pass


@pytest.mark.dist
def test_dead_peer_is_an_error_not_a_hang():
    errors = expect_errors(_dead_peer, 2, env={"HF_PIPELINE_TIMEOUT": "10"})
    assert _fast(), last_run_timing()
    assert isinstance(errors[0], Exception) and not isinstance(errors[0], TimeoutError)
    assert "died with exit code 3" in str(errors[1])


def _join_timed():
    from hf_pipeline.distributed.context import init_distributed

    start = time.monotonic()
    try:
        init_distributed(device="cpu")
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "", time.monotonic() - start


@pytest.mark.dist
def test_master_port_in_use_is_an_error_on_every_rank_within_the_timeout():
    # Another program listens on MASTER_PORT: rank 0 cannot host the store there, and rank 1's
    # client connects to that program and waits for an answer that never comes (torch's own
    # timeout does not bound that wait): both must raise the library's error, bounded by ours.
    import socket

    timeout_s = 10
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(8)
        port = holder.getsockname()[1]
        results = run_distributed(
            _join_timed, 2, timeout=120, failure_grace=120,
            env={"MASTER_PORT": str(port), "HF_PIPELINE_TIMEOUT": str(timeout_s)},
        )
    kind, message, elapsed = results[0]
    assert kind == "InputError", results[0]
    assert message.startswith(f"rank 0 cannot host the job's rendezvous store: MASTER_PORT={port} is already in use")
    assert "pick a free port" in message
    kind, message, elapsed = results[1]
    assert kind == "InputError", results[1]
    assert message.startswith(
        f"rank 1 could not join the job's rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} within 10 s"
    ), message
    assert "HF_PIPELINE_TIMEOUT" in message
    assert elapsed < 2 * timeout_s + 2, f"rank 1 took {elapsed:.1f} s"


# --------------------------------------------------------------------------- the harness itself


def _sleep_on_rank1():
    if _rank() == 1:
        time.sleep(10_000)
    return "done"


@pytest.mark.dist
def test_harness_kills_a_hanging_rank():
    # The 5 s start once both ranks are up, however long spawning and importing torch took.
    with pytest.raises(ChildFailed, match=r"rank 1 timed out after 5 s") as info:
        run_distributed(_sleep_on_rank1, 2, timeout=5)
    assert 5 <= last_run_timing().run_s < 5 + 5, last_run_timing()  # killed at its timeout, not after the sleep
    assert "rank 0" not in str(info.value)  # rank 0 finished; only rank 1 is reported


def _a_distinctive_helper():
    raise KeyError("no such layer: model.layers.9")


def _raise_on_rank0_sleep_on_rank1():
    if _rank() == 0:
        _a_distinctive_helper()
    time.sleep(10_000)


@pytest.mark.dist
def test_harness_shows_child_traceback_and_stops_peers_early():
    with pytest.raises(ChildFailed) as info:
        run_distributed(_raise_on_rank0_sleep_on_rank1, 2, timeout=60, failure_grace=2)
    # not the 60 s timeout: the peer got 2 s after rank 0 failed
    assert last_run_timing().run_s < 2 + 5, last_run_timing()
    msg = str(info.value)
    assert "rank 0 raised KeyError: 'no such layer: model.layers.9'" in msg
    assert "_a_distinctive_helper" in msg and "Traceback" in msg
    assert "rank 1 was still running 2 s after rank 0 failed" in msg


@pytest.mark.dist
def test_harness_rejects_unpicklable_functions():
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(lambda: 0, 2)


# ------------------------------------------------------------------------------------ exit
def test_settle_waits_for_a_busy_thread_and_returns_at_once_when_idle():
    import threading

    from hf_pipeline.distributed.shutdown import settle_threads

    stop = time.monotonic() + 0.4
    spinner = threading.Thread(target=lambda: [None for _ in iter(lambda: time.monotonic() < stop, False)])
    t = time.monotonic()
    spinner.start()
    settle_threads(timeout=5.0)
    assert not spinner.is_alive() or time.monotonic() >= stop - 0.01  # it waited for the running thread
    assert time.monotonic() - t >= 0.3
    spinner.join()
    t = time.monotonic()
    settle_threads(timeout=5.0)
    assert time.monotonic() - t < 0.25  # nothing runs: two idle looks, a few ms


_EXIT_RACE = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from hf_pipeline.distributed.context import init_distributed
init_distributed(device="cpu")
for _ in range(2000):  # still in the group's worker threads when the script ends
    dist.broadcast(torch.ones(1000), 0, async_op=True)
"""


@pytest.mark.dist
def test_script_ending_with_collectives_in_flight_exits_cleanly(tmp_path):
    # Without the exit handler about a third to a half of these runs abort ("terminate called without an active
    # exception"): a gloo worker releases a tensor while the interpreter finalizes.
    import subprocess
    import sys

    from torch.distributed.elastic.utils.distributed import get_free_port

    script = tmp_path / "race.py"
    script.write_text(_EXIT_RACE)
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for k in _LAUNCH_ENV:
        env.pop(k, None)
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(script), str(get_free_port())], capture_output=True, text=True, env=env, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
