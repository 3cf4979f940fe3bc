"""Task heads from the recipes (sequence / token classification, question answering) equal transformers.

Every (family, head) pair is loaded from a real sharded checkpoint with ``pipeline=True``: at world 1
(two local stages, in-process) and at world 2 (one spawned gloo job running every case). Each output
field must equal transformers' within 1e-5 (fp32; the stages run HF's own modules in HF's order, so
only summation order differs). Heads with a training loss also take one SGD step: loss and the
updated parameters equal transformers'. A model class whose head no recipe has goes to the tracer
under ``split_method="auto"`` and is refused under ``"recipe"``.
"""

from __future__ import annotations

import pytest
import tiny
import torch
import transformers
from harness import run_distributed

from hf_pipeline.errors import RecipeError

# fp32 head outputs, losses and parameters after one SGD step (lr 0.1): summation order ~1e-6;
# a wrong head weight, label or gradient moves them by 1e-2 or more.
ATOL = 1e-5
LR = 0.1
# Dropout off everywhere (the classifier's own included), so training-mode outputs are deterministic.
NO_DROPOUT = {
    "llama": {"classifier_dropout": 0.0},
    "gpt2": {
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "classifier_dropout": 0.0,
    },
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0},
}
HEADS = ("AutoModelForSequenceClassification", "AutoModelForTokenClassification", "AutoModelForQuestionAnswering")
CASES = [(arch, auto) for arch in ("bert", "gpt2", "llama") for auto in HEADS]
# Heads trained through train_step here (question answering and multiple choice:
# tests/families/test_qa_and_multiple_choice.py).
TRAINED = ("AutoModelForSequenceClassification", "AutoModelForTokenClassification")


def _batch(arch: str, auto: str, rows: int = 4) -> dict[str, torch.Tensor]:
    inputs = tiny.sample_inputs(arch, batch=rows, seq=9, pad_left=arch != "bert")
    g = torch.Generator().manual_seed(7)
    if auto == "AutoModelForSequenceClassification":
        inputs["labels"] = torch.randint(0, 2, (rows,), generator=g)
    elif auto == "AutoModelForTokenClassification":
        inputs["labels"] = torch.randint(0, 2, inputs["input_ids"].shape, generator=g).masked_fill(
            inputs["attention_mask"] == 0, -100
        )
    return inputs


def _case(path, arch, auto, load_kwargs):
    """Pipelined outputs (and, for trained heads, loss and parameters after one SGD step)."""
    import hf_pipeline

    model = getattr(hf_pipeline, auto).from_pretrained(path, pipeline=True, device="cpu", progress=False, **load_kwargs)
    batch = _batch(arch, auto)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    result = {"class": type(model).__name__, "outputs": {k: v.clone() for k, v in out.items() if torch.is_tensor(v)}}
    if auto in TRAINED:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        result["loss"] = float(model.train_step(batch))
        opt.step()
        layout = model.param_layout
        result["params"] = {
            layout.key_of.get(n, n): p.detach().clone() for s in model.stages for n, p in s.named_parameters()
        }
    return result


def _job(cases):
    return [_case(*case) for case in cases]


def _reference(path, arch, auto):
    ref = tiny.reference(path, auto)
    batch = _batch(arch, auto)
    with torch.no_grad():
        out = ref(**{k: v for k, v in batch.items() if k != "labels"})
    result = {"outputs": {k: v for k, v in out.items() if torch.is_tensor(v)}}
    if auto in TRAINED:
        ref.train()
        opt = torch.optim.SGD(ref.parameters(), lr=LR)
        loss = ref(**batch).loss
        loss.backward()
        opt.step()
        result["loss"] = float(loss.detach())
        result["params"] = dict(ref.named_parameters())
    return result


def _compare(what, got, want):
    assert set(got["outputs"]) == set(want["outputs"]), (
        f"{what}: output fields {sorted(got['outputs'])} != {sorted(want['outputs'])}"
    )
    for name, w in want["outputs"].items():
        g = got["outputs"][name]
        assert g.shape == w.shape, f"{what}: {name} shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert (g - w).abs().max().item() <= ATOL, f"{what}: {name} differs by {(g - w).abs().max().item():.2e}"
    if "loss" in want:
        assert abs(got["loss"] - want["loss"]) <= ATOL * max(1.0, abs(want["loss"])), (
            f"{what}: loss {got['loss']} != {want['loss']}"
        )
        for name, p in got["params"].items():
            diff = (p - want["params"][name]).abs().max().item()
            assert diff <= ATOL, f"{what}: parameter {name} after one SGD step differs by {diff:.2e}"


