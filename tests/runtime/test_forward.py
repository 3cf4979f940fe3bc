"""Tier 3: pipelined forward over gloo equals single-process transformers (fp32, max abs diff 1e-5).

Each case loads a real >= 3-shard checkpoint with ``from_pretrained(..., pipeline=True)`` on every
rank, runs a padded, uneven batch through torch's schedules and compares the output on every rank
with the reference loaded by plain transformers in the parent process.
"""

import pytest
import tiny
import torch
from harness import run_distributed

# fp32 logits of the tiny models are below 1 (LLaMA 0.42, GPT-2 0.59, BERT 0.47) and 4.9 for T5: one ulp is
# 6e-8 (T5 5e-7), and sums of 32-64 terms over 4-6 layers keep another summation order's rounding near 1e-6
# (T5 a few 1e-6). A wrong weight, mask, cache or position moves logits by 1e-2 or more.
# Measured (pipelined on 5 rows in 3 microbatches vs transformers, 1 and 2 threads): max diff 0, bitwise equal,
# under ATEN_CPU_CAPABILITY=default and =avx2 (and the native avx512).
TOL = 1e-5  # fp32: the same kernels on the same inputs; only summation order could differ


def _forward(path, auto, arch, kwargs, batch):
    import hf_pipeline

    model = getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", **kwargs)
    inputs = tiny.sample_inputs(arch, batch=batch, seq=9)
    out = model(**inputs)
    names = model.resolved.head.outputs
    return {
        "outputs": {n: getattr(out, n) for n in names},
        "plan": [(s.index, s.rank, s.blocks) for s in model.plan.stages],
        "local": [s.spec.index for s in model.stages],
        "files": list(model.load_report.files_opened),
    }


def _reference(path, auto, arch, batch):
    ref = tiny.reference(path, auto)
    with torch.no_grad():
        return ref(**tiny.sample_inputs(arch, batch=batch, seq=9))


def _check(results, expected, world):
    assert len(results) == world
    for rank, res in enumerate(results):
        for name, got in res["outputs"].items():
            want = getattr(expected, name)
            assert got.shape == want.shape, (rank, name)
            diff = (got - want).abs().max().item()
            assert diff <= TOL, f"rank {rank} {name}: max abs diff {diff}"


def _forward_many(cases, kwargs, batch):
    # One spawned job runs several models: process start-up dominates these tiny runs.
    return [_forward(path, auto, arch, kwargs, batch) for path, auto, arch in cases]


# world size x virtual stages -> the (arch, auto class) cases run in that job. Every architecture runs
# at world sizes 2 and 3 (4 for the 4-layer decoder-only models), with 1 and 2 virtual stages.
JOBS = {
    (2, 1): [
        ("llama", "AutoModelForCausalLM"),
        ("gpt2", "AutoModelForCausalLM"),
        ("bert", "AutoModelForMaskedLM"),
        ("t5", "AutoModelForSeq2SeqLM"),
        ("llama", "AutoModel"),
        ("gpt2", "AutoModel"),
        ("bert", "AutoModel"),
        ("bert", "AutoModelForSequenceClassification"),
    ],
    (2, 2): [("llama", "AutoModelForCausalLM"), ("gpt2", "AutoModelForCausalLM"), ("bert", "AutoModelForMaskedLM")],
    (3, 1): [
        ("llama", "AutoModelForCausalLM"),
        ("gpt2", "AutoModelForCausalLM"),
        ("bert", "AutoModelForMaskedLM"),
        ("t5", "AutoModelForSeq2SeqLM"),
    ],
    (3, 2): [("t5", "AutoModelForSeq2SeqLM")],
    (4, 1): [("llama", "AutoModelForCausalLM"), ("gpt2", "AutoModelForCausalLM")],
}


@pytest.mark.dist
@pytest.mark.parametrize("world,virtual", sorted(JOBS), ids=[f"w{w}-v{v}" for w, v in sorted(JOBS)])
def test_pipelined_forward_equals_transformers(tmp_path, world, virtual):
    cases = []
    for arch, auto in JOBS[world, virtual]:
        path = tiny.make_checkpoint(tmp_path / f"{arch}-{auto}", arch, auto=auto)
        cases.append((str(path), auto, arch))
    batch = 6  # not a multiple of n_microbatches=4: the last microbatch is padded
    kwargs = {"n_microbatches": 4, "virtual_stages": virtual}
    per_rank = run_distributed(_forward_many, world, cases, kwargs, batch)
    for i, (path, auto, arch) in enumerate(cases):
        results = [r[i] for r in per_rank]
        try:
            _check(results, _reference(path, auto, arch, batch), world)
        except AssertionError as e:
            raise AssertionError(f"{arch} {auto} world={world} virtual={virtual}: {e}") from None
        plan = results[0]["plan"]
        assert len(plan) == world * virtual
        assert all(r["plan"] == plan for r in results)
        for rank, res in enumerate(results):
            assert res["local"] == [i for i, r, _ in plan if r == rank]


def test_world_size_1_runs_every_stage_locally(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "t5", "t5")
    res = _forward(str(path), "AutoModelForSeq2SeqLM", "t5", {"num_stages": 2, "virtual_stages": 2}, 3)
    _check([res], _reference(path, "AutoModelForSeq2SeqLM", "t5", 3), 1)
    assert res["local"] == [0, 1]


def _gather_false(path):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", gather_output=False, n_microbatches=2
    )
    out = model(**tiny.sample_inputs("llama", batch=2))
    return None if out is None else out.logits


@pytest.mark.dist
def test_gather_output_false_keeps_output_on_last_stage(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = run_distributed(_gather_false, 2, str(path))
    assert results[0] is None
    want = _reference(path, "AutoModelForCausalLM", "llama", 2).logits
    assert (results[1] - want).abs().max() <= TOL


def test_pipeline_false_is_plain_transformers(tmp_path):
    import transformers

    import hf_pipeline

    path = tiny.make_checkpoint(tmp_path / "gpt2", "gpt2")
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path)
    assert type(model) is transformers.GPT2LMHeadModel


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["zbv-zero-bubble", "interleaved-1f1b"])
def test_forward_with_multi_stage_training_schedules(tmp_path, schedule):
    # Inference runs every stage in order whatever the layout: V-shaped placement included.
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    kwargs = {"n_microbatches": 4, "schedule": schedule, "virtual_stages": 2}
    results = run_distributed(_forward, 2, str(path), "AutoModelForCausalLM", "llama", kwargs, 4)
    _check(results, _reference(path, "AutoModelForCausalLM", "llama", 4), 2)
    if schedule == "zbv-zero-bubble":
        assert [r for _, r, _ in results[0]["plan"]] == [0, 1, 1, 0]
