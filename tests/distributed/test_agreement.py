"""Agreement across ranks: peers lost while others wait in it, and what may legitimately differ.

A peer that exits (or is stopped) while the others wait in an agreement, between calls or while
ranks read their shards, must come out as the library's RankError naming that peer and its stage,
never as gloo's own text. The checkpoint's *path* may differ per host: the same files elsewhere
load and give transformers' numbers.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import types

import pytest
import tiny
import torch
from harness import last_run_timing, run_distributed

_GLOO_TEXT = ("Connection closed by peer", "Timed out waiting", "pair.cc", "gloo")


def _load(path: str, **kwargs):
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False, **kwargs)


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e), getattr(e, "failures", None)
    return None


def _leave(how: str, pid_file: pathlib.Path) -> None:
    """This rank goes away: exits at once, or stops (SIGSTOP) after saying where to find it."""
    if how == "exit":
        os._exit(7)
    pid_file.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _kill_stopped(pid_file: pathlib.Path) -> None:
    if pid_file.exists():
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _lost_between_calls(path: str, how: str, tmp: str):
    model = _load(path, n_microbatches=2)
    inputs = tiny.sample_inputs("llama", batch=2, seq=9)
    model(**inputs)  # a good call first
    pid_file = pathlib.Path(tmp) / "stopped.pid"
    if model.ctx.rank == 1:
        _leave(how, pid_file)
    first = _outcome(lambda: model(**inputs))  # rank 0 waits in the input agreement for a peer that is gone
    _kill_stopped(pid_file)
    later = _outcome(lambda: model.generate(**tiny.sample_inputs("llama", batch=2, seq=5), max_new_tokens=2))
    return first, later


def _check_lost(result, *, what: str, reason: str):
    kind, message, failures = result
    assert kind == "RankError", result
    assert message.startswith(f"rank 1 (stage 1) stopped answering while {what}: {reason}"), message
    assert not any(text in message for text in _GLOO_TEXT), message
    assert failures == {1: ("ConnectionError", f"stopped answering while {what}", "stage 1")}, failures


@pytest.mark.dist
def test_peer_exits_between_calls_is_a_rank_error_naming_it(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = run_distributed(
        _lost_between_calls, 2, str(path), "exit", str(tmp_path), timeout=120, return_exceptions=True
    )
    assert "died with exit code 7" in str(results[1])
    first, later = results[0]
    _check_lost(first, what="comparing model inputs across ranks", reason="its connection closed")
    # and the next call says so too, at once
    assert later is not None and later[0] in ("RankError", "PipelineBroken"), later
    assert last_run_timing().run_s < 60, last_run_timing()


@pytest.mark.dist
def test_peer_stopped_between_calls_is_a_rank_error_after_the_timeout(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = run_distributed(
        _lost_between_calls, 2, str(path), "stop", str(tmp_path), timeout=120, return_exceptions=True,
        env={"HF_PIPELINE_TIMEOUT": "5"},
    )
    first, later = results[0]
    _check_lost(
        first, what="comparing model inputs across ranks", reason="no answer before the collective timeout 5 s ran out"
    )
    assert later is not None


def _lost_while_loading(path: str, how: str, tmp: str):
    import hf_pipeline.loading.loader as build
    from hf_pipeline.distributed.context import init_distributed

    if init_distributed(device="cpu").rank == 1:
        real = build.load_tensors

        def leave_while_reading(*args, **kwargs):
            _leave(how, pathlib.Path(tmp) / "stopped.pid")
            return real(*args, **kwargs)

        build.load_tensors = leave_while_reading
    result = _outcome(lambda: _load(path))
    _kill_stopped(pathlib.Path(tmp) / "stopped.pid")
    return result


@pytest.mark.dist
def test_peer_exits_while_ranks_read_shards_is_a_rank_error_naming_it(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = run_distributed(
        _lost_while_loading, 2, str(path), "exit", str(tmp_path), timeout=120, return_exceptions=True
    )
    _check_lost(results[0], what="loading weights", reason="its connection closed")


@pytest.mark.dist
def test_peer_stopped_while_ranks_read_shards_is_a_rank_error_after_the_timeout(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = run_distributed(
        _lost_while_loading, 2, str(path), "stop", str(tmp_path), timeout=120, return_exceptions=True,
        env={"HF_PIPELINE_TIMEOUT": "5"},
    )
    _check_lost(results[0], what="loading weights", reason="no answer before the collective timeout 5 s ran out")


def _same_files_elsewhere(paths: list[str]):
    model = _load(paths[int(os.environ["RANK"])], n_microbatches=2)
    inputs = tiny.sample_inputs("llama", batch=2, seq=9)
    prompt = tiny.sample_inputs("llama", batch=2, seq=5)
    return model(**inputs).logits, model.generate(**prompt, max_new_tokens=3, do_sample=False)


@pytest.mark.dist
def test_the_same_checkpoint_at_another_path_on_each_rank_loads(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "host0" / "llama", "llama")
    other = shutil.copytree(path, tmp_path / "host1" / "elsewhere")
    results = run_distributed(_same_files_elsewhere, 2, [str(path), str(other)], timeout=120)
    ref = tiny.reference(path, "AutoModelForCausalLM")
    with torch.no_grad():
        want = ref(**tiny.sample_inputs("llama", batch=2, seq=9)).logits
    want_ids = ref.generate(**tiny.sample_inputs("llama", batch=2, seq=5), max_new_tokens=3, do_sample=False)
    for logits, ids in results:
        # fp32 logits: summation order moves them ~1e-6 in the tiny models (hidden 32-64); a wrong weight,
        # mask, cache or position moves them by 1e-2 or more.
        assert (logits - want).abs().max() <= 1e-5
        assert torch.equal(ids, want_ids)



def test_load_training_state_says_why_a_directory_is_not_a_checkpoint(tmp_path):
    from hf_pipeline.checkpointing.training_state import load_training_state
    from hf_pipeline.distributed.context import init_distributed
    from hf_pipeline.loading.checkpoint_files import SAVE_STAGING_PREFIX

    model = types.SimpleNamespace(ctx=init_distributed(device="cpu"))  # one process: only the refusal runs
    good = tiny.make_checkpoint(tmp_path / "run" / "checkpoint-5", "llama")
    staging = shutil.copytree(good, good / f"{SAVE_STAGING_PREFIX}abc123")
    renamed = shutil.copytree(good, tmp_path / "run.tmp-1")
    no_index = shutil.copytree(good, tmp_path / "no_index")
    (no_index / "model.safetensors.index.json").unlink()
    lost_shard = shutil.copytree(good, tmp_path / "lost_shard")
    next(lost_shard.glob("model-00002-*.safetensors")).unlink()
    cases = {
        staging: rf"is the staging directory of a save_pretrained into {good} that did not finish",
        renamed: r"its name 'run\.tmp-1' contains '\.tmp-', which marks a directory an interrupted save left behind",
        no_index: r"it has no model\.safetensors\.index\.json",
        lost_shard: r"lists 1 shard\(s\) that are not there \(e\.g\. 'model-00002-of-\d+\.safetensors'\)",
        tmp_path / "nothing": r"it does not exist or is not a directory",
    }
    for directory, pattern in cases.items():
        with pytest.raises(FileNotFoundError, match=pattern):
            load_training_state(model, directory)


# --------------------------------------------------------------------------- the digest covers every byte


def _row_swapped(batch: torch.Tensor) -> torch.Tensor:
    """Rows 100 and 101 of a 256x1024 int64 batch swapped: 1 MiB from either end, the same byte sum."""
    swapped = batch.clone()
    swapped[[100, 101]] = batch[[101, 100]]
    return swapped


@pytest.mark.unit
def test_fingerprint_tells_a_row_swap_deep_inside_a_large_batch():
    from hf_pipeline.distributed.agreement import fingerprint

    batch = torch.randint(0, 50_000, (256, 1024), generator=torch.Generator().manual_seed(0))
    swapped = _row_swapped(batch)
    assert not torch.equal(batch, swapped) and int(batch.sum()) == int(swapped.sum())
    assert fingerprint(batch)[0] != fingerprint(swapped)[0]
    assert fingerprint(batch)[0] == fingerprint(batch.clone())[0]
    assert fingerprint(batch)[0] == fingerprint(batch.t().contiguous().t())[0]  # layout does not matter, values do
    floats = torch.randn(4 * 1024 * 1024, generator=torch.Generator().manual_seed(1))  # 16 MB
    moved = floats.clone()
    moved[[2_000_000, 2_000_001]] = floats[[2_000_001, 2_000_000]]
    assert fingerprint(floats)[0] != fingerprint(moved)[0]


def _row_swap_on_rank1():
    from hf_pipeline.distributed.agreement import check_same_on_all_ranks
    from hf_pipeline.distributed.context import init_distributed

    ctx = init_distributed()
    batch = torch.randint(0, 50_000, (256, 1024), generator=torch.Generator().manual_seed(0))
    if ctx.rank == 1:
        batch = _row_swapped(batch)
    inputs = {"input_ids": batch, "attention_mask": torch.ones_like(batch)}
    return _outcome(lambda: check_same_on_all_ranks(ctx, "model inputs", inputs))


@pytest.mark.dist
def test_a_row_swap_is_an_error_naming_the_input_on_every_rank():
    results = run_distributed(_row_swap_on_rank1, 2, timeout=60)
    for kind, message, _ in results:
        assert kind == "InputError", message
        assert message.startswith("model inputs must be the same on every rank but input_ids differs: "), message
        assert "rank 0: Tensor(shape=(256, 1024), dtype=torch.int64" in message and "rank 1: Tensor" in message


# --------------------------------------------------------------------------- the data-only exchange
_VALUES = [  # what the agreements send: a failure, no failure, a digest, a mismatch's details (with non-ASCII)
    ["ValueError", "labels hold token id 977 — vocabulary has 96 entries", "glue.py:12 in forward", "stage 1"],
    None,
    "3f2a9c0d11e4b7a8",
    ["{input_ids: Tensor(shape=(4, 9))}", {"input_ids": ["ab12cd34", "Tensor(shape=(4, 9), dtype=torch.int64)"]}],
]


def _exchanges():
    from hf_pipeline.distributed.context import init_distributed
    from hf_pipeline.distributed.exchange import all_gather_json
    from hf_pipeline.errors import InternalError

    ctx = init_distributed(device="cpu")
    out = {"round_trip": [all_gather_json(ctx, v if ctx.rank == 0 else f"rank {ctx.rank}") for v in _VALUES]}
    try:  # rank 1 sends a set (not JSON): refused at the sender, told to every rank, nothing sent is unpickled
        all_gather_json(ctx, {1, 2} if ctx.rank == 1 else "fine")
    except InternalError as e:
        out["refused"] = str(e)
    out["checked"] = None
    try:  # a part that fails the receiver's check (a number where a string is expected) is refused everywhere
        all_gather_json(ctx, 7 if ctx.rank == 1 else "digest", check=lambda v: isinstance(v, str))
    except InternalError as e:
        out["checked"] = str(e)
    out["after"] = all_gather_json(ctx, [ctx.rank, "still works"])  # the group is usable afterwards
    return out


@pytest.mark.dist
def test_the_agreement_exchange_is_json_data_and_refuses_what_is_not():
    results = run_distributed(_exchanges, 2)
    for rank, res in enumerate(results):
        for value, got in zip(_VALUES, res["round_trip"]):
            assert got == [value, "rank 1"], got  # tuples are sent as lists, as the callers build them
        if rank == 1:
            assert res["refused"].startswith("cannot send set to the other ranks: it is not JSON data (TypeError"), res
        else:
            assert res["refused"] == (
                "rank(s) [1] could not encode their part of an exchange as JSON; see their error"
            ), res
        assert res["checked"].startswith("rank 1 sent 1 bytes that are not what this exchange expects"), res
        assert res["after"] == [[0, "still works"], [1, "still works"]]
