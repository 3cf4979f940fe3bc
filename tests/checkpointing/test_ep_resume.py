"""Training state under expert parallelism, resumed on other meshes: pp1 x ep2 -> pp1 x ep2 and pp2.

One 2-rank job loads a tiny Mixtral with ``ep_size=2`` (each rank keeps 2 of every layer's 4 experts),
trains 2 steps (``train_step``, ``clip_grad_norm_``, AdamW, a StepLR halving the LR each step), saves
with optimizer, scheduler and step, and goes on for a third step (the uninterrupted run). It then resumes
the checkpoint with ``ep_size=2`` and as a plain 2-stage pipeline, and takes that third step. Against
transformers on one process (3 uninterrupted steps):

- the resumed step's loss (relative 1e-5) and every parameter after it (abs 1e-5; a step moves a
  parameter by about the LR, 1e-3, so a fresh optimizer, an LR not restored or another rank's experts'
  state fail, while the experts' outputs summed in another order stay near 1e-7);
- the ep2 resume equals the uninterrupted ep2 run bit for bit (the same arithmetic);
- the saved optimizer state holds each expert tensor's state whole (all 4 experts), as an unsharded run
  writes it.
"""

from __future__ import annotations

import json

import pytest
import torch
from decoders import decoder_config
from harness import run_distributed
from test_tp_resume import TOL, _gathered, _new_run, _reference, _step  # the same run, saved and resumed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EP2 = {"ep_size": 2, "n_microbatches": 2}
PP2 = {"num_stages": 2, "n_microbatches": 2}
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


def _resumed(path, kwargs) -> dict:
    from hf_pipeline.checkpointing.training_state import load_training_state

    model, opt, sched = _new_run(path, kwargs)
    state = load_training_state(model, path, optimizer=opt, scheduler=sched)
    return {"step": state["step"], "loss": _step(model, opt, sched, 3), "params": _gathered(model),
            "ep": model.options.ep_size}


def _job(path, save_dir):
    model, opt, sched = _new_run(path, EP2)
    losses = [_step(model, opt, sched, step) for step in (1, 2)]
    model.save_pretrained(save_dir, optimizer=opt, scheduler=sched, step=2)
    losses.append(_step(model, opt, sched, 3))
    return {"losses": losses, "params": _gathered(model), "ep2": _resumed(save_dir, EP2),
            "pp2": _resumed(save_dir, PP2)}


def _check_resumed(what: str, got: dict, ref: dict) -> None:
    assert got["step"] == 2, f"{what}: step {got['step']}"
    assert abs(got["loss"] - ref["losses"][2]) <= TOL * abs(ref["losses"][2]), f"{what}: loss {got['loss']} {ref}"
    assert got["params"] and set(got["params"]) <= set(ref["params"]), what
    for key, got_param in got["params"].items():
        d = (got_param - ref["params"][key]).abs().max().item()
        assert d <= TOL, f"{what}: {key} after the resumed step: max abs diff {d}"


def test_state_saved_at_ep2_resumes_at_ep2_bit_for_bit_and_at_pp2(tmp_path):
    import transformers

    path = tmp_path / "mixtral"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(decoder_config("mixtral")).save_pretrained(path)
    save_dir = tmp_path / "checkpoint-2"
    per_rank = run_distributed(_job, 2, str(path), str(save_dir), timeout=600)
    ref = _reference(str(path))

    index = json.loads((save_dir / "optimizer" / "index.json").read_text())
    state = {}
    for name in sorted(set(index["state_files"].values())):
        state.update(torch.load(save_dir / "optimizer" / name, weights_only=True)["state"])
    assert state[EXPERTS]["exp_avg"].shape == ref["params"][EXPERTS].shape, state[EXPERTS]["exp_avg"].shape

    assert set().union(*(res["pp2"]["params"] for res in per_rank)) == set(ref["params"])
    for rank, res in enumerate(per_rank):
        for got, want in zip(res["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank}: uninterrupted losses {res['losses']} {ref}"
        assert (res["ep2"]["ep"], res["pp2"]["ep"]) == (2, 1), rank
        _check_resumed(f"rank {rank} ep2", res["ep2"], ref)
        _check_resumed(f"rank {rank} pp2", res["pp2"], ref)
        assert set(res["ep2"]["params"]) == set(ref["params"]), f"rank {rank}: one stage holds every tensor"
        assert res["ep2"]["loss"] == res["losses"][2], f"rank {rank}"
        for key, want in res["params"].items():
            assert torch.equal(res["ep2"]["params"][key], want), f"rank {rank}: {key} not bitwise after resume"
