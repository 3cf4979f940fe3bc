"""The zero-bubble schedules with FSDP2 stages (pp2 x fsdp2 on 4 gloo ranks) equal single-process transformers.

A zero-bubble schedule defers the linears' weight gradients from a microbatch's backward to its W action;
each fsdp rank's gradients must still be reduce-scattered once, after the stage's last W. One 4-rank job
loads a tiny LLaMA with ``fsdp_size=2`` under each of them and runs two ``train_step`` +
``clip_grad_norm_`` + AdamW steps: the losses and norms (relative 1e-5) and every parameter afterwards,
gathered whole by name (abs 1e-5), equal transformers on one process. A W missing from the reduce-scatter
would leave each fsdp rank's weights with half the batch's gradient (a 2x error in the norm); one reduced
twice, twice it.
"""

from __future__ import annotations

import pytest
import tiny
from harness import run_distributed
from tp_helpers import compare, exercise

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCHEDULES = (
    # 4 stages per rank: more than the 3 torch's runtime keeps gathered at once, so its RESHARD / UNSHARD
    # actions free and gather a stage again between a microbatch's F and its I + W.
    ("interleaved-zero-bubble", {"virtual_stages": 4, "n_microbatches": 4}),
    ("zbv-zero-bubble", {"virtual_stages": 2, "n_microbatches": 4}),
    ("dualpipev", {"virtual_stages": 2, "n_microbatches": 4}),
)


def _job(path):
    import hf_pipeline

    out = []
    for schedule, kwargs in SCHEDULES:
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
            path, pipeline=True, device="cpu", fsdp_size=2, schedule=schedule, **kwargs
        )
        res = exercise(model, "llama", pipelined=True, generate=False, rows=8)
        res["dims"] = (model.dims.pp_size, model.dims.fsdp_size, model.schedule.name)
        out.append(res)
    return out


def test_zero_bubble_schedules_with_fsdp_equal_transformers(tmp_path):
    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    per_rank = run_distributed(_job, 4, path, timeout=600)
    ref = exercise(tiny.reference(path, "AutoModelForCausalLM"), "llama", pipelined=False, generate=False, rows=8)
    for rank, results in enumerate(per_rank):
        for (schedule, _), res in zip(SCHEDULES, results, strict=True):
            assert res["dims"] == (2, 2, schedule), res["dims"]
            compare(f"{schedule} pp2 x fsdp2 rank {rank}", res, ref)
