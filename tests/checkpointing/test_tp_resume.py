"""Training state under tensor parallelism and FSDP, resumed on other mesh shapes: pp2 x tp2 -> pp4 / pp2 x
fsdp2 -> one process.

One 4-rank job loads a 4-layer LLaMA at pp2 x tp2, trains 2 steps (``train_step``, ``clip_grad_norm_``,
AdamW, a StepLR halving the LR each step) and saves with optimizer, scheduler and step. It goes on
for a third step (the uninterrupted run), then resumes the checkpoint at pp4, at pp2 x tp2 and at
pp2 x fsdp2 and takes that third step (the fsdp run saves its state again, compared with transformers'
AdamW state); the parent resumes it on one process. Against transformers on one process
(3 uninterrupted steps):

- the resumed step's loss (relative 1e-5) and every parameter after it (abs 1e-5; a step moves a
  parameter by about the LR, 1e-3, so a fresh optimizer, an LR not restored (2x) or a state slice
  from the wrong rank fail, while the sharded matmuls' other summation order stays near 1e-7);
- the pp2 x tp2 resume equals the uninterrupted pp2 x tp2 run bit for bit (the same arithmetic);
- the file holds every state tensor whole (``exp_avg`` of ``q_proj`` has the full parameter's shape),
  one file per pipeline rank, so the format is the one an unsharded run writes.

Each rank's parameters (its tensor-parallel slices and whole tensors) equal what ``plan_report(...,
tp_size=2)`` (``hf-pipeline plan --tp-size 2``) predicts for its pipeline rank, exactly.

The same job runs PipelineTrainer at pp2 x tp2 (4 steps, checkpoint every 2, evaluation) and
resumes it from checkpoint-2: its logs and parameters equal transformers' Trainer on one process
(tolerances as in tests/integrations/test_trainer.py).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import tiny
import torch
from harness import run_distributed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "integrations"))  # test_trainer's helpers
from test_trainer import BATCH, STEPS, _args, _assert_logs_equal, _assert_params_equal, _kwargs, _logs  # noqa: E402
from test_trainer import _reference as _trainer_reference  # noqa: E402

pytestmark = pytest.mark.dist

# TOL: fp32 losses (relative) and parameters after a resumed AdamW step (absolute): noise ~1e-6;
# a lost optimizer state or wrong step moves a parameter ~lr = 1e-3.
LR, EPS, TOL = 1e-3, 1e-5, 1e-5
PP2_TP2 = {"tp_size": 2, "num_stages": 2, "n_microbatches": 2}
PP4 = {"num_stages": 4, "n_microbatches": 2}
PP2_FSDP2 = {"fsdp_size": 2, "num_stages": 2, "n_microbatches": 2}


def _new_run(path, kwargs):
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", **kwargs)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _step(model, opt, sched, step: int) -> float:
    loss = float(model.train_step(tiny.make_batch("llama", 8, seed=step)))
    model.clip_grad_norm_(1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss


def _gathered(model) -> dict[str, torch.Tensor]:
    """Every local parameter by checkpoint key, whole (collective over the tensor-parallel ranks)."""
    from hf_pipeline.distributed.shards import full_tensor

    return {model.param_layout.key_of.get(n, n): full_tensor(p.detach()).clone()
            for n, p in model.checkpoint_named_parameters()}


def _resumed(path, kwargs, save_to=None) -> dict:
    from hf_pipeline.checkpointing.training_state import load_training_state

    model, opt, sched = _new_run(path, kwargs)
    state = load_training_state(model, path, optimizer=opt, scheduler=sched)
    out = {"step": state["step"], "loss": _step(model, opt, sched, 3), "params": _gathered(model),
           "dims": (model.dims.dp_size, model.dims.pp_size, model.dims.tp_size)}
    if save_to is not None:  # the state after the third step, saved from this mesh
        model.save_pretrained(save_to, optimizer=opt, scheduler=sched, step=3, max_shard_size="50KB")
    return out


def _trainer_run(path, out) -> dict:
    import hf_pipeline

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, **PP2_TP2)
    trainer = hf_pipeline.PipelineTrainer(model=model, args=_args(pathlib.Path(out) / "run", BATCH), **_kwargs("llama"))
    trainer.train()
    res = {"logs": _logs(trainer.state.log_history), "params": _gathered(model)}
    fresh = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, **PP2_TP2)
    resumed = hf_pipeline.PipelineTrainer(model=fresh, args=_args(pathlib.Path(out) / "resumed", BATCH),
                                          **_kwargs("llama"))
    resumed.train(resume_from_checkpoint=str(pathlib.Path(out) / "run" / "checkpoint-2"))
    res.update(resumed_logs=_logs(resumed.state.log_history), resumed=_gathered(fresh))
    return res


def _job(path, save_dir, trainer_out, fsdp_dir):
    model, opt, sched = _new_run(path, PP2_TP2)
    losses = [_step(model, opt, sched, step) for step in (1, 2)]
    model.save_pretrained(save_dir, optimizer=opt, scheduler=sched, step=2, max_shard_size="50KB")
    losses.append(_step(model, opt, sched, 3))
    out = {"losses": losses, "params": _gathered(model), "dims": (model.dims.dp_size, model.dims.pp_size,
                                                                  model.dims.tp_size)}
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in model.checkpoint_named_parameters()]
    out["held"] = (model.dims.pp_rank, sum(t.numel() for t in local), sum(t.numel() * t.element_size() for t in local))
    out["pp4"] = _resumed(save_dir, PP4)
    out["pp2xtp2"] = _resumed(save_dir, PP2_TP2)
    out["pp2xfsdp2"] = _resumed(save_dir, PP2_FSDP2, save_to=fsdp_dir)
    out["trainer"] = _trainer_run(path, trainer_out)
    return out


def _reference(path) -> dict:
    ref = tiny.reference(path, "AutoModelForCausalLM").train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses = []
    for step in (1, 2, 3):
        loss = ref(**tiny.make_batch("llama", 8, seed=step)).loss
        loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach() for n, p in ref.named_parameters()},
            "exp_avg": {n: opt.state[p]["exp_avg"] for n, p in ref.named_parameters()}}


def _check_resumed(what: str, got: dict, ref: dict) -> None:
    assert got["step"] == 2, f"{what}: step {got['step']}"
    assert abs(got["loss"] - ref["losses"][2]) <= TOL * abs(ref["losses"][2]), f"{what}: loss {got['loss']} {ref}"
    for key, want in ref["params"].items():
        if key in got["params"]:
            d = (got["params"][key] - want).abs().max().item()
            assert d <= TOL, f"{what}: {key} after the resumed step: max abs diff {d}"


@pytest.mark.slow
def test_state_saved_at_pp2_by_tp2_resumes_at_pp4_one_process_and_pp2_by_tp2(tmp_path):
    import hf_pipeline

    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    save_dir = tmp_path / "checkpoint-2"
    fsdp_dir = tmp_path / "checkpoint-3-fsdp"
    per_rank = run_distributed(_job, 4, path, str(save_dir), str(tmp_path / "trainer"), str(fsdp_dir), timeout=600)
    ref = _reference(path)

    # The file format is the unsharded one: whole tensors, one file per pipeline rank.
    index = __import__("json").loads((save_dir / "optimizer" / "index.json").read_text())
    assert sorted(set(index["state_files"].values())) == ["pp-00000.pt", "pp-00001.pt"], index
    assert set(index["state_files"]) == set(ref["params"]), "every parameter's state is saved"
    first = torch.load(save_dir / "optimizer" / "pp-00000.pt", weights_only=True)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert first["state"][q]["exp_avg"].shape == ref["params"][q].shape, first["state"][q]["exp_avg"].shape

    for rank, res in enumerate(per_rank):
        assert res["dims"] == (1, 2, 2) and res["pp4"]["dims"] == (1, 4, 1), (res["dims"], res["pp4"]["dims"])
        for got, want in zip(res["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank}: uninterrupted losses {res['losses']} {ref}"
        _check_resumed(f"rank {rank} pp4", res["pp4"], ref)
        _check_resumed(f"rank {rank} pp2 x tp2", res["pp2xtp2"], ref)
        _check_resumed(f"rank {rank} pp2 x fsdp2", res["pp2xfsdp2"], ref)
        # Same mesh, same arithmetic: the resumed run is the uninterrupted one, bit for bit.
        assert res["pp2xtp2"]["loss"] == res["losses"][2], f"rank {rank}"
        for key, want in res["params"].items():
            assert torch.equal(res["pp2xtp2"]["params"][key], want), f"rank {rank}: {key} not bitwise after resume"

    # Saved from pp2 x fsdp2 after the third step: every state gathered whole from its dim-0 chunks, equal to
    # transformers' AdamW state by name (a chunk from the wrong rank, or one rank's chunk alone, would differ
    # by the size of the state itself).
    saved = {}
    for name in sorted(set(index["state_files"].values())):
        saved.update(torch.load(fsdp_dir / "optimizer" / name, weights_only=True)["state"])
    assert set(saved) == set(ref["exp_avg"]), sorted(set(ref["exp_avg"]) ^ set(saved))
    for key, want in ref["exp_avg"].items():
        d = (saved[key]["exp_avg"] - want).abs().max().item()
        # fp32 Adam exp_avg (~1e-3): noise ~1e-9; the wrong shard's state or a missing step differs by
        # ~1e-3.
        assert d <= 1e-6, f"fsdp-saved exp_avg of {key}: max abs diff {d} (largest value {want.abs().max().item()})"

    # `hf-pipeline plan --tp-size 2` predicts exactly the parameters each pp2 x tp2 rank held.
    from hf_pipeline.memory.planner import plan_report

    plan = plan_report(path, stages=2, tp_size=2, n_microbatches=2, batch=2, seq=8)
    for rank, res in enumerate(per_rank):
        pp_rank, params, nbytes = res["held"]
        predicted = [s for s in plan.stages if s.rank == pp_rank]
        assert (params, nbytes) == (sum(s.params for s in predicted), plan.ranks[pp_rank].weight_bytes), rank
    whole = plan_report(path, stages=2, n_microbatches=2, batch=2, seq=8)
    assert plan.ranks[0].weight_bytes < whole.ranks[0].weight_bytes  # the prediction sees the slices

    # One process resumes the same checkpoint.
    from hf_pipeline.checkpointing.training_state import load_training_state

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(str(save_dir), pipeline=True, device="cpu",
                                                             n_microbatches=2)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = load_training_state(model, save_dir, optimizer=opt, scheduler=sched)
    one = {"step": state["step"], "loss": _step(model, opt, sched, 3), "params": _gathered(model)}
    assert set(one["params"]) == set(ref["params"])
    _check_resumed("one process", one, ref)

    # PipelineTrainer at pp2 x tp2 against transformers' Trainer on one process, and resumed from checkpoint-2.
    want = _trainer_reference(path, "llama", BATCH, str(tmp_path / "ref"))
    for rank, res in enumerate(per_rank):
        got, what = res["trainer"], f"PipelineTrainer pp2 x tp2 rank {rank}"
        _assert_logs_equal(got["logs"], want["logs"], what)
        _assert_params_equal(got["params"], want["params"], what)
        _assert_params_equal(got["resumed"], got["params"], what + " resumed")
        steps = [e for e in got["resumed_logs"] if "loss" in e or "eval_loss" in e]
        _assert_logs_equal(steps, [e for e in want["logs"] if "loss" in e or "eval_loss" in e], what + " resumed")
        assert len([e for e in got["logs"] if "loss" in e]) == STEPS, what
