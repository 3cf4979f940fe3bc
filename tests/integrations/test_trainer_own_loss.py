"""A Trainer with a ``compute_loss`` of its own trains a pipelined model as it trains transformers' on one process.

``class PipelineSmoothed(PipelineTrainerMixin, SmoothedTrainer)``: the subclass's loss (label-smoothed cross
entropy over the shifted logits plus a z-loss, nothing the pipeline knows) is computed on every rank from the
pipelined model's differentiable outputs, and its backward runs the pipeline's step
(``training/differentiable.py``). Against ``SmoothedTrainer`` on one process with the same arguments and seed:
LR warm-up, gradient accumulation 2, clipping, 3 optimizer steps; the logged losses, gradient norms and every
parameter at the end, at pp=2 and at pp=2 x dp=2 (whose reference takes the replicas' rows at once); and a
subclass that calls transformers' own ``compute_loss`` (the model's loss through ``labels``), whose
``num_items_in_batch`` scaling must not count the pipeline's ranks as devices; and ``PipelineTrainer`` itself with
``label_smoothing_factor=0.1`` and with a ``compute_loss_func`` (transformers' loss over the outputs).

Tolerances as ``test_trainer.py``: a step moves parameters by about the learning rate (1e-2); 2e-5 is fp32
summation-order noise, so a gradient scaled by the process count, a missed accumulation scale or replicas
training the same rows fail.
"""

from __future__ import annotations

import pathlib

import datasets
import pytest
import tiny
import torch
import torch.nn.functional as F
import transformers
from harness import run_distributed

pytestmark = pytest.mark.dist

TOL = 2e-5
BATCH = 4
_RUNTIME = ("runtime", "per_second")


class SmoothedTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, label_smoothing=0.1)
        loss = loss + 1e-3 * logits.logsumexp(-1).pow(2).mean()
        return (loss, outputs) if return_outputs else loss


class ModelLossTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def z_loss(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func: the token loss summed over the accumulated batches' items, plus a z-loss."""
    logits = outputs.logits[:, :-1]
    summed = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")
    return summed / num_items_in_batch + 1e-3 * logits.logsumexp(-1).pow(2).mean()


TRAINERS = {"smoothed": SmoothedTrainer, "model_loss": ModelLossTrainer, "label_smoothing": transformers.Trainer,
            "compute_loss_func": transformers.Trainer}
# (TrainingArguments, constructor arguments) of a run
EXTRA = {"label_smoothing": ({"label_smoothing_factor": 0.1}, {}),
         "compute_loss_func": ({}, {"compute_loss_func": z_loss})}


def _dataset(rows: int = 24) -> datasets.Dataset:
    ids = tiny.sample_inputs("llama", batch=rows, seq=9, seed=3, pad_left=False)
    labels = ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)
    return datasets.Dataset.from_dict({"input_ids": ids["input_ids"].tolist(),
                                       "attention_mask": ids["attention_mask"].tolist(), "labels": labels.tolist()})


def _args(out, batch: int, name: str) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=2, learning_rate=1e-2,
        warmup_steps=1, max_grad_norm=0.5, logging_steps=1, max_steps=3, save_strategy="no", seed=7, data_seed=11,
        report_to=[], use_cpu=True, disable_tqdm=True, **EXTRA.get(name, ({}, {}))[0],
    )


def _logs(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if not any(r in k for r in _RUNTIME)} for e in history]


def _rank(path: str, out: str, num_stages: int | None) -> dict:
    import hf_pipeline
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    results = {}
    for name, base in TRAINERS.items():
        trainer_class = type(f"Pipeline{base.__name__}", (PipelineTrainerMixin, base), {})
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=2,
                                                                 num_stages=num_stages)
        args = _args(pathlib.Path(out) / name, BATCH, name)
        trainer = trainer_class(model=model, args=args, train_dataset=_dataset(), **EXTRA.get(name, ({}, {}))[1])
        trainer.train()
        results[name] = {"logs": _logs(trainer.state.log_history),
                         "params": {n: p.detach().clone() for n, p in model.checkpoint_named_parameters()}}
    return results


def _reference(path: str, out: pathlib.Path, name: str, batch: int) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = TRAINERS[name](model=model, args=_args(out / name, batch, name), train_dataset=_dataset(),
                             **EXTRA.get(name, ({}, {}))[1])
    trainer.train()
    return {"logs": _logs(trainer.state.log_history), "params": dict(model.named_parameters())}


def _compare(what: str, got: dict, want: dict) -> None:
    assert [sorted(e) for e in got["logs"]] == [sorted(e) for e in want["logs"]], what
    for g, w in zip(got["logs"], want["logs"], strict=True):
        for k, v in w.items():
            if isinstance(v, float):
                assert abs(g[k] - v) <= TOL * max(1.0, abs(v)), f"{what}: {k} {g[k]} != {v}"
    assert got["params"], what
    for n, p in got["params"].items():
        diff = (p - want["params"][n].detach()).abs().max().item()
        assert diff <= TOL, f"{what}: {n} differs by {diff:.3g}"


@pytest.mark.parametrize("world,num_stages", [(2, None), (4, 2)])
def test_a_trainer_with_its_own_loss_equals_it_on_one_process(tmp_path, world, num_stages):
    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    per_rank = run_distributed(_rank, world, path, str(tmp_path / "pipelined"), num_stages, timeout=600)
    replicas = world // 2
    for name in TRAINERS:
        want = _reference(path, tmp_path / "reference", name, BATCH * replicas)
        for r, result in enumerate(per_rank):
            _compare(f"{name} rank {r} of {world}", result[name], want)
