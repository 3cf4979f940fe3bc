"""PipelineTrainer on a PEFT (LoRA) model equals transformers.Trainer + peft on one process.

The same arguments as tests/integrations/test_trainer.py (warm-up, accumulation 2, clipping, evaluation
and a checkpoint every 2 steps, 4 steps) on ``peft.get_peft_model(pipelined, LoraConfig(...))``
under one seed, at 1 process (in this process), 2 ranks (2 stages) and 4 ranks (2 stages x 2
replicas). Every rank checks, against ``transformers.Trainer`` training ``get_peft_model`` of the
unsplit model:

* the logged losses, gradient norms and learning rates, and the evaluation loss;
* every adapter entry after 4 steps;
* a run resumed from the step-2 checkpoint into a model with another adapter draw (so the adapter
  must be reloaded into the stages), with activation checkpointing on (``gradient_checkpointing=True``:
  the stages checkpoint their blocks, non-reentrant, which changes no number): the same adapter and
  history at the end as the uninterrupted run;
* the checkpoint's files: the adapter in PEFT's format and no base weights (as transformers writes
  a PEFT model's checkpoint), optimizer state per pipeline rank, RNG per rank; its adapter and the
  final ``save_model`` load with ``PeftModel.from_pretrained`` on one process, equal to the reference's.

Tolerances: as tests/integrations/test_trainer.py (2e-5 against lr-sized moves of 1e-2).
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest
import tiny
import torch
import transformers
from harness import run_distributed
from test_trainer import STEPS, TOL, _args, _assert_logs_equal, _dataset, _logs

peft = pytest.importorskip("peft")

BATCH = 4
SEED = 5
_DATA = {}


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM")


def _kwargs() -> dict:
    if not _DATA:
        data = _dataset("llama")
        _DATA.update(train_dataset=data, eval_dataset=data.select(range(12)))
    return dict(_DATA)


def _adapter(model) -> dict[str, torch.Tensor]:
    """Adapter entries by one-process name (``model.layers.0.self_attn.q_proj.lora_A.default.weight``)."""
    return {re.sub(r"^(base_model\.model\.)?(stages\.\d+\.)?", "", n): p.detach().clone()
            for n, p in model.named_parameters() if "lora_" in n}


def _train_rank(path: str, out: str, num_stages: int | None, extra: dict | None = None) -> dict:
    import hf_pipeline

    load = {"num_stages": num_stages, **(extra or {})} if num_stages else {}
    root, res = pathlib.Path(out), {}

    def trained(name: str, seed: int, resume: str | None = None, **overrides) -> tuple:
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=2, **load)
        torch.manual_seed(seed)
        lora = peft.get_peft_model(model, _lora())
        trainer = hf_pipeline.PipelineTrainer(model=lora, args=_args(root / name, BATCH, **overrides), **_kwargs())
        trainer.train(resume_from_checkpoint=resume)
        return model, lora, trainer

    model, lora, trainer = trained("run", SEED)
    res["logs"], res["adapter"] = _logs(trainer.state.log_history), _adapter(lora)
    res["eval"] = _logs([trainer.evaluate()])[0]
    trainer.save_model(str(root / "final"))
    checkpoint = root / "run" / "checkpoint-2"
    res["files"] = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())

    # Resumed with activation checkpointing on: it changes no number, so the end is the same.
    model, lora, trainer = trained("resumed", SEED + 1, resume=str(checkpoint), gradient_checkpointing=True)
    res["checkpointing"] = model.is_activation_checkpointing
    res["resumed_logs"], res["resumed"] = _logs(trainer.state.log_history), _adapter(lora)
    res["global_step"] = trainer.state.global_step
    return res


@functools.lru_cache(maxsize=None)
def _reference(path: str, batch: int, out: str) -> dict:
    torch.manual_seed(SEED)
    lora = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), _lora())
    trainer = transformers.Trainer(model=lora, args=_args(out, batch), **_kwargs())
    trainer.train()
    logs = _logs(trainer.state.log_history)
    return {"logs": logs, "eval": _logs([trainer.evaluate()])[0], "adapter": _adapter(lora)}


def _saved_adapter(path: str, adapter_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return _adapter(peft.PeftModel.from_pretrained(base, str(adapter_dir)))


def _assert_adapter_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(k for k in want if k in got) and got, f"{what}: names {sorted(set(got) - set(want))}"
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], atol=TOL, rtol=TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def _check(results: list[dict], path: str, out: pathlib.Path, dp: int, pp: int) -> None:
    ref = _reference(path, BATCH * dp, str(out.parent / f"ref-{dp}"))
    steps = [e for e in ref["logs"] if "loss" in e or "eval_loss" in e]
    seen: set[str] = set()
    for rank, got in enumerate(results):
        what = f"rank {rank}"
        _assert_logs_equal(got["logs"], ref["logs"], what)
        _assert_logs_equal([got["eval"]], [ref["eval"]], what + " evaluate()")
        _assert_adapter_equal(got["adapter"], ref["adapter"], what)
        assert got["checkpointing"], what + ": gradient_checkpointing=True did not reach the stages"
        assert got["global_step"] == STEPS, what
        _assert_logs_equal([e for e in got["resumed_logs"] if "loss" in e or "eval_loss" in e], steps, what)
        _assert_adapter_equal(got["resumed"], got["adapter"], what + " resumed")
        seen |= set(got["adapter"])
        files = got["files"]
        assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.json", "scheduler.json"} <= set(
            files), files
        assert not any("model.safetensors" in f and "adapter" not in f for f in files), f"base weights saved: {files}"
        assert sum(f.startswith("optimizer/pp-") for f in files) == pp, files
        assert sum(f.startswith("rng/") for f in files) == len(results), files
    assert seen == set(ref["adapter"]), f"adapter entries no rank holds: {sorted(set(ref['adapter']) - seen)[:3]}"
    # The final adapter, gathered from every rank, is peft's on one process.
    _assert_adapter_equal(_saved_adapter(path, out / "final"), ref["adapter"], "save_model")
    assert sorted(_saved_adapter(path, out / "run" / "checkpoint-2")) == sorted(ref["adapter"])


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(tiny.make_checkpoint(tmp_path_factory.mktemp("lora-trainer"), "llama"))


@pytest.mark.equiv  # two Trainer runs: about 2.5 s on 2 shared cores (test_lora.py's one-process check stays quick)
def test_lora_trainer_on_one_process_equals_peft_trainer(llama_path, tmp_path):
    _check([_train_rank(llama_path, str(tmp_path / "runs"), None)], llama_path, tmp_path / "runs", 1, 1)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world, num_stages, dp", [(2, 2, 1), (4, 2, 2)], ids=["pp2", "pp2xdp2"])
def test_lora_trainer_equals_peft_trainer(llama_path, tmp_path, world, num_stages, dp):
    results = run_distributed(_train_rank, world, llama_path, str(tmp_path / "runs"), num_stages, timeout=600)
    _check(results, llama_path, tmp_path / "runs", dp, num_stages)


def test_resuming_from_a_directory_without_an_adapter_is_refused_by_name(llama_path, tmp_path):
    import hf_pipeline
    from hf_pipeline.errors import CheckpointNotFoundError

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(llama_path, pipeline=True, n_microbatches=2)
    lora = peft.get_peft_model(model, _lora())
    trainer = hf_pipeline.PipelineTrainer(model=lora, args=_args(tmp_path / "run", BATCH, max_steps=2), **_kwargs())
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="adapter_model.safetensors does not exist"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "empty"))
    trainer.train()  # still usable
    assert trainer.state.global_step == 2


def test_resuming_from_an_unfinished_adapter_checkpoint_is_refused(llama_path, tmp_path):
    """A checkpoint whose trainer_state.json (written last) is missing was cut short: refused, not resumed at step 0."""
    import hf_pipeline
    from hf_pipeline.errors import CheckpointNotFoundError

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(llama_path, pipeline=True, n_microbatches=2)
    lora = peft.get_peft_model(model, _lora())
    trainer = hf_pipeline.PipelineTrainer(
        model=lora, args=_args(tmp_path / "run", BATCH, max_steps=2, eval_strategy="no"), **_kwargs())
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "optimizer" / "pp-00000.pt").is_file()
    (checkpoint / "trainer_state.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="save of this checkpoint did not finish"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
