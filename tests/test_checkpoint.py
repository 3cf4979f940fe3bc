"""Checkpoints: what save_pretrained writes is transformers' own checkpoint; resume is bitwise; saves are atomic.

One spawned 2-rank job trains GPT-2 (tied LM head on the other rank), T5 (tied embeddings and
replicated relative bias, interleaved) and LLaMA with a tied head on the same rank (ZBV), all with
dropout on, saves after step 2 with optimizer / scheduler / RNG state, and returns the pipelined
logits of the saved weights. It then resumes from the checkpoint in fresh models and continues;
the losses of steps 3-4 and the final parameters must equal the uninterrupted run bit for bit
(same world size, CPU). Finally a save whose second rank fails half way must leave nothing that
looks like a checkpoint.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from safetensors import safe_open

import tiny
from harness import run_distributed
from test_train import make_batch

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
    from hf_pipeline.train import param_layout

    layout = param_layout(model)
    return {layout.key_of.get(n, n): p.detach().clone() for n, p in model.checkpoint_named_parameters()}


def _save_resume_job(cases, root):
    import safetensors.torch

    import hf_pipeline.checkpoint as ckpt
    from hf_pipeline.dist import get_rank_context

    out = []
    for path, auto, arch, kwargs in cases:
        target = pathlib.Path(root) / arch / "checkpoint-2"
        model, opt, sched = _new_run(path, auto, kwargs)
        before = _steps(model, opt, sched, arch, [1, 2])
        model.save_pretrained(target, optimizer=opt, scheduler=sched, step=2)
        probe = make_batch(arch, seed=99)
        probe.pop("labels")
        if arch == "t5":
            probe["decoder_input_ids"] = torch.randint(3, tiny.VOCAB, (probe["input_ids"].shape[0], 5), generator=torch.Generator().manual_seed(5))
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
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(directory / name, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


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
        assert set(ours) == set(theirs), f"{arch}: ours-only {sorted(set(ours) - set(theirs))}, transformers-only {sorted(set(theirs) - set(ours))}"
        for k in ours:
            assert torch.equal(ours[k], theirs[k]), f"{arch}: {k} differs after a transformers round trip"
        assert (ckpt / "config.json").is_file() and (ckpt / "generation_config.json").is_file()
        assert json.loads((ckpt / "config.json").read_text())["architectures"] == [type(ref).__name__]
        for r in range(2):
            for key, t in results[r][0][i]["saved_params"].items():
                assert torch.equal(ref.get_parameter(key), t), f"{arch} rank {r}: {key} loaded by transformers != the trained tensor"
        with torch.no_grad():
            want = ref(**results[0][0][i]["probe"]).logits
        for r in range(2):
            diff = (results[r][0][i]["logits"] - want).abs().max().item()
            assert diff <= TOL, f"{arch} rank {r}: pipelined logits of the saved model vs transformers: {diff:.3g}"


def test_resume_continues_bitwise(saved):
    runs, cases, results = saved
    for i, (_, _, arch, _) in enumerate(cases):
        for r in range(2):
            res = results[r][0][i]
            assert res["step"] == 2
            assert res["resumed"] == res["after"], f"{arch} rank {r}: resumed losses {res['resumed']} != uninterrupted {res['after']}"
            assert res["same_params"] == res["keys"], f"{arch} rank {r}: parameters differ: {sorted(set(res['keys']) - set(res['same_params']))}"
        ckpt = runs / arch / "checkpoint-2"
        assert (ckpt / "optimizer" / "pp-00000.pt").is_file() and (ckpt / "optimizer" / "pp-00001.pt").is_file()
        assert (ckpt / "rng" / "rank-00001.pt").is_file() and (ckpt / "scheduler.pt").is_file()


def test_failed_save_leaves_no_complete_looking_checkpoint(saved):
    from hf_pipeline.checkpoint import is_complete_checkpoint, latest_checkpoint

    runs, cases, results = saved
    assert results[1][1] == "OSError: No space left on device"
    assert results[0][1].startswith("RankError") and "No space left on device" in results[0][1], results[0][1]
    root = runs / "overwrite"
    assert not (root / "checkpoint-3").exists()
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    # the overwritten checkpoint-2 (step 1, then step 2) is complete and stays the latest
    assert is_complete_checkpoint(root / "checkpoint-2") and latest_checkpoint(root) == root / "checkpoint-2"
    assert json.loads((root / "checkpoint-2" / "trainer_state.json").read_text())["step"] == 2


def test_latest_checkpoint_skips_what_a_crash_leaves(tmp_path):
    from hf_pipeline.checkpoint import is_complete_checkpoint, latest_checkpoint

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
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", schedule="looped-bfs", virtual_stages=2, n_microbatches=2)
    assert [s.spec.index for s in model.stages] == [0, 1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train_step(make_batch("gpt2", rows=4))
    opt.step()
    model.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert len(set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    probe = tiny.sample_inputs("gpt2", batch=2)
    with torch.no_grad():
        diff = (model(**probe).logits - ref(**probe).logits).abs().max().item()
    assert diff <= TOL
    assert torch.equal(ref.lm_head.weight, ref.transformer.wte.weight)  # still tied after loading
