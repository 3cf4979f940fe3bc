"""A failure inside a tensor-parallel stage, every process alive, does not end the job: pp2 x tp2.

As tests/distributed/test_survive.py at pp, on a tiny LLaMA loaded with ``tp_size=2`` on 4 ranks (stage
0 on ranks 0-1, stage 1 on ranks 2-3), all compared with single-process transformers in the parent:

  (a) a forward pass whose last stage raises on ONE of its two tensor-parallel ranks (rank 3), while its
      peer (rank 2) waits for it in the stage's all-reduce -> every rank raises within seconds (the
      culprit its own ``ValueError``, the others ``RankError`` naming it); the next forward's logits
      equal transformers' (the DTensor parameters now communicate in the fresh groups);
  (b) after an AdamW step (optimizer state exists, sharded like the parameters) and a clean
      ``train_step`` (gradients to keep), a training step failing on rank 2 in its 2nd microbatch
      (after the backward of the first) leaves every ``.grad`` bitwise as it was; ``opt.step()`` then
      gives transformers' parameters after two AdamW steps, and ``save_pretrained(optimizer=...)``
      gathers every state whole over the tensor-parallel ranks (collective over the renewed groups:
      through the old, destroyed ones it would raise), equal to transformers' ``exp_avg``.

Tolerances (fp32): the sharded matmuls sum in another order (~1e-7); parameters within 1e-5 absolute
after two AdamW steps of lr 1e-2 (each moves a parameter by ~1e-2: a lost or doubled gradient shows);
``exp_avg`` within 1e-6 (it is ~1e-3: the state of the wrong shard or of a missing step differs by that).
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed
from test_survive import _outcome, _raise_once, assert_parameters_equal, assert_told

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LR, EPS = 1e-2, 1e-5  # eps far above the tiny model's smallest gradients, as tests/checkpointing/test_tp_resume.py
ATOL = 1e-5
_TIMEOUT_S = 60  # the collective timeout of the job: every failure here must be over far sooner


def _job(path: str, save_dir: str) -> dict:
    import hf_pipeline
    from hf_pipeline.distributed.shards import full_tensor

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
        path, pipeline=True, device="cpu", tp_size=2, num_stages=2, n_microbatches=2, progress=False
    )
    rank = model.ctx.rank
    res: dict = {"rank": rank, "failed": {}, "tp": model.dims.tp_size}
    inputs = tiny.sample_inputs("llama", batch=4, seq=9)
    if rank == 3:
        _raise_once(model.stages[-1], ValueError("a bug in the last stage"))
    res["failed"]["forward"] = _outcome(lambda: model(**inputs))
    res["logits"] = model(**inputs).logits

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    model.train_step(tiny.make_batch("llama", 4, seed=1))
    opt.step()
    opt.zero_grad()
    model.train_step(tiny.make_batch("llama", 4, seed=2))
    before = {k: full_tensor(p.grad).clone() for k, p in model.checkpoint_named_parameters()}
    if rank == 2:
        _raise_once(model.stages[-1], ValueError("a bug in the last stage, again"), at=2)
    res["failed"]["train"] = _outcome(lambda: model.train_step(tiny.make_batch("llama", 4, seed=3)))
    after = {k: full_tensor(p.grad) for k, p in model.checkpoint_named_parameters()}
    res["grads_kept"] = all(torch.equal(before[k], after[k]) for k in before)
    opt.step()
    res["params"] = {model.param_layout.key_of.get(k, k): full_tensor(p.detach()).clone()
                     for k, p in model.checkpoint_named_parameters()}
    model.save_pretrained(save_dir, optimizer=opt, step=2)
    return res


def _reference(path):
    ref = tiny.reference(path, "AutoModelForCausalLM")
    with torch.no_grad():
        logits = ref(**tiny.sample_inputs("llama", batch=4, seq=9)).logits
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for seed in (1, 2):
        ref(**tiny.make_batch("llama", 4, seed=seed)).loss.backward()
        opt.step()
        opt.zero_grad()
    exp_avg = {n: opt.state[p]["exp_avg"] for n, p in ref.named_parameters()}
    return ref, logits, start, exp_avg


_EXPECTED = {  # call -> (culprit rank, its own exception type, what the others' RankError names)
    "forward": (3, "ValueError", "failed during a forward pass: ValueError: a bug in the last stage"),
    "train": (2, "ValueError", "failed during a training step: ValueError: a bug in the last stage, again"),
}


def test_a_failing_tensor_parallel_stage_leaves_the_pipeline_working(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    save_dir = tmp_path / "saved"
    results = run_distributed(_job, 4, str(path), str(save_dir), timeout=300,
                              env={"HF_PIPELINE_TIMEOUT": str(_TIMEOUT_S)})
    ref, logits, start, exp_avg = _reference(path)
    for res in results:
        rank = res["rank"]
        assert res["tp"] == 2, rank
        assert_told(res, _EXPECTED, stage_of=lambda culprit: 1)
        torch.testing.assert_close(res["logits"], logits, atol=ATOL, rtol=0)
        assert res["grads_kept"], f"rank {rank}: a failed train_step changed .grad"
        moved = assert_parameters_equal(res, ref, start)
        assert moved > 1e-3, "AdamW hardly moved the parameters: the comparison would not see a bad gradient"
    saved = {}
    for name in ("pp-00000.pt", "pp-00001.pt"):
        saved.update(torch.load(save_dir / "optimizer" / name, weights_only=True)["state"])
    assert set(saved) == set(exp_avg), sorted(set(saved) ^ set(exp_avg))[:3]
    for key, want in exp_avg.items():
        d = (saved[key]["exp_avg"] - want).abs().max().item()
        assert d <= 1e-6, f"exp_avg of {key} saved after the recovery: max abs diff {d}"
