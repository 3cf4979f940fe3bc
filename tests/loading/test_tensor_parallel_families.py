"""Tensor parallelism for the families transformers has no plan for (GPT-2, BERT, T5), from their
recipes' ``[tp]`` plans, and for Mistral, from transformers' own ``base_model_tp_plan``, equals
single-process transformers.

One 4-rank job (pp=2 x tp=2) loads a tiny GPT-2 (fused q, k, v ``c_attn`` sharded third by third,
``Conv1D`` weights (in, out)), BERT for masked LM, T5 (its relative attention bias sharded by
heads, also on the stage that holds a replica of it) and Mistral with a 4-token sliding window
(shorter than the 9-token batch and the 11 tokens generated, so that every rank's heads must mask
by the window), and compares, on every rank, with transformers on one process:

- forward logits of a padded batch (max abs diff 1e-5: the sharded matmuls change only the summation
  order of the row-parallel projections, ~1e-7 here);
- greedy ``generate`` tokens (GPT-2, T5, Mistral: the per-stage KV caches hold each rank's heads);
- two ``train_step`` + ``clip_grad_norm_`` + AdamW steps: losses and norms (relative 1e-5) and every
  parameter afterwards, gathered whole from its shards, by name (abs 1e-5; a wrong gradient, e.g. one
  not summed over the ranks, moves a parameter by ~lr = 1e-3);
- ``save_pretrained``: one normal checkpoint that plain transformers loads, equal to the trained
  parameters.

It also proves the sharding happened: a rank holds a third of each of q, k, v in ``c_attn``, and the
attention counts its own heads.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed
from tp_helpers import compare, exercise

pytestmark = pytest.mark.dist

ARCHS = ("gpt2", "bert", "t5", "mistral")
WINDOW = 4
# T5's decoder cut after its block 0: the second stage starts mid-stack and computes the position bias
# from its replica of block 0's relative attention bias, sharded by heads too.
KWARGS = {"gpt2": {}, "bert": {}, "t5": {"split": ["decoder.block.1"]}, "mistral": {}}
# A zero-bubble schedule (its backward split into input and weight gradients) on the tiny LLaMA: every
# schedule runs tensor-parallel stages (planning/mesh_rules.py), this one is the least like the others.
ZERO_BUBBLE = {"schedule": "zbv-zero-bubble", "virtual_stages": 2, "n_microbatches": 4}
# No dropout, so that a training step is deterministic on both sides (Mistral has none: its window).
OVERRIDES = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "t5": {"dropout_rate": 0.0},
    "mistral": {"sliding_window": WINDOW},
}


def _case(path, arch, save_dir, kwargs):
    from transformers.distributed import DistributedConfig

    import hf_pipeline

    auto = getattr(hf_pipeline, tiny.AUTO[arch])
    kwargs = {"n_microbatches": 2, **kwargs}
    model = auto.from_pretrained(
        path, pipeline=True, device="cpu", distributed_config=DistributedConfig(pp_size=2, tp_size=2), **kwargs
    )
    res = {"tp": model.dims.tp_size, "pp": model.dims.pp_size}
    if arch == "gpt2":  # what a rank holds of the fused q, k, v and what its attention counts
        stage = model.stages[0]
        name = next(n for n, _ in stage.named_modules() if n.endswith("attn.c_attn"))
        attn = stage.get_submodule(name.rpartition(".")[0])
        from hf_pipeline.checkpointing.state_shards import gathered_state, sharded_state

        weight = attn.c_attn.weight.detach()
        # The checkpoints' own gather and cut (training state) on the packed placement.
        res["c_attn_whole"] = gathered_state(weight, weight)  # gathered back to the checkpoint's layout
        res["c_attn_part"] = torch.equal(sharded_state(weight, res["c_attn_whole"]).to_local(), weight.to_local())
        res["c_attn_local"] = tuple(attn.c_attn.weight.to_local().shape)
        res["c_attn_slice"] = attn.c_attn.weight.to_local().clone()
        res["c_attn_key"] = model.param_layout.key_of.get(name + ".weight", name + ".weight")
        res["split_size"], res["num_heads"] = attn.split_size, attn.num_heads
    if arch == "mistral":  # transformers' own plan: a rank holds half of the query heads' rows
        q = next(p for n, p in model.stages[0].named_parameters() if n.endswith("self_attn.q_proj.weight"))
        res["q_local_rows"] = q.to_local().shape[0]
    res.update(exercise(model, arch, pipelined=True, generate=arch not in ("bert", "llama"), rows=4))
    if save_dir is not None:
        model.save_pretrained(save_dir, max_shard_size="50KB")
    return res


def _job(cases):
    import torch.distributed as dist

    out = [_case(*c) for c in cases]
    out.append(dist.get_rank())
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpfam")
    out = {a: str(tiny.make_checkpoint(root / a, a, **OVERRIDES[a])) for a in ARCHS}
    return {**out, "llama": str(tiny.make_checkpoint(root / "llama", "llama"))}


def _check_window_matters(path, logits):
    """Mistral's window changes its logits on the test batch (so a stage that ignored it would fail)."""
    import transformers

    full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None).eval()
    with torch.no_grad():
        diff = (full(**tiny.sample_inputs("mistral", batch=4, seq=9)).logits - logits).abs().max().item()
    assert diff > 1e-3, f"a {WINDOW}-token window changes the logits by only {diff}"


