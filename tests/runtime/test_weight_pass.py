"""The zero-bubble weight pass (``hf_pipeline/runtime/weight_pass.py``), in one process.

Each family's whole transformers model, its linears installed: a backward while deferring leaves
exactly the linear weights without gradient (everything else has its gradient already, as I must
give it), and the runner ``take`` returns then adds gradients equal to plain autograd's, so that
I + W is the full backward. Multi-rank equality of zero-bubble schedules with transformers is in
``test_train.py`` (every gradient and the parameters after optimizer steps).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import transformers
from tiny import config_for, make_batch
from torch import nn

from hf_pipeline.loading.traced_graphs import defer_linears
from hf_pipeline.runtime import weight_pass


def _model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel,
           "bert": transformers.BertForMaskedLM, "t5": transformers.T5ForConditionalGeneration}[arch]
    return cls(config_for(arch)).eval()  # no dropout: the passes compared must see the same forward


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _linear_weights(model) -> tuple[set[str], set[str]]:
    """Names (as ``named_parameters`` gives them) of the linears' weights, and of those also used
    elsewhere (a tied LM head: the embedding's part of its gradient comes in I)."""
    from transformers.pytorch_utils import Conv1D

    ids = {id(m.weight) for m in model.modules() if type(m) in (nn.Linear, Conv1D)}
    others = {id(p) for m in model.modules() if type(m) not in (nn.Linear, Conv1D) for p in m.parameters(recurse=False)}
    named = dict(model.named_parameters())
    return {n for n, p in named.items() if id(p) in ids}, {n for n, p in named.items() if id(p) in ids & others}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "t5"])
def test_input_pass_leaves_only_linear_weights_and_the_weight_pass_completes_autograds_gradients(arch):
    model = _model(arch)
    batch = make_batch(arch, rows=4)
    model(**batch).loss.backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)

    weight_pass.install(model)
    linears, tied = _linear_weights(model)
    assert len(linears) >= 8, linears  # every block's projections
    assert bool(tied) == (arch != "llama"), tied  # the tiny LLaMA unties its LM head, the others tie it
    with weight_pass.deferring():
        loss = model(**batch).loss
        with weight_pass.capturing():
            loss.backward()
        after_input = _grads(model)
        w = weight_pass.take()
        assert weight_pass.take()() == 0  # a second take finds nothing pending
        # I: every gradient but the linears' weights, already final; a tied LM head has its embedding's part
        assert set(after_input) == set(ref) - (linears - tied)
        for n, g in after_input.items():
            if n in tied:
                # tied: the embedding's part alone differs from the whole gradient by far more than
                # 1e-2 (a W pass already run would not).
                assert not torch.allclose(g, ref[n], rtol=1e-2), n
            else:
                # fp32 gradients of the same kernels, only deferred: noise ~1e-7; a missing or doubled
                # part is 100% off.
                torch.testing.assert_close(g, ref[n], rtol=1e-6, atol=1e-7, msg=n)
        assert w() == len(linears)
    got = _grads(model)
    assert set(got) == set(ref)
    for n in ref:
        # fp32 gradients, W passes run later in the same order: summation order ~1e-6 relative; a missing W
        # pass is 100% off.
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.equiv
def test_weight_passes_accumulate_in_any_order_and_outside_a_step_nothing_is_deferred():
    model = _model("llama")
    weight_pass.install(model)
    a, b = make_batch("llama", rows=4, seed=1), make_batch("llama", rows=4, seed=2)
    model(**a).loss.backward()
    model(**b).loss.backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    with weight_pass.deferring():
        la, lb = model(**a).loss, model(**b).loss  # both forwards first, as a pipeline runs them
        with weight_pass.capturing():
            la.backward()
        wa = weight_pass.take()
        with weight_pass.capturing():
            lb.backward()
        wb = weight_pass.take()
        wb()  # W of the later microbatch first, as a schedule may run them
        wa()
    for n, g in _grads(model).items():
        # fp32 gradients, W passes of two microbatches in reverse order: sums reorder, ~1e-6 relative; a
        # dropped one is 50% off.
        torch.testing.assert_close(g, ref[n], rtol=1e-5, atol=1e-7, msg=n)
    # After the step the installed layers run their class's forward: gradients come in backward.
    model.zero_grad(set_to_none=True)
    model(**a).loss.backward()
    assert set(_grads(model)) == set(ref)


