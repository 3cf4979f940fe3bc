"""The inputs a careful attacker tries next, each either equal to transformers or refused on every rank.

One table of cases, run in one 2-rank job (LLaMA causal LM and BERT sequence classification,
``n_microbatches=2``). A case either computes, and its result (logits, loss, tokens; NaN where
transformers gives NaN) must equal transformers' on one process on every rank, or transformers raises
(or would read values that are not there) and every rank must raise the named ``InputError`` within
seconds, before any stage runs. The job ends with a correct call, so the refusals left the process
group usable. ``docs/errors.md`` ("The next cases") lists them.
"""

from __future__ import annotations

import re
import time

import pytest
import tiny
import torch
from harness import run_distributed

_FAST_S = 10.0  # per refused case, on every rank
_ATOL = 1e-5  # fp32, the same modules in the same order: only summation order differs
_MODELS: dict = {}


def _x(rows=2, seq=9):
    return tiny.sample_inputs("llama", batch=rows, seq=seq, seed=1)


def _prompt():
    return tiny.sample_inputs("llama", batch=2, seq=5, seed=2)


def _embeds(dtype=torch.float32, nan=False):
    e = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    if nan:
        e[1, 3, 5] = float("nan")  # one value: row 1 turns NaN from position 3 on (causal), row 0 stays finite
    return e.to(dtype)


def _zero_row(mask):
    mask = mask.clone()
    mask[0] = 0
    return mask


def _all_ignored(m):
    return torch.full_like(_x()["input_ids"], -100)


def _train_all_ignored(m):
    # transformers: the mean over no tokens is NaN, and every gradient is zero (nothing to learn from).
    if hasattr(m, "train_step"):
        loss = m.train_step({**_x(), "labels": _all_ignored(m)})
    else:
        m.zero_grad()
        loss = m(**_x(), labels=_all_ignored(m)).loss
        loss.backward()
    grad = sum(float(p.grad.abs().sum()) for p in m.parameters() if p.grad is not None)
    m.zero_grad()
    return torch.stack([loss.detach().float(), torch.tensor(grad)])


def _eos_after_one(m):
    # The EOS token is row 0's first greedy token: row 0 finishes at once, row 1 goes on padded.
    return int(m.generate(**_prompt(), max_new_tokens=1, do_sample=False)[0, -1])


def _other_model_config():
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=50256, eos_token_id=50256, max_new_tokens=3, do_sample=False)  # GPT-2's


# name -> (model, fn(model) -> tensor). Each must equal transformers' (NaN where it has NaN).
EQUAL = {
    "forward: labels all -100 (no token to learn from)": ("llama", lambda m: m(**_x(), labels=_all_ignored(m)).loss),
    "train_step: labels all -100": ("llama", _train_all_ignored),
    "forward: attention_mask with a row of zeros": (
        "llama", lambda m: m(input_ids=_x()["input_ids"], attention_mask=_zero_row(_x()["attention_mask"])).logits),
    "forward: NaN in inputs_embeds": ("llama", lambda m: m(inputs_embeds=_embeds(nan=True)).logits),
    "forward: float16 inputs_embeds of a float32 model": (
        "llama", lambda m: m(inputs_embeds=_embeds(torch.float16)).logits),
    "forward: negative position_ids (rotary positions)": (
        "llama", lambda m: m(input_ids=_x()["input_ids"], position_ids=torch.arange(9).expand(2, 9) - 4).logits),
    "forward: non-contiguous input_ids and attention_mask": (
        "llama", lambda m: m(**{k: v.t().contiguous().t() for k, v in _x().items()}).logits),
    "forward: float attention_mask": (
        "llama", lambda m: m(input_ids=_x()["input_ids"], attention_mask=_x()["attention_mask"].float()).logits),
    "forward: bool attention_mask": (
        "llama", lambda m: m(input_ids=_x()["input_ids"], attention_mask=_x()["attention_mask"].bool()).logits),
    "generate: a GenerationConfig of another model (GPT-2's special tokens)": (
        "llama", lambda m: m.generate(**_prompt(), generation_config=_other_model_config())),
    "generate: attention_mask with a row of zeros": (
        "llama", lambda m: m.generate(input_ids=_prompt()["input_ids"], attention_mask=_zero_row(
            _prompt()["attention_mask"]), max_new_tokens=3, do_sample=False)),
    "generate: a float attention_mask that requires grad": (
        "llama", lambda m: m.generate(input_ids=_prompt()["input_ids"], attention_mask=_prompt()[
            "attention_mask"].float().requires_grad_(), max_new_tokens=3, do_sample=False)),
}

