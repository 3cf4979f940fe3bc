"""A caller's ``StoppingCriteria`` see what transformers shows them: the whole batch, once per step.

transformers' ``generate`` calls them once per step with the batch's ids ``(B, cur_len)``; lm-eval's
``MultiTokenEOSCriteria`` keeps a done tracker of the batch's size and reads ``input_ids[i]`` for every
row, so a pipeline calling it per microbatch raised IndexError. Four prompts in two microbatches, greedy,
each request compared with single-process transformers given fresh criteria of the same kind:

  * ``lmeval``: the criterion written as lm-eval's (stop sequence searched in the tail of each row,
    token ids instead of text; ``True`` once every row has seen it), with a streamer: the rows see
    the sequence at different steps, so the ring feeds rows on after their tracker is set, and the
    batch stops where transformers stops it, with as many streamer puts;
  * ``per_row``: the same tracker returned per row, so some rows stop early and others go on;
  * ``count``: a criterion that records every call (ids and the number of score tensors), with an EOS
    that ends some rows first; ``count_scores`` the same with ``output_scores`` (every row stays in
    the ring; transformers passes the per-step scores so far).

Ids are integers: equal exactly. The recorded last score tensors are fp32 logits through transformers'
processors, whose only difference is the microbatches' summation order (~1e-6): compared within 1e-5
(a wrong row or step moves them by ~1e-1). One spawned job (2 ranks, one stage each) runs every request;
the same requests run in process at world 1 (2 stages on one rank).
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed
from test_generate import _one_thread  # noqa: F401 - the module's autouse fixture: one thread
from transformers import StoppingCriteria

NEW = 12
MICROBATCHES = 2
ATOL = 1e-5  # fp32 scores: only summation order differs from transformers


class _StopSequence(StoppingCriteria):
    """lm-eval's ``MultiTokenEOSCriteria`` (lm_eval/models/utils.py) with token ids instead of text: a done
    tracker of the batch's size, the sequence searched in the last ``len + 2`` generated ids of each row."""

    def __init__(self, sequence: list[int], initial_length: int, batch_size: int, *, per_row: bool = False):
        self.sequence, self.initial_length = list(sequence), initial_length
        self.done_tracker = [False] * batch_size
        self.lookback = len(sequence) + 2
        self.per_row = per_row

    def __call__(self, input_ids, scores, **kwargs):
        tails = input_ids[:, self.initial_length:][:, -self.lookback:].tolist()
        for i, done in enumerate(self.done_tracker):
            if not done:
                self.done_tracker[i] = _contains(tails[i], self.sequence)
        if self.per_row:
            return torch.tensor(self.done_tracker, dtype=torch.bool, device=input_ids.device)
        return False not in self.done_tracker


class _Recorder(StoppingCriteria):
    """Stops nothing; records each call's ids and how many per-step score tensors it was given."""

    def __init__(self):
        self.seen: list[tuple[torch.Tensor, int | None, torch.Tensor | None]] = []

    def __call__(self, input_ids, scores, **kwargs):
        last = None if scores is None else scores[-1].clone()
        self.seen.append((input_ids.clone(), None if scores is None else len(scores), last))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Collect:
    """A streamer that records what it is given."""

    def __init__(self):
        self.puts: list[torch.Tensor] = []

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        pass


def _contains(row: list[int], sequence: list[int]) -> bool:
    k = len(sequence)
    return any(row[j: j + k] == sequence for j in range(len(row) - k + 1))


def _first_hit(generated: list[int], sequence: list[int]) -> int | None:
    """The step at which the criterion first sees ``sequence`` in a row generating ``generated``."""
    for step in range(len(generated)):
        if _contains(generated[: step + 1][-(len(sequence) + 2):], sequence):
            return step
    return None


# --------------------------------------------------------------------------- run on every rank
def _criteria(kind: str, request: dict, batch: int):
    if kind == "count":
        return [_Recorder()]
    return [_StopSequence(request["sequence"], request["prompt_len"], batch, per_row=kind == "per_row")]


def _generate(model, inputs, request) -> dict:
    criteria = _criteria(request["criterion"], request, inputs["input_ids"].shape[0])
    streamer = _Collect() if request.get("stream") else None
    out = model.generate(**inputs, **request["kwargs"], stopping_criteria=criteria, streamer=streamer)
    ids = out.sequences if request["kwargs"].get("return_dict_in_generate") else out
    seen = criteria[0].seen if isinstance(criteria[0], _Recorder) else None
    return {"ids": ids, "seen": seen, "puts": streamer.puts if streamer is not None else None}


def _job(path: str, inputs: dict, requests: dict, load: dict) -> dict:
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False, **load)
    out = {label: _generate(model, inputs, request) for label, request in requests.items()}
    # The criteria run on the last stage's rank only; the ids come back on every rank.
    return {"rank": model.ctx.rank, "last": model.is_last_stage_rank, "out": out}


# --------------------------------------------------------------------------- references (parent process)
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    # Seeds whose greedy rows fit every request (the selections below assert it).
    path = tiny.make_checkpoint(tmp_path_factory.mktemp("criteria") / "llama", "llama", seed=1)
    ref = tiny.reference(path, "AutoModelForCausalLM")
    inputs = tiny.sample_inputs("llama", batch=4, seq=6, seed=5)
    prompt_len = inputs["input_ids"].shape[1]
    greedy = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, n_microbatches=MICROBATCHES)
    with torch.no_grad():
        free = ref.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=tiny.VOCAB + 5)
    rows = free[:, prompt_len:].tolist()
    requests = {
        "lmeval": dict(criterion="lmeval", sequence=_sequence(rows, every_row=True), stream=True),
        "per_row": dict(criterion="per_row", sequence=_sequence(rows, every_row=False)),
        "count": dict(criterion="count", eos=_early_eos(rows)),
        "count_scores": dict(criterion="count", eos=_early_eos(rows), scores=True),
    }
    for request in requests.values():
        request["prompt_len"] = prompt_len
        request["kwargs"] = dict(greedy, eos_token_id=request.pop("eos", tiny.VOCAB + 5))
        if request.pop("scores", False):
            request["kwargs"].update(return_dict_in_generate=True, output_scores=True)
        request["want"] = _reference(ref, inputs, request)
    return {"path": str(path), "inputs": inputs, "requests": requests, "free": free}


