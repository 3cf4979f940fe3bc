"""TRL's KTOTrainer through ``PipelineTrainerMixin`` equals itself on one process.

``class PipelineKTOTrainer(PipelineTrainerMixin, trl.KTOTrainer)`` runs KTO's own step: its policy, KL and
reference log-probabilities come from TRL's fused LM head computed from the pipelined model's logits
(differentiable for the policy, ``training/fused_head.py``), its loss and metrics from its own code with accelerate
saying one process. The reference is the model with its adapter disabled (a PEFT model), or the log-probabilities
KTO precomputes before training (``precompute_ref_log_probs=True``, full fine-tuning), computed by the pipelined
forward as one process on every rank.

Against ``KTOTrainer`` on one process with the same arguments and seed, 3 SGD steps of 2 accumulated batches (2 for
``apo``), on every rank: every logged value (loss, gradient norm, rewards, log-probabilities, KL, logits, entropy,
token count) and every trained parameter. Cases: LoRA with the default ``kto`` loss, full fine-tuning with
precomputed reference log-probabilities and unequal desirable weights, LoRA with ``apo_zero_unpaired`` (no KL
term), at pp=2; LoRA at pp=2 x tp=2, where precomputing is refused.

Tolerances as ``test_trl_grpo.py``'s (and why), but the values made of sequence log-probabilities (``kl``,
``rewards/*``, ``logps/*``: sums near -80) are compared at that scale (:data:`FLOORS`: within 8e-4). Their round-off
(TRL's tiled head, ~1e-6 relative a token; tensor parallelism's sums in another order) leaves the differences of
such sums (the KL estimate, the rewards) up to ~1e-4 apart, while a reference that is not the model without its
adapter, or not its log-probabilities before training, moves them by 1e-2 and more.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from harness import run_distributed
from test_trl_grpo import LORA, _compare, _params, _tokenizer, checkpoint

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.dist

__all__ = ["checkpoint"]  # the shared fixture, imported for pytest

FLOORS = {"kl": 8.0, "rewards/": 8.0, "logps/": 8.0}
CASES = {
    "lora": {},
    "precompute": {"precompute_ref_log_probs": True, "desirable_weight": 1.3},
    # 2 steps: its third step's gradient norm amplifies the first two steps' round-off to ~3e-4 (parameters 7e-7)
    "apo": {"loss_type": "apo_zero_unpaired", "beta": 0.3, "max_steps": 2},
}


def _dataset():
    return datasets.Dataset.from_dict({
        "prompt": [f"Question {i}: what is {i} plus" for i in range(16)],
        "completion": [f" {i + (i % 3)} {'right' if i % 3 == 0 else 'maybe'}" for i in range(16)],
        "label": [i % 3 == 0 or i % 4 == 1 for i in range(16)],
    })


def _train(trainer_class, model, path: str, out: pathlib.Path, case: str, batch: int) -> dict:
    settings = dict(per_device_train_batch_size=batch, max_steps=3, gradient_accumulation_steps=2, optim="sgd",
                    learning_rate=0.05, max_grad_norm=0.5, seed=3, logging_steps=1, save_strategy="no", report_to=[],
                    use_cpu=True, bf16=False, disable_tqdm=True)
    args = trl.KTOConfig(str(out / case), **{**settings, **CASES[case]})
    adapter = case != "precompute"
    if adapter:
        import peft

        torch.manual_seed(5)
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    trainer = trainer_class(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer(path))
    trainer.train()
    logs = [{k: v for k, v in e.items() if not any(t in k for t in ("runtime", "per_second", "time"))}
            for e in trainer.state.log_history]
    return {"logs": logs, "completions": [], "params": _params(model, adapter)}


def _rank(path: str, out: str, cases: list[str], tp_size: int) -> dict:
    import hf_pipeline
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineKTOTrainer(PipelineTrainerMixin, trl.KTOTrainer):
        pass

    results = {}
    for case in cases:
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False, n_microbatches=2,
                                                                 num_stages=2, tp_size=tp_size)
        results[case] = _train(PipelineKTOTrainer, model, path, pathlib.Path(out), case, 4)
    return results


def _reference(path: str, out: pathlib.Path, case: str) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return _train(trl.KTOTrainer, model, path, out, case, 4)


def test_kto_at_pp2_equals_trl_on_one_process(checkpoint, tmp_path):
    cases = list(CASES)
    per_rank = run_distributed(_rank, 2, checkpoint, str(tmp_path / "pipelined"), cases, 1, timeout=900)
    for case in cases:
        want = _reference(checkpoint, tmp_path / "reference", case)
        assert any(e.get("rewards/margins") for e in want["logs"]), want["logs"]  # the reference and policy part
        for r, result in enumerate(per_rank):
            _compare(f"{case} rank {r}", result[case], want, FLOORS)


def _refused_then_lora(path: str, out: str) -> dict:
    """Under tensor parallelism: precomputed reference log-probabilities refused (TRL hashes the tensors with numpy,
    which cannot read DTensor shards) with the model usable, then the LoRA case."""
    import hf_pipeline
    from hf_pipeline.errors import UsageError
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineKTOTrainer(PipelineTrainerMixin, trl.KTOTrainer):
        pass

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False, n_microbatches=2,
                                                             num_stages=2, tp_size=2)
    with pytest.raises(UsageError, match=r"^precompute_ref_log_probs=True is not supported .* tp_size=2: "):
        _train(PipelineKTOTrainer, model, path, pathlib.Path(out), "precompute", 4)
    return _train(PipelineKTOTrainer, model, path, pathlib.Path(out), "lora", 4)


def test_kto_at_pp2_x_tp2_equals_trl_on_one_process(checkpoint, tmp_path):
    per_rank = run_distributed(_refused_then_lora, 4, checkpoint, str(tmp_path / "pipelined"), timeout=900)
    want = _reference(checkpoint, tmp_path / "reference", "lora")
    for r, result in enumerate(per_rank):
        _compare(f"lora rank {r} of pp2 x tp2", result, want, FLOORS)
