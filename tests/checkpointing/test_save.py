"""Checkpoints: what save_pretrained writes is transformers' own checkpoint; resume is bitwise; saves are atomic.

One spawned 2-rank job trains GPT-2 (tied LM head on the other rank), T5 (tied embeddings and
replicated relative bias, interleaved) and LLaMA with a tied head on the same rank (ZBV), all with
dropout on, saves after step 2 with optimizer / scheduler / RNG state, and returns the pipelined
logits of the saved weights. It then resumes from the checkpoint in fresh models and continues;
the losses of steps 3-4 and the final parameters must equal the uninterrupted run bit for bit
(same world size, CPU). Finally a save whose second rank fails half way must leave nothing that
looks like a checkpoint.

Saving into a directory that holds other files (a tokenizer, a README, a script, a subdirectory,
``notes.safetensors``) keeps them and removes only stale weight files; ``save_pretrained(".")`` and
saving a fine-tuned model back into the directory it was loaded from are tested the same way. A
rank SIGKILLed at each phase of an overwriting save (2 ranks, through ``save_phase_hook``) must
leave the old checkpoint, bitwise, until the index is replaced and the new one after, as our
loader, transformers and ``latest_checkpoint`` see it. Failed saves (bad arguments, a full tmpfs,
different paths on different ranks) say why on every rank and leave nothing behind.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import tiny
import torch
import transformers
from harness import run_distributed
from safetensors import safe_open
from tiny import make_batch

# fp32 logits: summation order moves them ~1e-6 in the tiny models (hidden 32-64); a wrong weight, mask, cache or
# position moves them by 1e-2 or more.
TOL = 1e-5
CASES = [
    ("gpt2", "AutoModelForCausalLM", {"schedule": "1f1b", "n_microbatches": 4}),
    ("t5", "AutoModelForSeq2SeqLM", {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 4}),
    ("llama-tied", "AutoModelForCausalLM", {"schedule": "zbv-zero-bubble", "virtual_stages": 2, "n_microbatches": 4}),
]


def _new_run(path, auto, kwargs):
    import hf_pipeline

    model = getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", **kwargs)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _steps(model, opt, sched, arch, steps):
    losses = []
    for step in steps:
        losses.append(float(model.train_step(make_batch(arch, seed=step))))
        model.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def _params(model):
    layout = model.param_layout
    return {layout.key_of.get(n, n): p.detach().clone() for n, p in model.checkpoint_named_parameters()}


def _save_resume_job(cases, root):
    import safetensors.torch

    import hf_pipeline.checkpointing.training_state as ckpt
    from hf_pipeline.distributed.context import get_rank_context

    out = []
    for path, auto, arch, kwargs in cases:
        target = pathlib.Path(root) / arch / "checkpoint-2"
        model, opt, sched = _new_run(path, auto, kwargs)
        before = _steps(model, opt, sched, arch, [1, 2])
        model.save_pretrained(target, optimizer=opt, scheduler=sched, step=2)
        probe = make_batch(arch, seed=99)
        probe.pop("labels")
        if arch == "t5":
            probe["decoder_input_ids"] = torch.randint(
                3, tiny.VOCAB, (probe["input_ids"].shape[0], 5), generator=torch.Generator().manual_seed(5)
            )
        saved_params = _params(model)
        logits = model(**probe).logits  # the saved weights through the pipeline (eval mode)
        model.train()
        after = _steps(model, opt, sched, arch, [3, 4])
        final = _params(model)
        # Resume in fresh objects from the checkpoint, as a new job would.
        model2, opt2, sched2 = _new_run(str(target), auto, kwargs)
        state = ckpt.load_training_state(model2, target, optimizer=opt2, scheduler=sched2)
        resumed = _steps(model2, opt2, sched2, arch, [3, 4])
        final2 = _params(model2)
        out.append({
            "before": before, "after": after, "resumed": resumed, "step": state["step"], "logits": logits,
            "same_params": sorted(k for k in final if torch.equal(final[k], final2[k])), "keys": sorted(final),
            "probe": probe, "saved_params": saved_params,
        })
    # Overwrite an existing checkpoint, then a save that fails on rank 1 while writing its shard.
    path, auto, arch, kwargs = cases[0]
    where = pathlib.Path(root) / "overwrite"
    model, opt, sched = _new_run(path, auto, kwargs)
    _steps(model, opt, sched, arch, [1])
    model.save_pretrained(where / "checkpoint-2", optimizer=opt, scheduler=sched, step=1)
    _steps(model, opt, sched, arch, [2])
    model.save_pretrained(where / "checkpoint-2", optimizer=opt, scheduler=sched, step=2)
    model.save_pretrained(pathlib.Path(root) / "plain")  # no training state asked for: none written
    if get_rank_context().rank == 1:
        real = safetensors.torch.save_file

        def broken(tensors, filename, metadata=None):
            real(dict(list(tensors.items())[:1]), filename, metadata=metadata)  # a partial file, then the disk "fails"
            raise OSError("No space left on device")

        safetensors.torch.save_file = broken
    error = None
    try:
        model.save_pretrained(where / "checkpoint-3", optimizer=opt, step=3)
    except Exception as e:  # noqa: BLE001 - the error is what is tested
        error = f"{type(e).__name__}: {e}"
    return out, error


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cases = []
    for arch, auto, kwargs in CASES:
        # default dropout stays on: resuming must restore the RNG streams that draw its masks
        cases.append((str(tiny.make_checkpoint(root / "src" / arch, arch, auto=auto)), auto, arch, kwargs))
    results = run_distributed(_save_resume_job, 2, cases, str(root / "runs"), timeout=600)
    return root / "runs", cases, results


def _keys_and_tensors(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(directory / name, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


@pytest.mark.dist
def test_saved_checkpoint_is_what_transformers_writes_and_loads(saved, tmp_path):
    runs, cases, results = saved
    for i, (_, auto, arch, _) in enumerate(cases):
        ckpt = runs / arch / "checkpoint-2"
        ours = _keys_and_tensors(ckpt)
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(ours), arch
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
        assert len(set(index["weight_map"].values())) >= 2, f"{arch}: expected one shard per rank at least"
        ref = getattr(transformers, auto).from_pretrained(ckpt).eval()
        # transformers' own save of the same weights: same keys (tied weights once, under its key), same tensors
        ref.save_pretrained(tmp_path / arch)
        theirs = _keys_and_tensors(tmp_path / arch)
        assert set(ours) == set(theirs), (
            f"{arch}: ours-only {sorted(set(ours) - set(theirs))}, transformers-only {sorted(set(theirs) - set(ours))}"
        )
        for k in ours:
            assert torch.equal(ours[k], theirs[k]), f"{arch}: {k} differs after a transformers round trip"
        assert (ckpt / "config.json").is_file() and (ckpt / "generation_config.json").is_file()
        assert json.loads((ckpt / "config.json").read_text())["architectures"] == [type(ref).__name__]
        for r in range(2):
            for key, t in results[r][0][i]["saved_params"].items():
                assert torch.equal(ref.get_parameter(key), t), (
                    f"{arch} rank {r}: {key} loaded by transformers != the trained tensor"
                )
        with torch.no_grad():
            want = ref(**results[0][0][i]["probe"]).logits
        for r in range(2):
            diff = (results[r][0][i]["logits"] - want).abs().max().item()
            assert diff <= TOL, f"{arch} rank {r}: pipelined logits of the saved model vs transformers: {diff:.3g}"


@pytest.mark.dist
def test_resume_continues_bitwise(saved):
    runs, cases, results = saved
    for i, (_, _, arch, _) in enumerate(cases):
        for r in range(2):
            res = results[r][0][i]
            assert res["step"] == 2
            assert res["resumed"] == res["after"], (
                f"{arch} rank {r}: resumed losses {res['resumed']} != uninterrupted {res['after']}"
            )
            assert res["same_params"] == res["keys"], (
                f"{arch} rank {r}: parameters differ: {sorted(set(res['keys']) - set(res['same_params']))}"
            )
        ckpt = runs / arch / "checkpoint-2"
        assert (ckpt / "optimizer" / "pp-00000.pt").is_file() and (ckpt / "optimizer" / "pp-00001.pt").is_file()
        assert (ckpt / "rng" / "rank-00001.safetensors").is_file() and (ckpt / "scheduler.json").is_file()
    plain = runs / "plain"  # a plain save_pretrained(dir): the HF checkpoint only
    assert (plain / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in plain.iterdir() if not p.name.endswith(".safetensors")) == [
        "config.json", "generation_config.json", "model.safetensors.index.json"]


@pytest.mark.dist
def test_failed_save_leaves_no_complete_looking_checkpoint(saved):
    from hf_pipeline.checkpointing.directory import is_complete_checkpoint, latest_checkpoint

    runs, cases, results = saved
    # the disk error names the file and the disk it is on, on the rank that hit it and, quoted, on the other
    root = runs / "overwrite"
    assert results[1][1].startswith(f"OSError: No space left on device: writing {root / 'checkpoint-3'}/"), results[1][
        1
    ]
    assert "failed on the disk mounted at " in results[1][1]
    assert results[0][1].startswith("RankError") and "No space left on device" in results[0][1], results[0][1]
    assert str(root / "checkpoint-3") in results[0][1]
    assert not (root / "checkpoint-3").exists()
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert not [p.name for p in (root / "checkpoint-2").iterdir() if ".tmp-" in p.name]
    # the overwritten checkpoint-2 (step 1, then step 2) is complete and stays the latest
    assert is_complete_checkpoint(root / "checkpoint-2") and latest_checkpoint(root) == root / "checkpoint-2"
    assert json.loads((root / "checkpoint-2" / "trainer_state.json").read_text())["step"] == 2


def test_latest_checkpoint_skips_what_a_crash_leaves(tmp_path):
    from hf_pipeline.checkpointing.directory import is_complete_checkpoint, latest_checkpoint

    def fake(name, complete):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "model-00001-of-00002.safetensors").write_bytes(b"")
        if complete:
            (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')
        return d

    assert latest_checkpoint(tmp_path) is None
    fake("checkpoint-5", True)
    fake("checkpoint-12", True)
    fake("checkpoint-20", False)  # killed before the index was written
    fake("checkpoint-30.tmp-0123456789ab", True)  # killed before the rename
    fake("checkpoint-40.old-0123456789ab", True)  # killed between the two renames of an overwrite
    assert not is_complete_checkpoint(tmp_path / "checkpoint-20")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-12"


def test_world_size_1_save_loads_in_transformers(tmp_path):
    import hf_pipeline

    path = tiny.make_checkpoint(tmp_path / "src", "gpt2")
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", schedule="looped-bfs", virtual_stages=2, n_microbatches=2
    )
    assert [s.spec.index for s in model.stages] == [0, 1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train_step(make_batch("gpt2", rows=4))
    opt.step()
    model.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (
        len(set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    )
    probe = tiny.sample_inputs("gpt2", batch=2)
    with torch.no_grad():
        diff = (model(**probe).logits - ref(**probe).logits).abs().max().item()
    assert diff <= TOL
    assert torch.equal(ref.lm_head.weight, ref.transformer.wte.weight)  # still tied after loading


# ------------------------------------------------------------------- saving into a directory that holds other files
USER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "WordLevel"}}\n',
    "tokenizer_config.json": '{"model_max_length": 128}\n',
    "special_tokens_map.json": '{"eos_token": "</s>"}\n',
    "README.md": "# my model\n",
    "train.sh": "#!/bin/sh\necho fine-tune\n",
    "notes.safetensors": "not a weight file of this checkpoint: its name does not match model*-NNNNN-of-NNNNN",
    "data/sample.txt": "kept\n",
}
TRAINING_FILES = ("optimizer", "rng", "scheduler.json", "trainer_state.json")


def _put_user_files(directory: pathlib.Path) -> None:
    for name, text in USER_FILES.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)


def _assert_user_files_kept(directory: pathlib.Path) -> None:
    for name, text in USER_FILES.items():
        assert (directory / name).is_file() and (directory / name).read_text() == text, f"{name} was changed or removed"


def _weight_files(directory: pathlib.Path) -> set[str]:
    from hf_pipeline.checkpointing.directory import WEIGHT_FILE_PATTERN

    return {
        p.name for p in directory.iterdir() if p.name == "model.safetensors" or WEIGHT_FILE_PATTERN.fullmatch(p.name)
    }


def _load_1(path, **kwargs):
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", n_microbatches=2, **kwargs
    )


def _assert_only_checkpoint_added(directory: pathlib.Path) -> None:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert _weight_files(directory) == shards, f"stale weight files left: {sorted(_weight_files(directory) - shards)}"
    assert not [p.name for p in directory.iterdir() if ".tmp-" in p.name or p.name.endswith(".partial")]
    for name in TRAINING_FILES:
        assert not (directory / name).exists(), f"{name} written though no training state was asked for"
    expected = set(USER_FILES) | shards | {"model.safetensors.index.json", "config.json", "generation_config.json"}
    found = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    assert found == expected, f"unexpected: {sorted(found - expected)}, missing: {sorted(expected - found)}"


def test_save_into_existing_directory_keeps_user_files_and_removes_only_stale_weights(tmp_path):
    from hf_pipeline.loading.checkpoint_files import CheckpointIndex

    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    out = tmp_path / "out"
    # transformers' unsharded save first: its model.safetensors must not shadow the sharded save for transformers
    transformers.AutoModelForCausalLM.from_pretrained(src).save_pretrained(out)
    assert (out / "model.safetensors").is_file()
    _put_user_files(out)
    (out / ".hf_pipeline.tmp-0123456789ab").mkdir()  # what a killed save leaves
    (out / ".hf_pipeline.tmp-0123456789ab" / "model-00001-of-00002.safetensors").write_bytes(b"half")
    with pytest.warns(UserWarning, match="interrupted save_pretrained"):
        CheckpointIndex.from_directory(out)
    model = _load_1(src)
    model.save_pretrained(out, max_shard_size="20KB")  # many shards
    many = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(many) > 4 and not (out / "model.safetensors").exists()
    _assert_user_files_kept(out)
    _assert_only_checkpoint_added(out)
    model.save_pretrained(out, max_shard_size="200KB")  # fewer shards: the earlier ones are stale
    few = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(few) < len(many) and not few & many  # fresh names: no file an old index listed is overwritten
    _assert_user_files_kept(out)
    _assert_only_checkpoint_added(out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src)
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_save_pretrained_dot_saves_into_the_working_directory(tmp_path, monkeypatch):
    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    model = _load_1(src)
    work = tmp_path / "work"
    work.mkdir()
    _put_user_files(work)
    monkeypatch.chdir(work)
    assert model.save_pretrained(".") == work
    monkeypatch.chdir(tmp_path)
    _assert_user_files_kept(work)
    _assert_only_checkpoint_added(work)
    model.save_pretrained(work)  # and once more over it
    _assert_user_files_kept(work)
    _assert_only_checkpoint_added(work)
    back = transformers.AutoModelForCausalLM.from_pretrained(work)
    for k, v in transformers.AutoModelForCausalLM.from_pretrained(src).state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_load_finetune_save_back_keeps_tokenizer_and_saves_the_trained_weights(tmp_path):
    import hf_pipeline

    ckpt = tiny.make_checkpoint(tmp_path / "model", "llama")
    _put_user_files(ckpt)
    before = transformers.AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    model = _load_1(ckpt)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train_step(make_batch("llama", rows=4))
    opt.step()
    trained = _params(model)
    model.eval()
    model.save_pretrained(ckpt)  # back into the directory it was loaded from
    _assert_user_files_kept(ckpt)
    _assert_only_checkpoint_added(ckpt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    assert any(not torch.equal(before[k], trained[k]) for k in trained), (
        "the step changed nothing: the test means nothing"
    )
    for k, t in trained.items():
        assert torch.equal(ref.get_parameter(k), t), f"{k}: transformers loaded something else than the trained tensor"
    again = hf_pipeline.AutoModelForCausalLM.from_pretrained(ckpt, pipeline=True, device="cpu", n_microbatches=2)
    for k, t in _params(again).items():
        assert torch.equal(t, trained[k]), f"{k}: reloaded pipelined weights differ from the saved ones"
    probe = tiny.sample_inputs("llama", batch=2)
    with torch.no_grad():
        diff = (again(**probe).logits - ref(**probe).logits).abs().max().item()
    assert diff <= TOL


def test_failed_save_leaves_nothing_and_training_state_only_when_asked(tmp_path):
    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    model = _load_1(src)
    existing = tmp_path / "existing"
    existing.mkdir()
    _put_user_files(existing)
    foreign = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    for target in (tmp_path / "new" / "checkpoint-1", existing):
        with pytest.raises(ValueError, match="max_shard_size must be positive"):
            model.save_pretrained(target, max_shard_size=0)
        with pytest.raises(ValueError, match="not one of this model's stage parameters"):
            model.save_pretrained(target, optimizer=foreign)
    assert not (tmp_path / "new").exists(), "a failed save left the directory it made"
    assert {str(p.relative_to(existing)) for p in existing.rglob("*") if p.is_file()} == set(USER_FILES)
    # a failure while writing (after the staging directory exists) leaves nothing either
    import safetensors.torch

    real = safetensors.torch.save_file
    try:
        safetensors.torch.save_file = lambda *a, **k: (_ for _ in ()).throw(OSError("No space left on device"))
        with pytest.raises(
            OSError, match=r"No space left on device: writing .*existing.* failed on the disk mounted at "
        ):
            model.save_pretrained(existing)
    finally:
        safetensors.torch.save_file = real
    assert {str(p.relative_to(existing)) for p in existing.rglob("*") if p.is_file()} == set(USER_FILES)
    assert [p.name for p in existing.iterdir()] and not [p.name for p in existing.iterdir() if ".tmp-" in p.name]
    # training state: written when asked for, with the save it belongs to named
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.save_pretrained(tmp_path / "with-state", optimizer=opt, step=7)
    state = json.loads((tmp_path / "with-state" / "trainer_state.json").read_text())
    index = json.loads((tmp_path / "with-state" / "model.safetensors.index.json").read_text())
    assert state["step"] == 7 and state["hf_pipeline_save_id"] == index["metadata"]["hf_pipeline_save_id"]
    assert (tmp_path / "with-state" / "rng" / "rank-00000.safetensors").is_file()
    # a plain save over it: weights of another save than the training state, which is then refused
    model.save_pretrained(tmp_path / "with-state")
    from hf_pipeline.checkpointing.training_state import load_training_state

    with pytest.raises(ValueError, match="written by another save than its weights"):
        load_training_state(model, tmp_path / "with-state", optimizer=opt)


# --------------------------------------------------------------------------- kills at each phase of a save (2 ranks)
# (phase, victim rank, n-th time it reaches the phase, contents the directory must hold afterwards)
KILL_POINTS = [
    ("begin", 1, 1, "old"),  # before any shard
    ("shard", 1, 1, "old"),  # between two shards of rank 1
    ("written", 0, 1, "old"),  # every file staged, before the agreement
    ("moved", 0, 2, "old"),  # between moving two shards into place
    ("before_index", 0, 1, "old"),  # shards, config moved; old index still in place
    ("after_index", 0, 1, "new"),  # index replaced, stale files not yet removed
]


def _kill_job(src: str, root: str, phase: str, victim: int, nth: int):
    import os
    import signal

    import hf_pipeline
    import hf_pipeline.checkpointing.save as ckpt

    root = pathlib.Path(root)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(src, pipeline=True, device="cpu", n_microbatches=2)
    target = root / "run" / "checkpoint-1"
    model.save_pretrained(target, max_shard_size="20KB")  # the old checkpoint
    if model.ctx.is_main_process:
        _put_user_files(target)
    model.save_pretrained(root / "old", max_shard_size="20KB")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train_step(make_batch("llama", rows=4))
    opt.step()
    model.save_pretrained(root / "new", max_shard_size="30KB")
    seen = [0]

    def kill(name):
        if name == phase:
            seen[0] += 1
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    if model.ctx.rank == victim:
        ckpt.save_phase_hook = kill
    model.save_pretrained(target, max_shard_size="30KB")  # the new one, killed at `phase`
    raise AssertionError(f"rank {model.ctx.rank}: the save was not killed at {phase!r}")


@pytest.mark.dist
@pytest.mark.parametrize("phase,victim,nth,expect", KILL_POINTS, ids=[p[0] for p in KILL_POINTS])
def test_save_killed_at_each_phase_leaves_old_or_new_checkpoint(tmp_path, phase, victim, nth, expect):
    import warnings

    from hf_pipeline.checkpointing.directory import is_complete_checkpoint, latest_checkpoint
    from hf_pipeline.loading.checkpoint_files import CheckpointIndex

    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    results = run_distributed(
        _kill_job, 2, str(src), str(tmp_path), phase, victim, nth, timeout=240, return_exceptions=True,
        env={"HF_PIPELINE_TIMEOUT": "60"}, failure_grace=60,
    )
    assert "died with exit code -9" in str(results[victim]), results
    survivor = results[1 - victim]
    assert "save was not killed" not in str(survivor), survivor
    run = tmp_path / "run"
    target = run / "checkpoint-1"
    assert latest_checkpoint(run) == target and is_complete_checkpoint(target)
    _assert_user_files_kept(target)
    want = _keys_and_tensors(tmp_path / expect)
    other = _keys_and_tensors(tmp_path / ("new" if expect == "old" else "old"))
    assert any(not torch.equal(want[k], other[k]) for k in want), "old and new are equal: the test means nothing"
    with warnings.catch_warnings(record=True) as caught:  # our loader: what the index lists
        warnings.simplefilter("always")
        index = CheckpointIndex.from_directory(target)
    leftover = [p.name for p in target.iterdir() if p.name.startswith(".hf_pipeline.tmp-")]
    assert bool(leftover) == any("interrupted save_pretrained" in str(w.message) for w in caught), (leftover, caught)
    ours = _keys_and_tensors(target)
    assert set(ours) == set(want) == set(index.weight_map)
    for k in want:
        assert torch.equal(ours[k], want[k]), f"{phase}: {k} is not the {expect} tensor"
    ref = transformers.AutoModelForCausalLM.from_pretrained(target)  # transformers' own choice of files
    for k, t in want.items():
        assert torch.equal(ref.state_dict()[k], t), f"{phase}: transformers loaded a {k} that is not the {expect} one"


# --------------------------------------------------------------------------- errors that say why (2 ranks)
def _different_paths_job(src: str, root: str):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(src, pipeline=True, device="cpu", n_microbatches=2)
    try:
        model.save_pretrained(pathlib.Path(root) / f"rank-{model.ctx.rank}")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_different_save_paths_on_different_ranks_are_refused(tmp_path):
    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    out = tmp_path / "out"
    out.mkdir()
    messages = run_distributed(_different_paths_job, 2, str(src), str(out), timeout=180)
    for rank, msg in enumerate(messages):
        assert msg and msg.startswith("save_pretrained got a different directory on each rank"), (rank, msg)
        assert f"rank 0: {out / 'rank-0'}" in msg and f"rank 1: {out / 'rank-1'}" in msg, msg
    assert list(out.iterdir()) == []


def _disk_full_job(src: str, target: str):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(src, pipeline=True, device="cpu", n_microbatches=2)
    try:
        model.save_pretrained(target, max_shard_size="20KB")
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.dist
def test_full_disk_is_named_on_every_rank_and_leaves_nothing(tmp_path):
    import subprocess

    src = tiny.make_checkpoint(tmp_path / "src", "llama")  # ~170 KB of fp32 weights
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        target = disk / "out"
        target.mkdir()
        (target / "README.md").write_text("kept\n")
        messages = run_distributed(_disk_full_job, 2, str(src), str(target), timeout=180)
        for rank, msg in enumerate(messages):
            assert msg is not None and "No space left on device: writing " in msg, (rank, msg)
            assert f"{target}/" in msg and f"failed on the disk mounted at {disk} (tmpfs, tmpfs, " in msg, (rank, msg)
            assert "unexpected pos" not in msg.split(" [")[0], msg
        assert sorted(str(p.relative_to(disk)) for p in disk.rglob("*")) == ["out", "out/README.md"]
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_replace_file_leaves_the_old_file_or_the_new_one(tmp_path, monkeypatch):
    # What the benchmark's README/results and the device check's JSON are written with: a write cut
    # short leaves the old file whole and no temporary file behind.
    import hf_pipeline.checkpointing.durable as ckpt

    path = tmp_path / "results.json"
    path.write_text("old")
    real_fdopen = ckpt.os.fdopen

    class Stopped(Exception):
        pass

    class HalfWriter:  # writes half the text, then the process "stops"
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise Stopped

    monkeypatch.setattr(ckpt.os, "fdopen", lambda fd, mode: HalfWriter(real_fdopen(fd, mode)))
    with pytest.raises(Stopped):
        ckpt.replace_file(path, "new text " * 1000)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    monkeypatch.setattr(ckpt.os, "fdopen", real_fdopen)
    ckpt.replace_file(path, "new text")
    assert path.read_text() == "new text" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