def _sequence(rows: list[list[int]], *, every_row: bool) -> list[int]:
    """A one- or two-token stop sequence that rows see at different steps: in every row before the end
    (``every_row``: lm-eval's whole-batch stop comes early), or in some rows early and not in others."""
    for k in (2, 1):
        for row in rows:
            for j in range(len(row) - k + 1):
                seq = row[j: j + k]
                if 0 in seq:  # the pad id: finished rows are full of it
                    continue
                hits = [_first_hit(r, seq) for r in rows]
                found = [h for h in hits if h is not None]
                if len(set(found)) < 2 or min(found) > NEW - 4:
                    continue
                if every_row and len(found) == len(rows) and max(found) < NEW - 2:
                    return seq
                if not every_row and (len(found) < len(rows) or max(found) == NEW - 1):
                    return seq
    raise AssertionError("no stop sequence fits; change the tiny model seed")


def _early_eos(rows: list[list[int]]) -> int:
    """A token some rows produce early and others never: EOS that ends some rows first."""
    for row in rows:
        for token in row[1: NEW // 2]:
            if token != 0 and sum(token in r for r in rows) < len(rows):
                return token
    raise AssertionError("no early EOS fits; change the tiny model seed")


def _reference(ref, inputs: dict, request: dict) -> dict:
    kwargs = {k: v for k, v in request["kwargs"].items() if k != "n_microbatches"}
    criteria = _criteria(request["criterion"], request, inputs["input_ids"].shape[0])
    streamer = _Collect() if request.get("stream") else None
    with torch.no_grad():
        out = ref.generate(**inputs, **kwargs, stopping_criteria=criteria, streamer=streamer)
    ids = out.sequences if kwargs.get("return_dict_in_generate") else out
    seen = criteria[0].seen if isinstance(criteria[0], _Recorder) else None
    return {"ids": ids, "seen": seen, "puts": streamer.puts if streamer is not None else None}


def _check(assets, result: dict) -> None:
    free, start = assets["free"], assets["inputs"]["input_ids"].shape[1]
    for label, request in assets["requests"].items():
        got, want = result["out"][label], request["want"]
        assert torch.equal(got["ids"], want["ids"]), f"{label}: ids differ from transformers"
        if label == "lmeval":  # the whole batch stopped early, where the last row saw the sequence
            assert want["ids"].shape[1] < free.shape[1], "lmeval: the batch should stop before max_new_tokens"
            puts = (len(got["puts"]), len(want["puts"]))
            assert puts[0] == puts[1], f"lmeval: {puts[0]} streamer puts, transformers made {puts[1]}"
            assert all(torch.equal(a, b) for a, b in zip(got["puts"], want["puts"])), "lmeval: streamed tokens differ"
        if label == "per_row":  # some rows stopped early (padded), others went on
            stopped = [not torch.equal(a, b) for a, b in zip(want["ids"][:, start:], free[:, start:])]
            assert any(stopped) and not all(stopped), f"per_row: rows stopped {stopped}"
        if want["seen"] is not None:
            calls = (len(got["seen"]), len(want["seen"]))
            assert calls[0] == calls[1], f"{label}: {calls[0]} calls, transformers made {calls[1]}"
            for step, ((ids, n, last), (w_ids, w_n, w_last)) in enumerate(zip(got["seen"], want["seen"])):
                assert ids.shape == w_ids.shape and torch.equal(ids, w_ids), f"{label}: call {step} saw other ids"
                assert n == w_n, f"{label}: call {step} got {n} score tensors, transformers {w_n}"
                if w_last is not None:
                    torch.testing.assert_close(last, w_last, atol=ATOL, rtol=0, msg=f"{label}: call {step} scores")




def test_caller_criteria_see_the_whole_batch_world_1(assets):
    # Two stages on one rank: the same ring, with local hand-offs.
    result = _job(assets["path"], assets["inputs"], assets["requests"], {"virtual_stages": 2})
    _check(assets, result)


@pytest.mark.dist
def test_caller_criteria_see_the_whole_batch_across_ranks(assets):
    per_rank = run_distributed(_job, 2, assets["path"], assets["inputs"], assets["requests"], {}, timeout=300)
    for result in per_rank:
        if result["last"]:
            _check(assets, result)
        else:  # the ids are the same on every rank; the criteria ran on the last stage's rank only
            for label, request in assets["requests"].items():
                ids = result["out"][label]["ids"]
                assert torch.equal(ids, request["want"]["ids"]), f"rank {result['rank']}: {label}"
                if request["criterion"] == "count":
                    assert result["out"][label]["seen"] == [], f"rank {result['rank']}: criteria ran off the last stage"


def test_tie_weights_is_a_documented_no_op(tmp_path):
    import hf_pipeline

    path = tiny.make_checkpoint(tmp_path / "llama", "llama", tie_word_embeddings=True)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False)
    before = {k: p.detach().clone() for k, p in model.checkpoint_named_parameters()}
    assert model.tie_weights() is None  # lm-eval's HFLM calls it after loading
    after = dict(model.checkpoint_named_parameters())
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The tie made at load: the embedding and the LM head are one Parameter on this (one) rank.
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
