"""PipelineTrainer on a pp2 x fsdp2 mesh against transformers.Trainer on one process, and resumed after a stop.

One 4-rank job loads a tiny LLaMA with ``fsdp_size=2`` (two data-parallel ranks, each holding half of every
stage's parameters as FSDP2 DTensor shards) and runs, with the arguments of tests/integrations/test_trainer.py
(LR warm-up, gradient accumulation 2, ``max_grad_norm`` small enough to clip, evaluation and a checkpoint
every 2 steps, 4 optimizer steps) and ``save_total_limit=1``:

- an uninterrupted run: its logged losses, gradient norms, learning rates and evaluation equal
  transformers' Trainer on one process with the global batch (``BATCH x 2`` rows), so each fsdp rank trained
  on its own rows (the same rows on both would log another loss and move the parameters by another
  gradient); every parameter, gathered whole, equals transformers' after the run; the optimizer holds the
  DTensor shards (half of every sharded parameter); the run directory keeps only its last checkpoint;
- a run stopped by a callback after step 2 (its checkpoint-2 written), then a fresh model and Trainer on the
  same directory with ``resume_from_checkpoint=True``: it ends at step 4 with every parameter equal to the
  uninterrupted run and to transformers', logs steps 3-4 as transformers does, and the rotation leaves only
  checkpoint-4; checkpoint-2 holds one RNG file per rank and one optimizer file per pipeline rank.

Tolerances as in tests/integrations/test_trainer.py (2e-5: a step moves a parameter by about the LR, 1e-2; a
missed clip, a wrong accumulation scale or a wrong optimizer-state shard fail).
"""

from __future__ import annotations

import pathlib

import pytest
import tiny
import torch
import transformers
from harness import run_distributed
from test_trainer import BATCH, STEPS, _args, _assert_logs_equal, _assert_params_equal, _kwargs, _logs, _reference

pytestmark = [pytest.mark.dist, pytest.mark.slow]

PP2_FSDP2 = {"fsdp_size": 2, "num_stages": 2, "n_microbatches": 2}


class _StopAt(transformers.TrainerCallback):
    """Stops training after step ``at`` (its checkpoint is still written): an interrupted run."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True
        return control


def _gathered(model) -> dict[str, torch.Tensor]:
    from hf_pipeline.distributed.shards import full_tensor

    return {model.param_layout.key_of.get(n, n): full_tensor(p.detach()).clone()
            for n, p in model.checkpoint_named_parameters()}


def _listing(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("checkpoint-"))


def _job(path: str, out: str) -> dict:
    import hf_pipeline

    out = pathlib.Path(out)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, **PP2_FSDP2)
    args = _args(out / "run", BATCH, save_total_limit=1)
    trainer = hf_pipeline.PipelineTrainer(model=model, args=args, **_kwargs("llama"))
    trainer.train()
    shards = [(tuple(p.to_local().shape), tuple(p.shape)) for g in trainer.optimizer.param_groups
              for p in g["params"] if hasattr(p, "to_local")]
    res = {"logs": _logs(trainer.state.log_history), "params": _gathered(model), "shards": shards,
           "dims": (model.dims.dp_size, model.dims.pp_size, model.dims.fsdp_size), "run": _listing(out / "run")}

    stopped_model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, **PP2_FSDP2)
    resumed_args = _args(out / "resumed", BATCH, save_total_limit=1)
    stopped = hf_pipeline.PipelineTrainer(model=stopped_model, args=resumed_args, callbacks=[_StopAt(2)],
                                          **_kwargs("llama"))
    stopped.train()
    checkpoint = out / "resumed" / "checkpoint-2"
    res["stopped"] = (stopped.state.global_step, sorted(str(p.relative_to(checkpoint))
                                                        for p in checkpoint.rglob("*") if p.is_file()))
    stopped_model.ctx.barrier()  # every rank listed checkpoint-2 before the resumed run rotates it away
    fresh = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, **PP2_FSDP2)
    resumed = hf_pipeline.PipelineTrainer(model=fresh, args=resumed_args, **_kwargs("llama"))
    resumed.train(resume_from_checkpoint=True)
    res.update(resumed_logs=_logs(resumed.state.log_history), resumed=_gathered(fresh),
               global_step=resumed.state.global_step, resumed_dir=_listing(out / "resumed"))
    return res


def test_trainer_on_pp2_by_fsdp2_equals_transformers_trainer_and_resumes(tmp_path):
    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    results = run_distributed(_job, 4, path, str(tmp_path / "runs"), timeout=900)
    want = _reference(path, "llama", BATCH * 2, str(tmp_path / "ref"))
    steps_of = lambda logs: [e for e in logs if "loss" in e or "eval_loss" in e]  # noqa: E731
    for rank, got in enumerate(results):
        what = f"PipelineTrainer pp2 x fsdp2 rank {rank}"
        assert got["dims"] == (2, 2, 2), what
        assert got["logs"] == results[0]["logs"], what + ": every rank logs the same"
        _assert_logs_equal(got["logs"], want["logs"], what)
        assert len([e for e in got["logs"] if "loss" in e]) == STEPS, what
        _assert_params_equal(got["params"], want["params"], what)
        # The optimizer steps this rank's half of each sharded parameter (FSDP2 shards dim 0).
        assert got["shards"] and all(local[0] < whole[0] for local, whole in got["shards"] if whole[0] > 1), what
        assert got["run"] == [f"checkpoint-{STEPS}"], f"{what}: save_total_limit=1 kept {got['run']}"
        # Stopped after step 2, resumed with resume_from_checkpoint=True: the uninterrupted run's end.
        step, files = got["stopped"]
        assert step == 2, what
        assert sum(f.startswith("rng/") for f in files) == len(results), files
        assert sorted(f for f in files if f.startswith("optimizer/pp-")) == [
            "optimizer/pp-00000.pt", "optimizer/pp-00001.pt"], files
        assert "trainer_state.json" in files and "scheduler.json" in files, files
        assert got["global_step"] == STEPS, what
        _assert_params_equal(got["resumed"], got["params"], what + " resumed vs uninterrupted")
        _assert_params_equal(got["resumed"], want["params"], what + " resumed vs transformers")
        _assert_logs_equal(steps_of(got["resumed_logs"]), steps_of(want["logs"]), what + " resumed")
        assert got["resumed_dir"] == [f"checkpoint-{STEPS}"], f"{what}: save_total_limit=1 kept {got['resumed_dir']}"
    seen = set().union(*(got["params"] for got in results))
    assert seen == set(want["params"]), f"parameters no rank holds: {sorted(set(want['params']) - seen)[:3]}"
