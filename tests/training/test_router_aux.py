"""The routers' load-balancing loss (``config.output_router_logits=True``) equals transformers', under every
schedule kind and mesh, for each mixture-of-experts family whose transformers head adds it.

transformers adds ``router_aux_loss_coef x aux`` (a product of batch-wide means over every layer's routing) to
the training loss; the pipeline counts the batch's routing in a forward-only pass, then attaches each stage's
and microbatch's exact share to its output (``training/router_aux.py``). ``router_aux_loss_coef=0.5`` here, so
the auxiliary term is ~1.0 of a ~5.5 loss and its gradient is a large part of the routers': leaving it out,
doubling it, or taking it per microbatch (means of microbatches instead of the batch) moves the loss by 1e-2
to 1 and the router gradients by far more than the tolerances below.

Against transformers on one process, with padded rows (the mask weights the loss, as in transformers):
- in process (two stages in one process; Mixtral, and DeepSeek-V3 which adds none): the loss and every gradient
  of a ``train_step``, and a forward's ``loss`` and ``aux_loss`` with labels;
- generate (transformers' own fails with the flag on: its tokens are taken without it);
- at 2 ranks through 1F1B, ZBV with activation checkpointing and DualPipeV; at 4 ranks pp2 x ep2 (all-to-all in
  training) and pp2 x fsdp2 (the counts summed over data-parallel replicas): ``tp_helpers.exercise`` (logits,
  greedy tokens, two AdamW steps: losses, norms, every parameter after them) and a forward of 3 rows (padded
  to whole microbatches: the padding is not counted) with labels.
DeepSeek-V3's head adds no such loss in transformers (it balances by a routing bias): nothing is added here.
Refused, naming the cause: a family whose loss is not the one split here (at load), and training-mode
dropout or router jitter while training (the two passes would route differently).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from decoders import decoder_config
from harness import run_distributed
from tp_helpers import compare, exercise

AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
WITH_AUX = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")


def _checkpoint(root, model_type, **overrides):
    import transformers

    path = root / f"{model_type}{'-'.join(['', *overrides])}"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config(model_type, **AUX, **overrides)).save_pretrained(path)
    return str(path)


def _load(path, **kwargs):
    import hf_pipeline

    return hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False,
                                                            **kwargs)


def _labelled(rows=3):
    import tiny

    return tiny.make_batch("decoder", rows, seed=7)


def _forward(model, rows=3):
    with torch.no_grad():
        out = model(**_labelled(rows))
    aux = getattr(out, "aux_loss", None)
    return {"loss": float(out.loss.detach()), "aux_loss": None if aux is None else float(aux)}


def _reference(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # transformers' own generate fails with output_router_logits=True (each decode step's loss weights one new
    # token's router rows by the whole cache's mask); the pipeline's generate adds no loss: its tokens are those
    # transformers makes without the flag.
    model.config.output_router_logits = False
    tokens = exercise(model, "decoder", pipelined=False, rows=1)["tokens"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {"forward": _forward(model), "tokens": tokens,
            **exercise(model, "decoder", pipelined=False, generate=False, rows=4)}


def _check_forward(what, got, want):
    # fp32, relative: summation order ~1e-7; the aux term is ~0.2 of the loss and ~2 itself.
    assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (what, got, want)
    assert (got["aux_loss"] is None) == (want["aux_loss"] is None), (what, got, want)
    if want["aux_loss"] is not None:
        assert abs(got["aux_loss"] - want["aux_loss"]) <= 1e-5 * abs(want["aux_loss"]), (what, got, want)


# Mixtral (adds the loss) and DeepSeek-V3 (adds none); the other families are compared at 2 and 4 ranks below.
@pytest.mark.equiv
@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
def test_in_process_step_and_forward_equal_transformers(tmp_path, model_type):
    import transformers

    path = _checkpoint(tmp_path, model_type)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _labelled(4)
    out = ref(**batch)
    out.loss.backward()
    assert (out.aux_loss is not None) == (model_type in WITH_AUX)
    model = _load(path, schedule="interleaved-1f1b", virtual_stages=2, n_microbatches=2)
    model.train()
    loss = float(model.train_step(batch))
    want_loss = float(out.loss.detach())
    assert abs(loss - want_loss) <= 1e-5 * want_loss, (loss, want_loss)
    grads = dict(ref.named_parameters())
    for name, p in model.checkpoint_named_parameters():
        want = grads[name].grad
        # fp32 gradients, relative to each tensor's largest entry: ~1e-6 from summation order; the aux term
        # alone is ~1e-1 of the routers' gradients.
        assert p.grad is not None and (p.grad - want).abs().max() <= 1e-5 * want.abs().max() + 1e-8, name
    ref.eval()
    with torch.no_grad():
        want = {"loss": float(ref(**_labelled()).loss), "aux_loss": getattr(ref(**_labelled()), "aux_loss", None)}
    want["aux_loss"] = None if want["aux_loss"] is None else float(want["aux_loss"])
    _check_forward(model_type, _forward(model), want)


@pytest.mark.equiv
def test_a_different_balancing_loss_is_refused_at_load_and_randomness_while_training(tmp_path):
    from transformers.models.mixtral import modeling_mixtral as mixtral

    from hf_pipeline.errors import InputError
    from hf_pipeline.families.router_loss import router_aux_of

    # A family module whose function normalises per layer (not over all layers at once): refused by name.
    def per_layer(gate_logits, num_experts, top_k, attention_mask=None):
        return sum(mixtral.load_balancing_loss_func((g,), num_experts, top_k, attention_mask) for g in gate_logits)

    module = types.ModuleType("fake_moe_family")
    module.load_balancing_loss_func = per_layer
    fake = type("FakeMoeForCausalLM", (mixtral.MixtralForCausalLM,), {"__module__": module.__name__})
    sys.modules[module.__name__] = module
    try:
        config = decoder_config("mixtral", **AUX)
        with torch.device("meta"):
            root = fake(config)
        with pytest.raises(InputError, match="FakeMoeForCausalLM: its load_balancing_loss_func"):
            router_aux_of(root, config)
        with torch.device("meta"):
            assert router_aux_of(mixtral.MixtralForCausalLM(config), config) is not None
    finally:
        del sys.modules[module.__name__]

    path = _checkpoint(tmp_path, "mixtral", router_jitter_noise=0.1)
    model = _load(path, schedule="interleaved-1f1b", virtual_stages=2, n_microbatches=2)
    model.train()
    with pytest.raises(InputError, match="router_jitter_noise=0.1 draws at random in training mode"):
        model.train_step(_labelled(4))
    model.eval()  # no randomness in eval mode: the step runs, and the model is usable after the refusal
    assert torch.isfinite(model.train_step(_labelled(4)))


def _case(path, kwargs, activation_checkpointing):
    model = _load(path, **kwargs)
    if activation_checkpointing:
        model.activation_checkpointing_enable()
    res = {"forward": _forward(model)}
    res.update(exercise(model, "decoder", pipelined=True, rows=4))
    return res


def _job(cases):
    return [_case(*c) for c in cases]


def _check_all(cases, per_rank, refs):
    for k, (path, kwargs, _) in enumerate(cases):
        for rank, res in enumerate(per_rank):
            what = f"{path.rsplit('/', 1)[1]} {kwargs} rank {rank}"
            _check_forward(what, res[k]["forward"], refs[path]["forward"])
            compare(what, res[k], refs[path])


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_through_1f1b_zbv_with_recompute_and_dualpipev(tmp_path):
    mixtral, qwen3_moe, gpt_oss = (_checkpoint(tmp_path, t) for t in ("mixtral", "qwen3_moe", "gpt_oss"))
    cases = [
        (mixtral, {"schedule": "1f1b", "n_microbatches": 4}, False),
        (qwen3_moe, {"schedule": "zbv-zero-bubble", "n_microbatches": 4}, True),
        (gpt_oss, {"schedule": "dualpipev", "n_microbatches": 4}, False),
    ]
    per_rank = run_distributed(_job, 2, cases, timeout=600)
    _check_all(cases, per_rank, {c[0]: _reference(c[0]) for c in cases})


@pytest.mark.dist
@pytest.mark.slow
def test_four_ranks_pp2_ep2_and_pp2_fsdp2(tmp_path):
    mixtral, qwen2_moe = _checkpoint(tmp_path, "mixtral"), _checkpoint(tmp_path, "qwen2_moe")
    cases = [
        (mixtral, {"ep_size": 2, "n_microbatches": 2}, False),
        (qwen2_moe, {"fsdp_size": 2, "n_microbatches": 2}, False),
    ]
    per_rank = run_distributed(_job, 4, cases, timeout=900)
    _check_all(cases, per_rank, {c[0]: _reference(c[0]) for c in cases})
