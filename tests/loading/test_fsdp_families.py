"""FSDP2 inside pipeline stages (pp2 x fsdp2 on 4 gloo ranks) for the families other than LLaMA.

One 4-rank job loads, with ``fsdp_size=2``:

- BERT for masked LM (its MLM head's decoder tied to the word embeddings on the other stage);
- T5 for conditional generation (one ``shared`` embedding tied across the encoder, the decoder and
  the LM head; the relative attention bias of block 0 reused by every later block, its replica on
  the stage that starts mid-decoder);
- GPT-2 (``Conv1D`` weights (in, out), its head tied to the embeddings) under the ``zbv-zero-bubble``
  schedule, whose backward runs the input gradients and the weight gradients as separate actions;

and compares, on every rank, with transformers on one process:

- forward logits of a padded batch (abs 1e-5: the gathered weights are the same numbers);
- greedy ``generate`` tokens (T5, GPT-2), token for token;
- two ``train_step`` + ``clip_grad_norm_`` + AdamW steps: losses and total norms (relative 1e-5), and
  every parameter afterwards, gathered whole from its chunks, by name (abs 1e-5). Each fsdp rank trains
  on half of the batch: a gradient not summed over the fsdp ranks, or a tied weight's two gradients
  not added, shows as a wrong norm and moves parameters by ~lr = 1e-3;
- ``save_pretrained`` (BERT, T5): one normal checkpoint that plain transformers loads with the trained
  parameters, and whose logits equal those of the reference after the same steps.

It also checks that each rank keeps half of its stages' parameter elements (FSDP's dim-0 chunks) and
reads exactly those bytes from the checkpoint, and that GPT-2 under ``zbv-zero-bubble`` (its V puts the
first and the last stage, the embeddings and the head tied to them, on one rank, and FSDP shards each
stage on its own) is refused on every rank at load, naming the tied parameter and the schedules that
work, after which the same ranks load and train the cases above.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed
from test_tensor_parallel import _bad
from tp_helpers import compare, exercise

pytestmark = pytest.mark.dist

ARCHS = ("bert", "t5", "gpt2")
# T5 cut after decoder block 0: the second stage computes the position bias from its replica of block
# 0's relative attention bias, tied to the first stage's, so the tie crosses FSDP units and stages.
KWARGS = {
    "bert": {"n_microbatches": 2},
    "t5": {"n_microbatches": 2, "split": ["decoder.block.1"]},
    "gpt2": {"schedule": "interleaved-zero-bubble", "virtual_stages": 2, "n_microbatches": 4},
}
SAVED = ("bert", "t5")
# No dropout, so that a training step is deterministic on both sides.
NO_DROPOUT = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "t5": {"dropout_rate": 0.0},
}


def _case(path, arch, save_dir):
    import hf_pipeline

    auto = getattr(hf_pipeline, tiny.AUTO[arch])
    model = auto.from_pretrained(path, pipeline=True, device="cpu", fsdp_size=2, **KWARGS[arch])
    res = {"dims": (model.dims.pp_size, model.dims.dp_size, model.dims.fsdp_size), "plan": str(model.plan)}
    local = [p.to_local() if hasattr(p, "to_local") else p for s in model.stages for p in s.parameters()]
    res["kept"] = sum(t.numel() for t in local)
    res["read"] = model.load_report.bytes_read  # fp32 checkpoint: 4 bytes per element read
    res.update(exercise(model, arch, pipelined=True, generate=arch != "bert", rows=4))
    res["whole"] = sum(t.numel() for t in res["params"].values())
    if save_dir is not None:
        model.save_pretrained(save_dir, max_shard_size="50KB")
    return res


def _job(cases, bad):
    return {"bad": _bad(*bad), "cases": [_case(*c) for c in cases]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdpfam")
    return {a: str(tiny.make_checkpoint(root / a, a, **NO_DROPOUT[a])) for a in ARCHS}


@pytest.mark.slow
def test_bert_t5_gpt2_zero_bubble_at_pp2_by_fsdp2_equal_transformers(checkpoints, tmp_path):
    saved = {a: str(tmp_path / f"saved-{a}") if a in SAVED else None for a in ARCHS}
    zbv = (checkpoints["gpt2"], {"fsdp_size": 2, "schedule": "zbv-zero-bubble", "virtual_stages": 2})
    per_rank = run_distributed(_job, 4, [(checkpoints[a], a, saved[a]) for a in ARCHS], zbv, timeout=600)
    for rank, results in enumerate(per_rank):
        bad = results["bad"]
        assert bad is not None and "fsdp_size > 1" in bad and "'lm_head.weight'" in bad, f"rank {rank}: {bad}"
        assert "'interleaved-zero-bubble'" in bad, f"rank {rank}: {bad}"
    per_rank = [results["cases"] for results in per_rank]
    for i, arch in enumerate(ARCHS):
        ref_model = tiny.reference(checkpoints[arch], tiny.AUTO[arch])
        ref = exercise(ref_model, arch, pipelined=False, generate=arch != "bert", rows=4)
        for rank, results in enumerate(per_rank):
            res, what = results[i], f"{arch} pp2 x fsdp2 rank {rank}"
            assert res["dims"] == (2, 2, 2), f"{what}: (pp, dp, fsdp) = {res['dims']}"
            assert "fsdp=2" in res["plan"], res["plan"]
            # Dim-0 chunks of every tensor: half of the elements, give or take the odd rows of a chunk;
            # a tied tensor is read and kept once per stage.
            assert abs(res["kept"] - res["whole"] / 2) <= 0.02 * res["whole"], f"{what}: {res['kept']} / {res['whole']}"
            assert res["read"] == 4 * res["kept"], f"{what}: read {res['read']} bytes to keep {res['kept']} elements"
            compare(what, res, ref)
        if saved[arch] is None:
            continue
        # One normal HF checkpoint: plain transformers loads it, with the trained parameters and the
        # logits of the reference after the same steps.
        back = tiny.reference(saved[arch], tiny.AUTO[arch])
        trained = {k: v for results in per_rank for k, v in results[i]["params"].items()}  # every stage's
        assert trained.keys() == ref["params"].keys(), sorted(trained.keys() ^ ref["params"].keys())
        for key, want in trained.items():
            assert torch.equal(back.get_parameter(key).detach(), want), f"{arch}: saved {key} differs"
        inputs = tiny.sample_inputs(arch, batch=4, seq=9)
        with torch.no_grad():
            diff = (back(**inputs).logits - ref_model(**inputs).logits).abs().max().item()
        # fp32 logits: summation order moves them ~1e-6 in the tiny models (hidden 32-64); a wrong weight,
        # mask, cache or position moves them by 1e-2 or more.
        assert diff <= 1e-5, f"{arch}: reloaded logits differ from the trained reference's by {diff}"