def test_a_step_that_fails_midway_leaves_nothing_pending():
    model = _model("llama")
    weight_pass.install(model)
    with pytest.raises(RuntimeError, match="boom"):
        with weight_pass.deferring(), weight_pass.capturing():
            model(**make_batch("llama", rows=4)).loss.backward()
            raise RuntimeError("boom")
    assert weight_pass.take()() == 0
    model.zero_grad(set_to_none=True)
    with weight_pass.deferring(), weight_pass.capturing():
        model(**make_batch("llama", rows=4)).loss.backward()
        w = weight_pass.take()
    w()
    assert all(p.grad is not None for p in model.parameters())


def test_autocast_bfloat16_gradients_equal_autograds():
    # The deferred linear casts as autocast casts linear (bf16 operands, fp32 gradients back).
    model = _model("llama")
    batch = make_batch("llama", rows=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    weight_pass.install(model)
    with weight_pass.deferring(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
        with weight_pass.capturing():
            loss.backward()
        weight_pass.take()()
    got = _grads(model)
    assert set(got) == set(ref)
    for n in ref:
        assert got[n].dtype == torch.float32
        torch.testing.assert_close(got[n], ref[n], rtol=1e-2, atol=1e-4, msg=n)  # bf16 products, summed in bf16
    # The bf16 products are what autograd computes under autocast: far closer than to fp32 gradients.
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    fp32 = _grads(model)
    name = "model.layers.0.mlp.down_proj.weight"
    assert (got[name] - ref[name]).abs().max() < 0.1 * (fp32[name] - ref[name]).abs().max()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_traced_graph_linears_defer_and_installed_layers_survive_deepcopy_and_pickle():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(3, 5, 8)
    net(x).square().sum().backward()
    ref = _grads(net)
    gm = torch.export.export(net, (x,)).module()
    assert sum(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes) == 2
    defer_linears(gm)  # what the trace path does to every stage graph it installs
    assert sum(n.target is weight_pass.linear for n in gm.graph.nodes) == 2
    gm.zero_grad(set_to_none=True)
    with weight_pass.deferring(), weight_pass.capturing():
        gm(x).square().sum().backward()
        assert gm.a.weight.grad is None and gm.b.weight.grad is None and gm.a.bias.grad is not None
        weight_pass.take()()
    # assert_close's fp32 default (rtol 1.3e-6, atol 1e-5) in this file: the same linears, summation order only;
    # a missing or doubled W pass is 100% off.
    torch.testing.assert_close(gm.a.weight.grad, ref["a.weight"])
    torch.testing.assert_close(gm.b.weight.grad, ref["b.weight"])

    weight_pass.install(net)
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(net), torch.load(buf, weights_only=False)):
        assert twin.a.forward.layer is twin.a  # the copy's layers run the copy's weights
        with weight_pass.deferring(), weight_pass.capturing():
            twin(x).square().sum().backward()
            assert twin.a.weight.grad is None
            weight_pass.take()()
        torch.testing.assert_close(twin.a.weight.grad, net.a.weight.grad)


def test_other_backwards_in_a_step_compute_weight_gradients_in_place_and_defer_nothing():
    # torch's first training step infers gradient shapes with autograd.grad for the inputs alone;
    # such a backward must neither leave work for W (it is not a stage's backward action) nor
    # lose a gradient that autograd.grad asked for.
    model = _model("llama")
    weight_pass.install(model)
    batch = make_batch("llama", rows=4)
    emb = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
    inputs = {"inputs_embeds": emb, "attention_mask": batch["attention_mask"], "labels": batch["labels"]}
    ref_x, ref_w = torch.autograd.grad(model(**inputs).loss, [emb, model.lm_head.weight])
    with weight_pass.deferring():
        loss = model(**inputs).loss
        got_x, got_w = torch.autograd.grad(loss, [emb, model.lm_head.weight], retain_graph=True)
        (only_x,) = torch.autograd.grad(loss, [emb])
        assert weight_pass.take()() == 0
    torch.testing.assert_close(got_x, ref_x)
    torch.testing.assert_close(only_x, ref_x)
    torch.testing.assert_close(got_w, ref_w)
    assert all(p.grad is None for p in model.parameters())
