"""A failure inside a stage, with every process alive, does not end the job: the next call equals transformers.

One spawn per world size (2 and 3 ranks) runs, on a tiny LLaMA, one failing call after another and
a clean call after each, all compared with single-process transformers in the parent:

  (d) a forward pass whose last stage raises once -> every rank raises (the culprit its own
      ``ValueError``, the others ``RankError`` naming it); the next forward's logits equal transformers';
  (a) generate whose user ``LogitsProcessor`` raises at decode step 3 on the last stage, then
  (b) generate whose user ``StoppingCriteria`` raises -> the next greedy generate equals
      transformers' ``generate(do_sample=False)`` token for token;
  (c, e) after one clean ``train_step`` (gradients to accumulate), two failing steps in a row: the
      first stage runs out of memory (``torch.OutOfMemoryError``, once), then the last stage raises
      in its 3rd microbatch, after the backward of two (partial gradients exist).
      Each must leave every ``.grad`` bitwise as it was; then a clean step and ``SGD.step()`` give
      the parameters transformers gets from ``loss1.backward(); loss2.backward(); opt.step()``,
      compared by checkpoint key. A failed step that left its partial gradients behind would add
      up to 2x one batch's gradient to some parameters: far outside the tolerance.

Tolerances (fp32): only summation order differs from transformers (microbatches), so logits within
1e-5 absolute; parameters after one SGD step of lr 0.5 within 1e-5 absolute (the update itself is
~1e-2, checked below, so a missing or doubled gradient shows).
"""

from __future__ import annotations

import time

import pytest
import tiny
import torch
from harness import run_distributed
from transformers import LogitsProcessor, StoppingCriteria

LR = 0.5
ATOL = 1e-5
NEW = 6
_TIMEOUT_S = 60  # the collective timeout of the job: every failure here must be over far sooner
_FAST_S = 15.0


class _RaisingProcessor(LogitsProcessor):
    """A user's logits processor with a bug: raises on its ``at``-th call (decode step ``at``)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("the user's logits processor failed at step 3")
        return scores


class _RaisingCriteria(StoppingCriteria):
    """A user's stopping criterion with a bug: raises on its ``at``-th call."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyError("the user's stopping criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _raise_once(module, error: BaseException, at: int = 1) -> None:
    """The ``at``-th call of ``module`` from now raises ``error`` (as an out-of-memory in one stage would)."""
    original, calls = module.forward, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] < at:
            return original(*args, **kwargs)
        module.forward = original
        raise error

    module.forward = failing


def _outcome(call) -> dict:
    start = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what this test is about
        return {"type": type(e).__name__, "message": str(e), "failures": getattr(e, "failures", None),
                "seconds": time.monotonic() - start}
    return {"type": None}


def _train_batch(seed: int) -> dict[str, torch.Tensor]:
    return tiny.make_batch("llama", 4, seed=seed)


