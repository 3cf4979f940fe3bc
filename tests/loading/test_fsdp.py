"""FSDP2 inside pipeline stages (pp2 x fsdp2 on 4 gloo ranks) equals single-process transformers.

One 4-rank job loads a 4-layer LLaMA (GQA; ``fsdp_size=2``, 1F1B, the stages cut in the middle of a
block) and a GPT-2 whose LM head is tied to
the embeddings on another rank (``DistributedConfig(fsdp_size=2)``, interleaved 1F1B over 4 stages) and
compares, on every rank, with transformers on one process:

- forward logits of a padded batch (abs 1e-5: the gathered weights are the same numbers);
- greedy ``generate`` tokens, token for token (each fsdp rank decodes its own rows);
- two ``train_step`` + ``clip_grad_norm_`` + AdamW steps: losses and total norms (relative 1e-5),
  and every parameter afterwards, gathered whole from its chunks, by name (abs 1e-5). Each fsdp
  rank trains on its own half of the batch, so a reduce-scatter that averaged instead of summing,
  or a second sum over the same ranks, would show as a 2x gradient in the first step's norm;
- ``save_pretrained``: one normal checkpoint that plain transformers loads, with the trained values.

It also checks that each rank keeps half of its stages' parameter elements (FSDP's dim-0 chunks) and
reads exactly those bytes from the checkpoint, and that bad requests fail on every rank at load with one
message naming the argument.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed
from test_tensor_parallel import _bad
from tp_helpers import compare, exercise

pytestmark = pytest.mark.dist

def _case(path, arch, kwargs, save_dir=None):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **kwargs)
    res = {"dims": (model.dims.pp_size, model.dims.dp_size, model.dims.fsdp_size), "plan": str(model.plan)}
    local = [p.to_local() if hasattr(p, "to_local") else p for s in model.stages for p in s.parameters()]
    res["kept"] = sum(t.numel() for t in local)
    res["read"] = model.load_report.bytes_read  # fp32 checkpoint: 4 bytes per element read
    res.update(exercise(model, arch, pipelined=True))
    res["whole"] = sum(t.numel() for t in res["params"].values())
    if save_dir is not None:
        model.save_pretrained(save_dir, max_shard_size="50KB")
    return res


def _job(cases, bad):
    return {"cases": [_case(*c) for c in cases], "bad": [_bad(*b) for b in bad]}


def _reference(path, arch):
    return exercise(tiny.reference(path, "AutoModelForCausalLM"), arch, pipelined=False)


def _check(what, res, ref):
    assert res["dims"] == (2, 2, 2), f"{what}: (pp, dp, fsdp) = {res['dims']}"
    assert "mesh: fsdp=2 x pp=2" in res["plan"], res["plan"]
    # Dim-0 chunks of every tensor: half of the elements, give or take the odd rows of a chunk.
    assert abs(res["kept"] - res["whole"] / 2) <= 0.02 * res["whole"], f"{what}: keeps {res['kept']} of {res['whole']}"
    assert res["read"] == 4 * res["kept"], f"{what}: read {res['read']} bytes to keep {res['kept']} elements"
    compare(what, res, ref)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    # GPT-2 without dropout, so that its training steps are deterministic (LLaMA has none).
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    archs = (("llama", {}), ("gpt2", no_dropout))
    return {arch: str(tiny.make_checkpoint(root / arch, arch, **kw)) for arch, kw in archs}


@pytest.mark.slow
def test_pp2_by_fsdp2_equals_transformers_and_saves_one_checkpoint(checkpoints, tmp_path):
    from transformers.distributed import DistributedConfig

    llama, gpt2 = checkpoints["llama"], checkpoints["gpt2"]
    save_dir = str(tmp_path / "saved")
    # LLaMA cut inside block 2: its halves are called by the glue, not the block, so they are gathered
    # with the stage (an FSDP unit of their own would never be gathered).
    halves = ("model.layers.2.post_attention_layernorm",)
    cases = [(llama, "llama", {"fsdp_size": 2, "schedule": "1f1b", "n_microbatches": 2, "split": halves}, save_dir),
             (gpt2, "gpt2", {"distributed_config": DistributedConfig(fsdp_size=2), "num_stages": 4,
                             "schedule": "interleaved-1f1b", "n_microbatches": 2})]
    bad = [(llama, {"fsdp_size": 3}), (llama, {"fsdp_size": 2, "distributed_config": DistributedConfig(tp_size=2)})]
    per_rank = run_distributed(_job, 4, cases, bad, timeout=600)
    refs = {"llama": _reference(llama, "llama"), "gpt2": _reference(gpt2, "gpt2")}
    for i, arch in enumerate(("llama", "gpt2")):
        for rank, res in enumerate(per_rank):
            _check(f"{arch} pp2 x fsdp2 rank {rank}", res["cases"][i], refs[arch])
    for res in per_rank:
        three, both = res["bad"]
        assert three is not None and "fsdp_size=3" in three and "world size 4" in three, three
        assert both is not None and "fsdp_size and distributed_config" in both, both
    assert per_rank[0]["bad"] == per_rank[3]["bad"], "every rank gets the same message"
    import transformers

    saved = transformers.AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32).eval()
    for key, want in per_rank[0]["cases"][0]["params"].items():
        assert torch.equal(saved.get_parameter(key).detach(), want), f"saved {key} differs from the trained one"
