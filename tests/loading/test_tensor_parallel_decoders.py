"""Tensor parallelism for the generic decoder recipe's families (``model_recipes/decoder.toml``), from each
config's own ``base_model_tp_plan``, equals single-process transformers.

One 2-rank job (one pipeline of one stage, ``tp_size=2``) loads the tiny config of every family whose
plan this version applies (``tests/decoders.py``: 4 heads, 2 kv heads, so 2 divides both) and compares,
on every rank, with transformers on one process (``tp_helpers.compare``):

- forward logits of a padded batch (max abs diff 1e-5: the sharded matmuls only reorder the sums of the
  row-parallel projections, ~1e-7 here; a wrong shard, head count or missed all-reduce moves them 1e-2);
- greedy ``generate`` tokens, token for token (the KV cache holds each rank's heads);
- two ``train_step`` + ``clip_grad_norm_`` + AdamW steps: losses and norms (relative 1e-5) and every
  parameter afterwards, gathered whole, by name (abs 1e-5; a gradient not summed over the ranks, e.g. a
  per-head norm's, moves its parameter by ~lr = 1e-3).

The plans use every style the package applies: colwise / rowwise (Gemma, Phi, ...), the gathered
and split ones (Phi-3, OLMo 2 / 3, GLM), vocabulary-sharded embeddings (GPT-NeoX, GPT-J, CodeGen,
gpt-oss, HunYuan) and per-head norms with summed gradients (Qwen3, Gemma 3, EXAONE 4). Apertus runs
with its plan plus its MLP activation's parameters named, as its refusal says to.

The same job checks the refusals, on every rank, each naming the model class and the cause: a style
not applied (DeepSeek-V3's ``mla_kv_a_proj``), parameters left out between sharded projections
(Apertus's XIELU), a sharded embedding tied to the LM head, and the families with no plan.
"""

from __future__ import annotations

import pytest
import torch
from decoders import DECODERS, TENSOR_PARALLEL, decoder_config
from harness import run_distributed
from tp_helpers import compare, exercise

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Every family whose plan loads (transformers' plan as it ships): tests/decoders.py TENSOR_PARALLEL,
# from which README's table is rendered.
PASSING = TENSOR_PARALLEL
APERTUS_EXTRA = {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}
# case -> (model type, config overrides, what the message of the refusal on every rank contains)
REFUSED = {
    "deepseek_v3": ("deepseek_v3", {}, (
        "DeepseekV3ForCausalLM: tp_plan styles {'layers.*.self_attn.kv_a_proj_with_mqa': 'mla_kv_a_proj'}",
        "multi-latent attention's shared rotary key",
    )),
    "apertus": ("apertus", {}, (
        "ApertusForCausalLM: tp_plan shards the projections of model.layers.0.mlp but leaves out "
        "{'model.layers.0.mlp.act_fn': ['alpha_n', 'alpha_p']}",
        "'layers.*.mlp.act_fn': 'replicated_with_grad_allreduce'",
    )),
    "gpt_neox tied": ("gpt_neox", {"tie_word_embeddings": True}, (
        "GPTNeoXForCausalLM: tp_plan shards gpt_neox.embed_in.weight ('embedding_rowwise'), which is tied to "
        "['lm_head.weight']",
    )),
    **{t: (t, {}, (f"with tp_size=2: the {t} family has no tensor-parallel plan",))
       for t in ("falcon", "stablelm", "bloom", "opt", "gpt_bigcode", "xglm", "persimmon")},
}
KWARGS = {"tp_size": 2, "n_microbatches": 2}


def _load(path, plan_extra=None):
    import transformers
    from transformers.distributed import DistributedConfig

    import hf_pipeline

    kwargs = dict(KWARGS)
    if plan_extra:
        plan = {**transformers.AutoConfig.from_pretrained(path).base_model_tp_plan, **plan_extra}
        kwargs = {"distributed_config": DistributedConfig(tp_size=2, tp_plan=plan), "n_microbatches": 2}
    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **kwargs)


def _case(path, plan_extra):
    from torch.distributed.tensor import DTensor

    model = _load(path, plan_extra)
    res = {"tp": model.dims.tp_size, "sharded": sum(isinstance(p, DTensor) for p in model.parameters())}
    res.update(exercise(model, "decoder", pipelined=True, rows=4))
    return res


def _refusal(path):
    try:
        _load(path)
    except Exception as e:  # noqa: BLE001 - the class and message are what the test compares
        return f"{type(e).__name__}: {e}"
    return None


def _job(cases, refused):
    return {"cases": [_case(*c) for c in cases], "refused": [_refusal(p) for p in refused]}


def _checkpoint(root, model_type, **overrides):
    import transformers

    path = root / f"{model_type}{'-' if overrides else ''}{'-'.join(overrides)}"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config(model_type, **overrides)).save_pretrained(path)
    return str(path)


def test_decoder_families_at_tp2_equal_transformers_and_the_rest_are_refused_naming_the_cause(tmp_path):
    import transformers

    assert set(PASSING) | {r[0] for r in REFUSED.values()} == set(DECODERS)  # every family is in one list
    cases = [(_checkpoint(tmp_path, t), None) for t in PASSING]
    cases.append((_checkpoint(tmp_path, "apertus"), APERTUS_EXTRA))
    refused = [_checkpoint(tmp_path, t, **overrides) for t, overrides, _ in REFUSED.values()]
    per_rank = run_distributed(_job, 2, cases, refused, timeout=600)
    for (path, _), name, i in zip(cases, (*PASSING, "apertus"), range(len(cases))):
        ref = exercise(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                       "decoder", pipelined=False, rows=4)
        for rank, res in enumerate(per_rank):
            case = res["cases"][i]
            assert case["tp"] == 2 and case["sharded"] > 0, f"{name} rank {rank}: tp {case['tp']}, {case['sharded']}"
            compare(f"{name} tp2 rank {rank}", case, ref)
    for (case, (_, _, wants)), i in zip(REFUSED.items(), range(len(REFUSED))):
        for rank, res in enumerate(per_rank):
            msg = res["refused"][i]
            assert msg is not None and msg.startswith("InputError: "), f"{case} rank {rank}: {msg}"
            for want in wants:
                assert want in msg, f"{case} rank {rank}: {msg}"
