"""TRL's RLOOTrainer through ``PipelineTrainerMixin`` equals itself on one process.

``class PipelineRLOOTrainer(PipelineTrainerMixin, trl.RLOOTrainer)`` runs RLOO's own step as GRPO's runs
(``test_trl_grpo.py``): completions from the pipelined ``generate``, rewards and leave-one-out advantages from
RLOO's own code with accelerate saying one process, its loss from the log-probabilities of TRL's fused LM head
computed from the pipelined model's differentiable logits.

Against ``RLOOTrainer`` on one process with the same arguments and seed, 3 SGD steps of 2 accumulated batches,
on every rank: the sampled completions (RLOO's own sampling settings: the pipelined ``generate`` draws what
transformers draws from the global stream, every rank seeded as one process), every logged value and every trained
parameter. Cases: ``beta=0`` (full fine-tuning: a non-zero ``beta`` would load an unsplit reference, refused),
``num_iterations=2`` with ``steps_per_generation=4`` and ``normalize_advantages``, and a LoRA adapter with RLOO's
default ``beta`` (the reference is the model with its adapter disabled), at pp=2; the first at pp=2 x dp=2 (one
process with both replicas' rows). Tolerances as ``test_trl_grpo.py``'s (and why).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from harness import run_distributed
from test_trl_grpo import LORA, _compare, _dataset, _params, _tokenizer, checkpoint, replicas_equal_one_process, reward

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.dist

__all__ = ["checkpoint"]  # the shared fixture, imported for pytest

STEPS = 3
CASES = {
    "rloo": {"beta": 0.0},
    "iterations": {"beta": 0.0, "num_iterations": 2, "steps_per_generation": 4, "normalize_advantages": True},
    "lora": {},  # RLOO's default beta (0.05): the reference is the model with its adapter disabled
}


def _args(out: pathlib.Path, case: str, batch: int):
    settings = dict(per_device_train_batch_size=batch, num_generations=2, max_completion_length=8, max_steps=STEPS,
                    gradient_accumulation_steps=2, optim="sgd", learning_rate=0.05, max_grad_norm=0.5, seed=3,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)
    return trl.RLOOConfig(str(out / case), **{**settings, **CASES[case]})


def _train(trainer_class, model, path: str, out: pathlib.Path, case: str, batch: int) -> dict:
    if case == "lora":
        import peft

        torch.manual_seed(5)
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    trainer = trainer_class(model=model, reward_funcs=reward, args=_args(out, case, batch), train_dataset=_dataset(),
                            processing_class=_tokenizer(path))
    trainer.train()
    logs = [{k: v for k, v in e.items() if not any(t in k for t in ("runtime", "per_second", "time"))}
            for e in trainer.state.log_history]
    return {"logs": logs, "completions": list(trainer._logs["completion"]), "params": _params(model, case == "lora")}


def _rank(path: str, out: str, cases: list[str], num_stages: int | None) -> dict:
    import hf_pipeline
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineRLOOTrainer(PipelineTrainerMixin, trl.RLOOTrainer):
        pass

    results = {}
    for case in cases:
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False, n_microbatches=2,
                                                                 num_stages=num_stages)
        results[case] = _train(PipelineRLOOTrainer, model, path, pathlib.Path(out), case, 4)
    return results


def _reference(path: str, out: pathlib.Path, case: str, batch: int) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return _train(trl.RLOOTrainer, model, path, out, case, batch)


def test_rloo_at_pp2_equals_trl_on_one_process(checkpoint, tmp_path):
    cases = list(CASES)
    per_rank = run_distributed(_rank, 2, checkpoint, str(tmp_path / "pipelined"), cases, None, timeout=900)
    for case in cases:
        want = _reference(checkpoint, tmp_path / "reference", case, 4)
        assert len(want["logs"]) == STEPS + 1, case  # the steps' logs and the summary
        assert len(set(want["completions"])) > len(want["completions"]) // 2, want["completions"]  # groups differ
        for r, result in enumerate(per_rank):
            _compare(f"{case} rank {r}", result[case], want)


def test_rloo_at_pp2_x_dp2_equals_trl_on_one_process_with_both_replicas_rows(checkpoint, tmp_path):
    replicas_equal_one_process(_rank, _reference, checkpoint, tmp_path, "rloo")
