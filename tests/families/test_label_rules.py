"""Sequence classification labels: every problem type's dtype and shape rules, against transformers.

transformers' ``*ForSequenceClassification`` picks the problem type from ``config.problem_type``, or
from ``num_labels`` and the labels' dtype, then computes MSE, cross entropy or BCE-with-logits; some
labels it computes with (float16 multi-label targets, integer regression targets), others make the
loss raise (integer multi-label targets, a (batch,) target for num_labels > 1, float class ids). Each
case runs on transformers and on the pipelined model (world 1, two local stages: the checks are
per-process; the 2-rank refusals are in ``tests/model/test_attacker_inputs.py``): the loss must equal
transformers' where it computes one, and where it raises the pipeline must refuse up front with an
InputError naming ``labels``, the problem type and the dtype or shape.
"""

from __future__ import annotations

import pytest
import tiny
import torch

B = 4
g = torch.Generator().manual_seed(3)


def _ints(*shape, high=2, dtype=torch.long):
    return torch.randint(0, high, shape, generator=g).to(dtype)


def _floats(*shape, dtype=torch.float32):
    return torch.rand(shape, generator=g).to(dtype)


# (case, config.problem_type, num_labels, labels)
CASES = [
    ("multi-label: float (B, L)", "multi_label_classification", 3, _floats(B, 3)),
    ("multi-label: float16 (B, L)", "multi_label_classification", 3, _floats(B, 3, dtype=torch.float16)),
    ("multi-label: float64 (B, L)", "multi_label_classification", 3, _floats(B, 3, dtype=torch.float64)),
    ("multi-label: long (B, L)", "multi_label_classification", 3, _ints(B, 3)),
    ("multi-label: int32 (B, L)", "multi_label_classification", 3, _ints(B, 3, dtype=torch.int32)),
    ("multi-label: bool (B, L)", "multi_label_classification", 3, _ints(B, 3, dtype=torch.bool)),
    ("multi-label: float (B,)", "multi_label_classification", 3, _floats(B)),
    ("multi-label: float (B, 2) for 3 labels", "multi_label_classification", 3, _floats(B, 2)),
    ("multi-label: long (B,)", "multi_label_classification", 3, _ints(B, high=3)),
    ("auto: float (B, L) is multi-label", None, 3, _floats(B, 3)),
    ("auto: float (B,) is multi-label, wrong shape", None, 3, _floats(B)),
    ("auto: int16 (B,) is multi-label, wrong dtype", None, 3, _ints(B, high=3, dtype=torch.int16)),
    ("auto: long (B, L) is single-label, one id per row expected", None, 3, _ints(B, 3)),
    ("auto: long (B,) is single-label", None, 3, _ints(B, high=3)),
    ("single-label: float (B,)", "single_label_classification", 3, _floats(B)),
    ("single-label: long (B, 1)", "single_label_classification", 3, _ints(B, 1, high=3)),
    ("single-label: long (B, 2)", "single_label_classification", 3, _ints(B, 2, high=3)),
    ("regression, 3 labels: float (B, L)", "regression", 3, _floats(B, 3)),
    ("regression, 3 labels: long (B, L)", "regression", 3, _ints(B, 3, high=3)),
    ("regression, 3 labels: float (B,)", "regression", 3, _floats(B)),
    ("regression, 1 label: long (B,)", None, 1, _ints(B, high=3)),
    ("regression, 1 label: float (B, 1)", None, 1, _floats(B, 1)),
    ("regression, 1 label: float64 (B,)", None, 1, _floats(B, dtype=torch.float64)),
    ("regression, 1 label: float (B, 2)", None, 1, _floats(B, 2)),
    ("multi-label, 1 label: float (B, 1)", "multi_label_classification", 1, _floats(B, 1)),
    ("multi-label, 1 label: float (B,)", "multi_label_classification", 1, _floats(B)),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import hf_pipeline

    root = tmp_path_factory.mktemp("labels")
    out = {}
    for n in (1, 3):
        path = tiny.make_checkpoint(
            root / f"bert-{n}", "bert", auto="AutoModelForSequenceClassification", num_labels=n,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        pipelined = hf_pipeline.AutoModelForSequenceClassification.from_pretrained(
            path, pipeline=True, device="cpu", progress=False, num_stages=2, virtual_stages=2
        )
        out[n] = (tiny.reference(path, "AutoModelForSequenceClassification"), pipelined)
    return out


def _loss(model, problem_type, inputs, labels):
    model.config.problem_type = problem_type  # transformers writes the type it picked back: reset per case
    try:
        with torch.no_grad():
            return float(model(**inputs, labels=labels).loss)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return e


@pytest.mark.parametrize("case,problem_type,num_labels,labels", CASES, ids=[c[0] for c in CASES])
def test_labels_equal_transformers_or_are_refused_up_front(models, case, problem_type, num_labels, labels):
    from hf_pipeline.errors import InputError

    ref, pipelined = models[num_labels]
    inputs = tiny.sample_inputs("bert", batch=B, seq=7)
    want = _loss(ref, problem_type, inputs, labels)
    got = _loss(pipelined, problem_type, inputs, labels)
    if isinstance(want, Exception):
        assert isinstance(got, InputError), f"{case}: transformers raised {want!r}, the pipeline gave {got!r}"
        message = str(got)
        assert "labels for problem_type=" in message, message
        assert str(tuple(labels.shape)) in message or str(labels.dtype) in message, message
    else:
        assert not isinstance(got, Exception), f"{case}: transformers computed {want}, the pipeline raised {got!r}"
        # transformers' BCE returns the loss in a float16 target's dtype (rounded to it); the pipeline
        # keeps fp32: equal within that dtype's resolution, else within fp32 summation order.
        eps = torch.finfo(labels.dtype).eps if labels.dtype.is_floating_point else 0.0
        tol = max(1e-5, eps) * max(1.0, abs(want))
        assert abs(got - want) <= tol, f"{case}: loss {got} != transformers' {want}"


def test_the_first_labelled_call_fixes_the_problem_type_as_in_transformers(models):
    from hf_pipeline.errors import InputError

    ref, pipelined = models[3]
    inputs = tiny.sample_inputs("bert", batch=B, seq=7)
    for model in (ref, pipelined):
        model.config.problem_type = None
        with torch.no_grad():
            model(**inputs, labels=_floats(B, 3))  # float targets: multi-label, written into the config
        assert model.config.problem_type == "multi_label_classification"
    with pytest.raises((RuntimeError, ValueError)):
        with torch.no_grad():
            ref(**inputs, labels=_ints(B, high=3))  # class ids no longer go to cross entropy
    with pytest.raises(InputError, match=r"labels for problem_type='multi_label_classification' must be float"):
        pipelined(**inputs, labels=_ints(B, high=3))
    with pytest.raises(InputError, match=r"must be float targets .*got dtype torch\.int64"):
        pipelined.train_step({**inputs, "labels": _ints(B, 3)})  # train_step: the same rule
    pipelined.config.problem_type = ref.config.problem_type = None
