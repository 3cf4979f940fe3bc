"""The shared fine-tuning loop (hf_pipeline.training.loop) on a one-parameter stand-in model.

The stand-in records each ``train_step`` call, so the tests check what the loop asks of the model
(batch numbers, loss scales, clipping), what it logs and when it saves, without any pipeline.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from hf_pipeline.training.loop import StepRecord, run_training


class _Model:
    """``loss = w * batch`` (the batch is its number); gradients accumulate into ``w.grad``."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.ctx = types.SimpleNamespace(is_main_process=True)
        self.calls: list[tuple[int, float]] = []
        self.clipped: list[float] = []

    def train_step(self, batch, *, loss_scale: float = 1.0, autocast=None) -> torch.Tensor:
        self.calls.append((batch, loss_scale))
        loss = self.w * batch
        (loss * loss_scale).backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.clipped.append(max_norm)
        return torch.nn.utils.clip_grad_norm_([self.w], max_norm, norm_type)


def _optimizer(model: _Model):
    opt = torch.optim.SGD([model.w], lr=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def test_accumulation_reads_consecutive_batches_and_logs_their_mean(tmp_path):
    model = _Model()
    opt, sched = _optimizer(model)
    log = tmp_path / "log.jsonl"
    records = run_training(model, lambda i: float(i), opt, sched, steps=2, grad_accum=3, max_grad_norm=1e9,
                           log_file=log)
    # Step s reads batches 3s, 3s+1, 3s+2, each loss scaled by 1/3.
    # Float arithmetic on exact small numbers (w = 1, batches 0, 1, 2): rounding only (default 1e-6 relative);
    # a wrong scale or a batch too many or few moves these by 1/3 or more.
    assert [b for b, _ in model.calls] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(scale == pytest.approx(1 / 3) for _, scale in model.calls)
    assert [r.step for r in records] == [1, 2]
    assert records[0].loss == pytest.approx((0 + 1 + 2) / 3)  # w = 1 for the first step
    assert records[0].grad_norm == pytest.approx(1.0)  # d/dw of the mean of w * (0, 1, 2)
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm} for r in records
    ]


def test_resume_starts_at_its_step_and_saves_every_k_and_at_the_end():
    model = _Model()
    opt, sched = _optimizer(model)
    saved: list[int] = []
    records = run_training(model, lambda i: 1.0, opt, sched, steps=5, start_step=2, grad_accum=2, save_every=2,
                           save=saved.append)
    assert [r.step for r in records] == [3, 4, 5]
    assert [b for b, _ in model.calls] == [1.0] * 6
    assert saved == [4, 5]


def test_no_clipping_below_zero_gives_a_nan_norm():
    model = _Model()
    opt, sched = _optimizer(model)
    (record,) = run_training(model, lambda i: 1.0, opt, sched, steps=1, max_grad_norm=0.0)
    assert model.clipped == [] and record.grad_norm != record.grad_norm
    assert isinstance(record, StepRecord) and json.loads(record.to_json())["step"] == 1
