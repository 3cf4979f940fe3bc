"""``loss = f(model(**batch)); loss.backward()`` on a pipelined model equals transformers on one process.

The pipelined forward under grad mode returns differentiable outputs whose backward runs the pipeline's
training step with the caller's output gradients (``training/differentiable.py``). Compared with transformers
on one process, on every rank: the gradients by checkpoint key after one backward, then the parameters after
AdamW steps, for losses the pipeline does not know (a z-loss over the logits, a loss over the last positions'
log-probabilities with ``logits_to_keep``) and the model's own ``.loss``: LLaMA, GPT-2 (dropout off), T5
(its decoder inputs derived from the labels) and BERT at pp=2, LLaMA with 2 stages per rank (ZBV), at
pp=2 x dp=2 and pp=2 x tp=2; batches of rows the schedule cannot split (5 and 3 rows: padded with a zero
gradient). Refused on every rank at backward, the model usable afterwards: dropout active in training mode, and
the routers' loss of a mixture of experts loaded with ``output_router_logits``.

Tolerances as ``test_train.py`` (fp32, only the summation order differs): a gradient off by 2x, a padded row
counted, or a microbatch dropped moves gradients by far more than 1e-5 of the largest entry.
"""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from decoders import decoder_config
from harness import run_distributed
from tiny import make_batch

pytestmark = pytest.mark.dist

GRAD_RTOL = 1e-5
PARAM_ATOL = 1e-5
LR, EPS, STEPS = 1e-3, 1e-5, 2
NO_DROPOUT = {
    "llama": {}, "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}, "t5": {"dropout_rate": 0.0},
}
AUTO = {"llama": "AutoModelForCausalLM", "gpt2": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM",
        "t5": "AutoModelForSeq2SeqLM"}


def _loss(model, batch: dict, kind: str) -> torch.Tensor:
    """The same loss on the pipelined model and on transformers' (``model(...)`` is all they share)."""
    if kind == "own":
        return model(**batch).loss
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if kind == "z":  # a z-loss plus a squared-logit penalty: no loss the pipeline knows
        logits = model(**inputs).logits
        return logits.logsumexp(-1).pow(2).mean() + 1e-3 * logits.pow(2).mean()
    # "last": log-probabilities of the last 3 positions' next tokens, as RL trainers score completions
    logits = model(**inputs, logits_to_keep=4).logits[:, :-1]
    targets = batch["input_ids"][:, -3:]
    return -logits.log_softmax(-1).gather(-1, targets[..., None]).mean()


