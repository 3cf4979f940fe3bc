"""forward() computes as in eval mode at every world size; its loss says how to train; per-layer outputs are refused.

With dropout in the model, ``model.train()`` then ``model(**inputs)`` must give the eval-mode
logits of transformers at 1 and at 2 ranks alike, and leave the stages in the mode the user set.
``model(**batch).loss.backward()`` then raises an error naming the active dropout and ``model.eval()`` (the
backward would draw other masks, ``training/differentiable.py``); on the loss of a forward under
``torch.no_grad()`` it raises an error that points to ``train_step``.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed

# fp32 logits (below 1 in the tiny models: one ulp 6e-8): summation order moves them ~1e-6 (hidden 32-64); a wrong
# weight, mask, cache or position moves them by 1e-2 or more (the dropped-microbatch check below: over 100x TOL).
# Measured (pipelined on 5 rows in 3 microbatches vs transformers, 1 and 2 threads): max diff 0, bitwise equal,
# under ATEN_CPU_CAPABILITY=default and =avx2 (and the native avx512).
TOL = 1e-5


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # attention dropout 0.5: a forward that ran dropout would be far from the eval logits
    return str(tiny.make_checkpoint(tmp_path_factory.mktemp("modes") / "llama", "llama", attention_dropout=0.5))


def _job(path: str) -> dict:
    import hf_pipeline
    from hf_pipeline.errors import InputError

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, n_microbatches=2
    )
    inputs = tiny.sample_inputs("llama", batch=4, seq=9)
    model.train()
    out = model(**inputs, labels=inputs["input_ids"])
    modes = [s.training for s in model.stages]
    try:
        out.loss.backward()
        backward = None
    except InputError as e:
        backward = str(e)
    with torch.no_grad():
        quiet = model(**inputs, labels=inputs["input_ids"])
    try:
        quiet.loss.backward()
        no_grad = None
    except RuntimeError as e:
        no_grad = str(e)
    try:
        model(**inputs, output_hidden_states=True)
        hidden = None
    except InputError as e:
        hidden = str(e)
    try:  # the model's own loss shifts its labels: pre-shifted ones are TRL's fused head's only
        model(**inputs, labels=inputs["input_ids"], shift_labels=inputs["input_ids"])
        shifted = None
    except InputError as e:
        shifted = str(e)
    again = model(**inputs).logits  # the model is still usable
    return {
        "logits": out.logits,
        "loss": out.loss.detach(),
        "modes": modes,
        "backward": backward,
        "no_grad": no_grad,
        "hidden": hidden,
        "shifted": shifted,
        "again": again,
    }


def _check(res: dict, path: str, what: str) -> None:
    ref = tiny.reference(path, "AutoModelForCausalLM")
    inputs = tiny.sample_inputs("llama", batch=4, seq=9)
    with torch.no_grad():
        want = ref(**inputs, labels=inputs["input_ids"])
        ref.train()
        torch.manual_seed(0)
        dropped = ref(**inputs).logits
    assert (dropped - want.logits).abs().max().item() > 100 * TOL, (
        "dropout must be visible for this test to mean anything"
    )
    assert (res["logits"] - want.logits).abs().max().item() <= TOL, what
    assert (res["again"] - want.logits).abs().max().item() <= TOL, what
    # fp32 loss, relative: summation order ~1e-6; dropout left on or a wrong label shift moves it by 1e-2 or more.
    assert torch.allclose(res["loss"], want.loss, rtol=1e-5), (what, res["loss"], want.loss)
    assert res["modes"] and all(res["modes"]), f"{what}: forward left the stages out of train mode"
    assert res["backward"] is not None and "dropout is active" in res["backward"], (what, res["backward"])
    assert "model.eval()" in res["backward"], (what, res["backward"])
    assert res["no_grad"] is not None and "train_step" in res["no_grad"], (what, res["no_grad"])
    assert res["hidden"] is not None and "output_hidden_states=True" in res["hidden"], (what, res["hidden"])
    assert res["shifted"] is not None and "shift_labels" in res["shifted"], (what, res["shifted"])


def test_forward_is_inference_on_one_process(path):
    _check(_job(path), path, "1 process")


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_forward_is_inference_across_ranks(path, world):
    for rank, res in enumerate(run_distributed(_job, world, path, timeout=300)):
        _check(res, path, f"rank {rank} of {world}")