_MULTI = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
# name -> (model, fn(model), expected message). Every rank raises an InputError (a ValueError) matching it.
REFUSED = {
    "forward: a batch of 0 rows": (
        "llama", lambda m: m(input_ids=torch.empty(0, 5, dtype=torch.long)),
        r"input_ids of shape \(0, 5\) holds no rows; pass at least one"),
    "forward: input_ids on the meta device": (
        "llama", lambda m: m(input_ids=_x()["input_ids"].to("meta")),
        r"input_ids is on the meta device: it has a shape \(2, 9\) but no values"),
    "forward: attention_mask on the meta device": (
        "llama", lambda m: m(input_ids=_x()["input_ids"], attention_mask=_x()["attention_mask"].to("meta")),
        r"attention_mask is on the meta device"),
    "generate: input_ids on the meta device": (
        "llama", lambda m: m.generate(input_ids=_prompt()["input_ids"].to("meta"), max_new_tokens=2),
        r"input_ids is on the meta device"),
    "generate: attention_mask on the meta device": (
        "llama", lambda m: m.generate(input_ids=_prompt()["input_ids"], attention_mask=_prompt()[
            "attention_mask"].to("meta"), max_new_tokens=2),
        r"attention_mask is on the meta device"),
    "forward: float64 inputs_embeds of a float32 model": (
        "llama", lambda m: m(inputs_embeds=_embeds(torch.float64)),
        r"inputs_embeds has dtype torch\.float64, but the model computes in torch\.float32 \(transformers raises"),
    "train_step: float64 inputs_embeds": (
        "llama", lambda m: m.train_step({"inputs_embeds": _embeds(torch.float64), "labels": _x()["input_ids"]}),
        r"inputs_embeds has dtype torch\.float64, but the model computes in torch\.float32"),
    "forward: integer inputs_embeds": (
        "llama", lambda m: m(inputs_embeds=_embeds().long()),
        r"inputs_embeds must be a floating point tensor of shape \(batch, length, 32\)"),
    "generate: inputs_embeds": (
        "llama", lambda m: m.generate(inputs_embeds=_embeds(torch.float64), max_new_tokens=2),
        r"generate\(\.\.\., inputs_embeds=\.\.\.\) is not supported by pipelined generation"),
    "generate: max_new_tokens=-1": (
        "llama", lambda m: m.generate(**_prompt(), max_new_tokens=-1),
        r"`max_new_tokens` must be greater than 0, but is -1"),
    "generate: num_return_sequences=2 without sampling": (
        "llama", lambda m: m.generate(**_prompt(), max_new_tokens=2, num_return_sequences=2, do_sample=False),
        r"Greedy methods \(do_sample != True\) without beam search do not support `num_return_sequences` different "
        r"than 1 \(got 2\)"),
    "generate: pad_token_id beyond the vocabulary, a row finishing early": (
        "llama", lambda m: m.generate(**_prompt(), max_new_tokens=4, do_sample=False, pad_token_id=500,
                                      eos_token_id=_eos_after_one(m)),
        r"pad_token_id=500 is outside the model's vocabulary of 96 tokens \(config\.vocab_size\): a row that "
        r"finishes early is filled with it"),
    "generate: negative pad_token_id, a row finishing early": (
        "llama", lambda m: m.generate(**_prompt(), max_new_tokens=4, do_sample=False, pad_token_id=-1,
                                      eos_token_id=_eos_after_one(m)),
        r"pad_token_id=-1 is outside the model's vocabulary"),
    "forward (BERT, multi-label): integer labels": (
        "bert", lambda m: _multi_label(m)(**_x(), labels=_MULTI.long()),
        r"labels for problem_type='multi_label_classification' must be float targets \(BCEWithLogitsLoss\), got "
        r"dtype torch\.int64"),
    "train_step (BERT, 3 labels): float labels of shape (batch,)": (
        "bert", lambda m: m.train_step({**_x(), "labels": torch.tensor([0.5, 1.0])}),
        r"labels for problem_type='multi_label_classification' \(picked, as transformers does, from "
        r"config\.num_labels=3 and the labels' dtype\) must be shape \(batch, num_labels\) = \(2, 3\), got \(2,\)"),
}