def _steps(model, arch, kind, rows, grads_of) -> tuple[dict, float]:
    """AdamW steps on ``kind``'s loss: the first step's gradients (``grads_of(model)``) and the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    grads = None
    for step in range(STEPS):
        loss = _loss(model, make_batch(arch, rows, seed=step + 1), kind)
        loss.backward()
        if step == 0:
            grads = grads_of(model)
        opt.step()
        opt.zero_grad()
    return grads, float(loss.detach())


def _pipelined(path, arch, kind, rows, load_kwargs):
    import hf_pipeline
    from hf_pipeline.distributed.shards import full_tensor

    model = getattr(hf_pipeline, AUTO[arch]).from_pretrained(path, pipeline=True, device="cpu", **load_kwargs)
    model.train()
    # whole tensors (tensor-parallel shards gathered: collective, in the same order on every rank)
    grads, loss = _steps(model, arch, kind, rows, lambda m: tiny.tensors_by_key(
        m, lambda p: p.grad if p.grad is None else full_tensor(p.grad)))
    return {"grads": grads, "params": tiny.tensors_by_key(model, lambda p: full_tensor(p.detach())), "loss": loss}


def _reference(path, arch, kind, rows):
    ref = tiny.reference(path, AUTO[arch]).train()
    grads, loss = _steps(ref, arch, kind, rows, lambda m: {
        n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})
    return ref, grads, loss


def _dropout_refused(path):
    """GPT-2 with its default dropout: refused at backward on every rank, then the model still trains."""
    import hf_pipeline
    from hf_pipeline.errors import InputError

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu")
    model.train()
    batch = make_batch("gpt2", 4)
    try:
        model(**batch).loss.backward()
        message = None
    except InputError as e:
        message = str(e)
    grads_left = [p for p in model.parameters() if p.grad is not None]
    model.eval()
    model(**batch).loss.backward()  # eval mode: no dropout, the same outputs twice
    return message, len(grads_left), sum(1 for p in model.parameters() if p.grad is not None)


def _router_loss_refused(path):
    """A mixture of experts loaded with output_router_logits: its backward is refused on every rank (the step adds the
    routers' loss itself), and the model still trains through train_step."""
    import hf_pipeline
    from hf_pipeline.errors import InputError

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    batch = make_batch("decoder", 4, seed=7)
    try:
        model(**batch).loss.backward()
        message = None
    except InputError as e:
        message = str(e)
    return message, float(model.train_step(batch))


def _job(cases, dropout_path=None, moe_path=None):
    out = [_pipelined(*case) for case in cases]
    return {"cases": out, "dropout": _dropout_refused(dropout_path) if dropout_path else None,
            "router": _router_loss_refused(moe_path) if moe_path else None}


def _check(what, results, ref, ref_grads, ref_loss):
    keys = set()
    for r, res in enumerate(results):
        assert abs(res["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), f"{what} rank {r}: loss {res['loss']} != {ref_loss}"
        for key, copies in res["grads"].items():
            want = ref_grads.get(key, ref.get_parameter(key).grad)
            assert want is not None, f"{what}: transformers has no gradient for {key}"
            for got in copies:
                diff = (got - want).abs().max().item()
                bound = GRAD_RTOL * want.abs().max().item() + 1e-9
                assert diff <= bound, f"{what} rank {r}: gradient of {key}: {diff:.3g}"
            keys.add(key)
        for key, copies in res["params"].items():
            want = ref.get_parameter(key).detach()
            for got in copies:
                diff = (got - want).abs().max().item()
                assert diff <= PARAM_ATOL, f"{what} rank {r}: parameter {key} after {STEPS} steps: {diff:.3g}"
    missing = {n for n in ref_grads if n not in keys and not any(ref.get_parameter(k) is ref.get_parameter(n)
                                                                   for k in keys)}
    assert not missing, f"{what}: no rank returned a gradient for {sorted(missing)}"


def test_backward_through_the_pipelined_forward_equals_transformers(tmp_path):
    paths = {arch: str(tiny.make_checkpoint(tmp_path / arch, arch, auto=AUTO[arch], **NO_DROPOUT[arch]))
             for arch in AUTO}
    dropout = str(tiny.make_checkpoint(tmp_path / "gpt2-dropout", "gpt2"))
    cases = [
        (paths["llama"], "llama", "z", 8, {"n_microbatches": 4}),
        (paths["llama"], "llama", "last", 5, {"n_microbatches": 2}),  # 5 rows: padded to 6
        (paths["llama"], "llama", "own", 4, {"schedule": "zbv-zero-bubble", "virtual_stages": 2}),
        (paths["gpt2"], "gpt2", "z", 3, {}),
        (paths["t5"], "t5", "own", 4, {"n_microbatches": 2}),
        (paths["bert"], "bert", "own", 4, {}),
    ]
    torch.manual_seed(0)
    moe = tmp_path / "mixtral"
    transformers.AutoModelForCausalLM.from_config(
        decoder_config("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)).save_pretrained(moe)
    per_rank = run_distributed(_job, 2, cases, dropout, str(moe), timeout=600)
    for i, (path, arch, kind, rows, kwargs) in enumerate(cases):
        ref, grads, loss = _reference(path, arch, kind, rows)
        _check(f"{arch} {kind} {rows} rows {kwargs}", [r["cases"][i] for r in per_rank], ref, grads, loss)
    for message, left, after in (r["dropout"] for r in per_rank):
        assert message is not None and "dropout is active" in message and "model.eval()" in message, message
        assert left == 0, "a refused backward left gradients"
        assert after > 0, "the model did not backpropagate after the refusal"
    for message, loss in (r["router"] for r in per_rank):
        assert message is not None and "output_router_logits=True cannot be backpropagated" in message, message
        assert loss > 0  # the model still trains


def test_backward_at_pp2_x_dp2_and_pp2_x_tp2_equals_transformers(tmp_path):
    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    cases = [
        (path, "llama", "z", 6, {"num_stages": 2, "n_microbatches": 2}),  # 3 rows a replica: padded to 4
        (path, "llama", "own", 4, {"num_stages": 2, "tp_size": 2, "n_microbatches": 2}),
    ]
    per_rank = run_distributed(_job, 4, cases, timeout=600)
    for i, (what, kind, rows) in enumerate((("pp2 x dp2", "z", 6), ("pp2 x tp2", "own", 4))):
        ref, grads, loss = _reference(path, "llama", kind, rows)
        _check(what, [r["cases"][i] for r in per_rank], ref, grads, loss)


def _cost(path: str):
    from devtools import backward_cost

    return backward_cost.measure(path, rows=4, seq=8, reps=1)


def test_the_backward_cost_tool_runs_tiny(tmp_path):
    # devtools.backward_cost's figures are the README's; here it only runs, at tiny size, and reports both ways.
    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    rank0, rank1 = run_distributed(_cost, 2, path, timeout=300)
    assert rank1 is None and rank0["train_step"] > 0 and rank0["forward_backward"] > 0
    assert rank0["ratio"] == rank0["forward_backward"] / rank0["train_step"]