class _OnFirstUse(dict):
    """A case's checkpoint or reference, made when a test first asks for it: the quick tier runs 3 of the 9."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, case):
        self[case] = made = self._make(case)
        return made


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return _OnFirstUse(
        lambda case: str(tiny.make_checkpoint(root / "-".join(case), case[0], auto=case[1], **NO_DROPOUT[case[0]]))
    )


@pytest.fixture(scope="module")
def references(checkpoints):
    return _OnFirstUse(lambda case: _reference(checkpoints[case], *case))


# One head per architecture in the quick tier (each architecture and each head once); the other 6 cases go
# the same paths and run in the full suite (1 to 2 s each on 2 shared cores).
QUICK = {("bert", HEADS[0]), ("gpt2", HEADS[1]), ("llama", HEADS[2])}


@pytest.mark.parametrize(
    "arch,auto",
    [case if case in QUICK else pytest.param(*case, marks=pytest.mark.equiv) for case in CASES],
    ids=[f"{a}-{b.removeprefix('AutoModelFor')}" for a, b in CASES],
)
def test_head_at_world_1_with_two_local_stages_equals_transformers(checkpoints, references, arch, auto):
    got = _case(checkpoints[arch, auto], arch, auto, {"num_stages": 2, "virtual_stages": 2})
    assert got["class"] == "PipelinedModel", f"{arch} {auto}: built by the tracer, not the recipe"
    _compare(f"{arch} {auto} world 1", got, references[arch, auto])


@pytest.mark.dist
def test_every_head_at_world_2_equals_transformers(checkpoints, references):
    cases = [(checkpoints[c], *c, {}) for c in CASES]
    per_rank = run_distributed(_job, 2, cases, timeout=600)
    for rank, results in enumerate(per_rank):
        for (_path, arch, auto, _), got in zip(cases, results, strict=True):
            _compare(f"{arch} {auto} world 2 rank {rank}", got, references[arch, auto])


def test_question_answering_train_step_without_positions_names_them(checkpoints):
    # Question answering trains on transformers' start_positions / end_positions
    # (tests/families/test_qa_and_multiple_choice.py);
    # a batch with neither says so before anything is sent.
    import hf_pipeline

    path = checkpoints["llama", "AutoModelForQuestionAnswering"]
    model = hf_pipeline.AutoModelForQuestionAnswering.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    batch = _batch("llama", "AutoModelForQuestionAnswering")
    with pytest.raises(
        ValueError, match=r"no \['start_positions', 'end_positions'\].*LlamaForQuestionAnswering trains on"
    ):
        model.train_step({**batch, "labels": torch.zeros(4, dtype=torch.long)})


def test_gpt2_sequence_classification_auto_uses_the_recipe(checkpoints):
    import hf_pipeline

    path = checkpoints["gpt2", "AutoModelForSequenceClassification"]
    model = hf_pipeline.AutoModelForSequenceClassification.from_pretrained(
        path, pipeline=True, device="cpu", progress=False, split_method="auto"
    )
    assert type(model).__name__ == "PipelinedModel" and model.resolved.head.suffix == "ForSequenceClassification"


@pytest.mark.equiv  # the tracer on BERT: about 2.5 s on 2 shared cores
def test_head_without_recipe_entry_falls_back_to_the_tracer_under_auto(tmp_path):
    from hf_pipeline.families.recipe import get_recipe
    from hf_pipeline.model import TracedPipelinedModel, load_pipelined

    auto = "AutoModelForNextSentencePrediction"
    assert get_recipe("bert").match_head("BertForNextSentencePrediction") is None  # still uncovered by the recipe
    path = str(tiny.make_checkpoint(tmp_path, "bert", auto=auto, **NO_DROPOUT["bert"]))
    inputs = tiny.sample_inputs("bert", batch=4, seq=9, pad_left=False)
    # No hf_pipeline Auto class for it: the loader takes transformers' own.
    model = load_pipelined(transformers.AutoModelForNextSentencePrediction, path, device="cpu", progress=False,
                           num_stages=2, virtual_stages=2, split_method="auto")
    assert isinstance(model, TracedPipelinedModel)
    with torch.no_grad():
        want = tiny.reference(path, auto)(**inputs).logits
    got = model(**inputs).logits
    assert got.shape == want.shape and (got - want).abs().max().item() <= ATOL
    with pytest.raises(RecipeError, match=r"BertForNextSentencePrediction.*ForQuestionAnswering"):
        load_pipelined(
            transformers.AutoModelForNextSentencePrediction, path, device="cpu", progress=False, split_method="recipe"
        )


def test_t5_encoder_model_uses_the_recipe_and_t5_model_the_tracer():
    # T5EncoderModel is the T5 recipe's "EncoderModel" head (its encoder stack alone; forward equal to
    # transformers in tests/families/test_qa_and_multiple_choice.py); T5Model (encoder-decoder without a head) has none.
    from hf_pipeline.planning.options import PipelineOptions

    cfg = tiny.config_for("t5")
    assert not PipelineOptions.resolve(cfg, 1, auto_class=transformers.T5EncoderModel, num_stages=1).traced
    assert PipelineOptions.resolve(cfg, 1, auto_class=transformers.T5Model, num_stages=1).traced


def test_classes_ending_in_model_are_not_taken_for_the_base_model():
    # BertLMHeadModel (a causal LM head) and GPT2DoubleHeadsModel end in "Model" like the base
    # models; the recipe's base head must not serve them (it would drop their heads silently).
    import transformers

    from hf_pipeline.families.recipe import RecipeError, get_recipe
    from hf_pipeline.loading.stages import meta_model
    from hf_pipeline.planning.options import PipelineOptions
    from hf_pipeline.planning.resolve import resolve_recipe

    for arch, cls in (("bert", "BertLMHeadModel"), ("gpt2", "GPT2DoubleHeadsModel")):
        cfg = tiny.config_for(arch)
        assert PipelineOptions.resolve(cfg, 1, auto_class=getattr(transformers, cls), num_stages=1).traced, cls
        with pytest.raises(RecipeError, match=cls):
            resolve_recipe(meta_model(cfg, cls), get_recipe(cfg.model_type))
    for arch, cls in (("bert", "BertModel"), ("gpt2", "GPT2Model"), ("llama", "LlamaForCausalLM")):
        assert not PipelineOptions.resolve(tiny.config_for(arch), 1, auto_class=cls, num_stages=1).traced, cls
