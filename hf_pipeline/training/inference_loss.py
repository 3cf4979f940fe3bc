"""The loss a pipelined ``forward()`` returns: a value to report, whose backward says how to train.

``model(**inputs, labels=labels).loss`` is computed from the gathered outputs of an inference run
(stages in eval mode, on different ranks, no graph kept). ``loss.backward()`` on it raises a
:class:`~hf_pipeline.errors.UsageError` that points at ``model.train_step``, instead of torch's
"element 0 of tensors does not require grad".
"""

from __future__ import annotations

import torch

from ..errors import UsageError

__all__ = ["inference_only"]


class _NoBackward(torch.autograd.Function):
    """Identity whose backward says where training happens (the pipelined forward keeps no graph)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, guard: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise UsageError(
            "the loss of a pipelined forward() cannot be backpropagated: forward runs the stages for inference "
            "only, on different ranks, and keeps no graph. Train with loss = model.train_step(batch), which runs "
            "forward and backward through the pipeline schedule, then optimizer.step()"
        )


def inference_only(loss: torch.Tensor) -> torch.Tensor:
    """``loss``'s value, with a backward that raises the :class:`UsageError` above."""
    # A graph of one node, so that loss.backward() reaches _NoBackward's message instead of torch's
    # "element 0 of tensors does not require grad".
    with torch.enable_grad():
        return _NoBackward.apply(loss.detach(), torch.zeros((), requires_grad=True))