def _job(path: str) -> dict:
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", n_microbatches=4, progress=False
    )
    rank, last = model.ctx.rank, model.ctx.world_size - 1
    inputs = tiny.sample_inputs("llama", batch=4, seq=9)
    prompts = tiny.sample_inputs("llama", batch=4, seq=6)
    greedy = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    res: dict = {"rank": rank, "failed": {}}

    # (d) forward
    if rank == last:
        _raise_once(model.stages[-1], ValueError("a bug in the last stage"))
    res["failed"]["forward"] = _outcome(lambda: model(**inputs))
    res["logits"] = model(**inputs).logits
    # (a) logits processor, (b) stopping criterion: they run on the last stage's rank only
    res["failed"]["processor"] = _outcome(
        lambda: model.generate(**prompts, logits_processor=[_RaisingProcessor(3)], **greedy)
    )
    res["failed"]["criteria"] = _outcome(
        lambda: model.generate(**prompts, stopping_criteria=[_RaisingCriteria(2)], **greedy)
    )
    res["ids"] = model.generate(**prompts, **greedy)
    # (c, e) training: a clean step to accumulate on, two failing steps in a row, a clean step
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train_step(_train_batch(1))
    before = {k: p.grad.clone() for k, p in model.checkpoint_named_parameters()}
    if rank == 0:
        _raise_once(model.stages[0], torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    res["failed"]["oom"] = _outcome(lambda: model.train_step(_train_batch(2)))
    if rank == last:
        # Its 3rd microbatch: 1F1B has run the backward of the first two, whose gradients must go.
        _raise_once(model.stages[-1], ValueError("a bug in the last stage, again"), at=3)
    res["failed"]["train"] = _outcome(lambda: model.train_step(_train_batch(2)))
    after = {k: p.grad for k, p in model.checkpoint_named_parameters()}
    res["grads_kept"] = all(torch.equal(before[k], after[k]) for k in before)
    model.train_step(_train_batch(2))
    opt.step()
    res["params"] = {k: p.detach().clone() for k, p in model.checkpoint_named_parameters()}
    return res


def _reference(path):
    ref = tiny.reference(path, "AutoModelForCausalLM")
    with torch.no_grad():
        logits = ref(**tiny.sample_inputs("llama", batch=4, seq=9)).logits
        ids = ref.generate(**tiny.sample_inputs("llama", batch=4, seq=6), max_new_tokens=NEW, do_sample=False,
                           pad_token_id=0)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref.train()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for seed in (1, 2):
        ref(**_train_batch(seed)).loss.backward()
    opt.step()
    return ref, logits, ids, start


_EXPECTED = {  # call -> (culprit, its own exception type, what the others' RankError names)
    "forward": ("last", "ValueError", "failed during a forward pass: ValueError: a bug in the last stage"),
    "processor": ("last", "ValueError", "failed during generate: ValueError: the user's logits processor failed"),
    "criteria": ("last", "KeyError", "failed during generate: KeyError"),
    "oom": (0, "OutOfMemoryError", "failed during a training step: OutOfMemoryError: CUDA out of memory"),
    "train": ("last", "ValueError", "failed during a training step: ValueError: a bug in the last stage, again"),
}


def assert_told(res: dict, expected: dict, stage_of=lambda rank: rank) -> None:
    """Every failed call of ``expected`` (call -> (culprit rank, its own type, what the others are told)) raised
    on this rank within seconds: the culprit its own error, every other rank a RankError naming only it."""
    rank = res["rank"]
    for call, (culprit, own_type, told) in expected.items():
        got = res["failed"][call]
        # Told within seconds (the culprit waits 2 s to see whether every rank failed alike), far below the
        # collective timeout: a rank left waiting for it (a pipeline peer, a tp all-reduce) would show here.
        assert got["type"] is not None and got["seconds"] < _FAST_S, (call, rank, got)
        if rank == culprit:
            assert got["type"] == own_type, (call, rank, got)
        else:
            assert got["type"] == "RankError", (call, rank, got)
            assert got["message"].startswith(f"rank {culprit} (stage {stage_of(culprit)}) {told}"), (call, rank, got)
            assert list(got["failures"]) == [culprit]


def assert_parameters_equal(res: dict, ref, start: dict) -> float:
    """Every parameter this rank returned equals transformers' ``ref`` (ATOL); returns how far the step moved them."""
    moved = 0.0
    for key, p in res["params"].items():
        want = ref.get_parameter(key).detach()
        diff = (p - want).abs().max().item()
        assert diff <= ATOL, f"rank {res['rank']}: {key} differs from transformers by {diff:.3g}"
        moved = max(moved, (want - start[key]).abs().max().item())
    return moved


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_failing_stage_leaves_the_pipeline_working(tmp_path, world):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = run_distributed(_job, world, str(path), timeout=240, env={"HF_PIPELINE_TIMEOUT": str(_TIMEOUT_S)})
    ref, logits, ids, start = _reference(path)
    for res in results:
        rank = res["rank"]
        assert_told(res, {c: (world - 1 if who == "last" else who, *rest) for c, (who, *rest) in _EXPECTED.items()})
        torch.testing.assert_close(res["logits"], logits, atol=ATOL, rtol=0)
        assert torch.equal(res["ids"], ids), (rank, res["ids"], ids)
        assert res["grads_kept"], f"rank {rank}: a failed train_step changed .grad"
        moved = assert_parameters_equal(res, ref, start)
        assert moved > 1e-3, "the SGD step hardly moved the parameters: the comparison would not see a bad gradient"