def _run(fn, model):
    start = time.monotonic()
    try:
        out = fn(model)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return ("raised", type(e).__name__, str(e), time.monotonic() - start)
    return ("ok", out.detach().clone() if torch.is_tensor(out) else out)


def _multi_label(m):
    m.config.problem_type = "multi_label_classification"
    return m


def _bert_config(m):
    m.config.problem_type = None  # each case picks its own, as on a fresh model


def _job(llama: str, bert: str):
    import hf_pipeline

    _MODELS["llama"] = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        llama, pipeline=True, device="cpu", progress=False, n_microbatches=2)
    _MODELS["bert"] = hf_pipeline.AutoModelForSequenceClassification.from_pretrained(
        bert, pipeline=True, device="cpu", progress=False, n_microbatches=2)
    results = {}
    for name, (which, fn, *_) in {**EQUAL, **REFUSED}.items():
        _bert_config(_MODELS["bert"])
        results[name] = _run(fn, _MODELS[which])
    # A correct call after all of that: the agreed refusals left the group usable.
    _bert_config(_MODELS["bert"])
    results["after"] = _run(lambda m: m(**_x(), labels=_MULTI).loss, _MODELS["bert"])
    return results


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or not torch.equal(got.isnan(), want.isnan()):
        return False
    if not got.is_floating_point():
        return torch.equal(got, want)
    return bool(((got - want).nan_to_num().abs() <= _ATOL).all())


@pytest.mark.dist
@pytest.mark.slow  # ~25 s on 2 cores: two loads and 28 cases on 2 ranks, plus the references
def test_attacker_inputs_equal_transformers_or_are_refused_on_every_rank(tmp_path):
    llama = tiny.make_checkpoint(tmp_path / "llama", "llama")
    bert = tiny.make_checkpoint(
        tmp_path / "bert", "bert", auto="AutoModelForSequenceClassification", num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    per_rank = run_distributed(_job, 2, str(llama), str(bert), timeout=300, env={"OMP_NUM_THREADS": "1"})
    refs = {"llama": tiny.reference(llama, "AutoModelForCausalLM"),
            "bert": tiny.reference(bert, "AutoModelForSequenceClassification")}
    problems = []
    for name, (which, fn) in EQUAL.items():
        with torch.enable_grad() if name.startswith("train_step") else torch.no_grad():
            want = fn(refs[which]).detach()
        for rank, results in enumerate(per_rank):
            got = results[name]
            if got[0] != "ok":
                problems.append(f"{name}: rank {rank} raised {got[1]}: {got[2][:300]}")
            elif not _same(got[1], want):
                problems.append(f"{name}: rank {rank} gave {got[1].flatten()[:6].tolist()}, transformers "
                                f"{want.flatten()[:6].tolist()}")
    for name, (_, _, pattern) in REFUSED.items():
        for rank, results in enumerate(per_rank):
            got = results[name]
            if got[0] != "raised" or got[1] not in ("InputError", "InputTypeError") or not re.search(pattern, got[2]):
                problems.append(f"{name}: rank {rank} gave {got[:3]}")
            elif got[3] > _FAST_S:
                problems.append(f"{name}: rank {rank} took {got[3]:.1f} s")
    refs["bert"].config.problem_type = None
    with torch.no_grad():
        after = refs["bert"](**_x(), labels=_MULTI).loss
    for rank, results in enumerate(per_rank):
        if results["after"][0] != "ok" or abs(float(results["after"][1]) - float(after)) > _ATOL:
            problems.append(f"the correct call afterwards: rank {rank} gave {results['after'][:3]}, not {after}")
    assert not problems, "\n".join(problems)
