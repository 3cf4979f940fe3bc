"""TRL's RewardTrainer through ``PipelineTrainerMixin`` equals itself on one process.

``class PipelineRewardTrainer(PipelineTrainerMixin, trl.RewardTrainer)`` runs the reward trainer's own step: its
``compute_loss`` scores the chosen and rejected rows with the pipelined sequence-classification model (the
differentiable forward, ``training/differentiable.py``), with accelerate saying one process (its gathered rewards,
accuracy and margin are the whole batch's).

Against ``RewardTrainer`` on one process with the same arguments and seed, 3 SGD steps of 2 accumulated batches
of a LLaMA reward model (``num_labels=1``), on every rank: every logged value (loss, gradient norm, rewards,
accuracy, margin, token count) and every trained parameter. Cases: the default, a ``margin`` column with
``center_rewards_coefficient``, and a LoRA adapter from TRL's own ``peft_config`` (the score head trained whole, as
peft's sequence-classification task saves it), at pp=2; the default at pp=2 x dp=2 (one process with both
replicas' rows). Tolerances: SGD; logged values within 1e-4 relative, parameters within 1e-6 (found: ~1e-7); a
gradient off by 2x or one replica's rows alone move them by orders of magnitude more.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from harness import run_distributed
from test_trl_grpo import _compare, _params, _tokenizer, replicas_equal_one_process

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.dist

CASES = {
    "default": {},
    "margin": {"center_rewards_coefficient": 0.01},
    "lora": {},
}
_LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "init_lora_weights": False,
         "task_type": "SEQ_CLS"}


def _dataset(case: str):
    rows = {"chosen": [f"The answer {i} is {i * 3 % 7} and" for i in range(16)],
            "rejected": [f"No {i} answer at all {'x' * (i % 3)}" for i in range(16)]}
    if case == "margin":
        rows["margin"] = [0.1 * (i % 4) for i in range(16)]
    return datasets.Dataset.from_dict(rows)


def _train(trainer_class, model, path: str, out: pathlib.Path, case: str, batch: int) -> dict:
    settings = dict(per_device_train_batch_size=batch, max_steps=3, gradient_accumulation_steps=2, optim="sgd",
                    learning_rate=0.05, max_grad_norm=0.5, seed=3, logging_steps=1, save_strategy="no", report_to=[],
                    use_cpu=True, bf16=False, disable_tqdm=True)
    args = trl.RewardConfig(str(out / case), **{**settings, **CASES[case]})
    extra = {}
    if case == "lora":
        import peft

        torch.manual_seed(5)
        extra["peft_config"] = peft.LoraConfig(**_LORA)
    trainer = trainer_class(model=model, args=args, train_dataset=_dataset(case), processing_class=_tokenizer(path),
                            **extra)
    trainer.train()
    logs = [{k: v for k, v in e.items() if not any(t in k for t in ("runtime", "per_second", "time"))}
            for e in trainer.state.log_history]
    return {"logs": logs, "completions": [], "params": _params(trainer.model, case == "lora")}


def _rank(path: str, out: str, cases: list[str], num_stages: int | None) -> dict:
    import hf_pipeline
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineRewardTrainer(PipelineTrainerMixin, trl.RewardTrainer):
        pass

    results = {}
    for case in cases:
        model = hf_pipeline.AutoModelForSequenceClassification.from_pretrained(
            path, pipeline=True, progress=False, n_microbatches=2, num_stages=num_stages)
        results[case] = _train(PipelineRewardTrainer, model, path, pathlib.Path(out), case, 4)
    return results


def _reference(path: str, out: pathlib.Path, case: str, batch: int) -> dict:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    return _train(trl.RewardTrainer, model, path, out, case, batch)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A LLaMA reward model (the bundled default's shape, one score per sequence), sharded."""
    from hf_pipeline.tools.default_model import default_model_path

    source = default_model_path()
    tok = _tokenizer(source)
    config = transformers.AutoConfig.from_pretrained(source, num_labels=1, pad_token_id=tok.pad_token_id)
    config.initializer_range = 0.2  # rewards far apart: the log-sigmoid loss's gradient is not flat
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("reward") / "model"
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(path, max_shard_size="1MB")
    tok.save_pretrained(path)
    return str(path)


def test_reward_trainer_at_pp2_equals_trl_on_one_process(checkpoint, tmp_path):
    cases = list(CASES)
    per_rank = run_distributed(_rank, 2, checkpoint, str(tmp_path / "pipelined"), cases, None, timeout=900)
    for case in cases:
        want = _reference(checkpoint, tmp_path / "reference", case, 4)
        assert {"accuracy", "margin", "mean_reward"} <= set(want["logs"][0]), want["logs"][0]
        for r, result in enumerate(per_rank):
            _compare(f"{case} rank {r}", result[case], want)


def test_reward_trainer_at_pp2_x_dp2_equals_trl_on_one_process_with_both_replicas_rows(checkpoint, tmp_path):
    replicas_equal_one_process(_rank, _reference, checkpoint, tmp_path, "default")