@pytest.mark.slow
def test_gpt2_bert_t5_mistral_at_pp2_by_tp2_equal_transformers_and_save_one_checkpoint(checkpoints, tmp_path):
    import transformers

    saved = {a: str(tmp_path / f"saved-{a}") for a in ARCHS}
    cases = [(checkpoints[a], a, saved[a], KWARGS[a]) for a in ARCHS]
    per_rank = run_distributed(_job, 4, [*cases, (checkpoints["llama"], "llama", None, ZERO_BUBBLE)], timeout=600)
    llama = tiny.reference(checkpoints["llama"], "AutoModelForCausalLM")
    ref = exercise(llama, "llama", pipelined=False, generate=False, rows=4)
    for res in per_rank:
        compare(f"llama zbv-zero-bubble pp2 x tp2 rank {res[-1]}", res[len(ARCHS)], ref)
    for i, arch in enumerate(ARCHS):
        ref_model = tiny.reference(checkpoints[arch], tiny.AUTO[arch])
        ref = exercise(ref_model, arch, pipelined=False, generate=arch != "bert", rows=4)
        if arch == "mistral":
            _check_window_matters(checkpoints[arch], ref["logits"])
        for res in per_rank:
            rank, case = res[-1], res[i]
            assert (case["tp"], case["pp"]) == (2, 2), f"{arch}: mesh {case['tp']} {case['pp']}"
            compare(f"{arch} pp2 x tp2 rank {rank}", case, ref)
            if arch == "mistral":
                assert case["q_local_rows"] == 16, f"rank {rank}: q_proj rows {case['q_local_rows']} of 32"
            if arch == "gpt2":
                assert case["c_attn_local"] == (32, 48) and (case["split_size"], case["num_heads"]) == (16, 2), case
                # rank t holds [q_t, k_t, v_t]: the t-th half of each third of the checkpoint's columns
                whole = tiny.reference(checkpoints[arch], tiny.AUTO[arch]).get_parameter(case["c_attn_key"])
                want = torch.cat([third.chunk(2, 1)[rank % 2] for third in whole.detach().chunk(3, 1)], 1)
                assert torch.equal(case["c_attn_slice"], want), f"rank {rank} holds the wrong columns of c_attn"
                assert torch.equal(case["c_attn_whole"], whole.detach()) and case["c_attn_part"], f"rank {rank}"
        # One normal HF checkpoint: plain transformers loads it and holds the trained parameters.
        back = getattr(transformers, tiny.AUTO[arch]).from_pretrained(saved[arch], dtype=torch.float32)
        trained = {**per_rank[0][i]["params"], **per_rank[2][i]["params"]}  # pipeline ranks 0 and 1 at tp rank 0
        assert trained.keys() == ref["params"].keys(), sorted(trained.keys() ^ ref["params"].keys())
        for key, want in trained.items():
            assert torch.equal(back.get_parameter(key).detach(), want), f"{arch}: saved {key} differs"
