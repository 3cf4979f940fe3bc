"""What a pipelined ``forward()`` returns: the head's outputs and, as transformers, its loss when the targets are given.

``model(**inputs, labels=labels).loss`` is computed from the gathered outputs. Under grad mode those outputs are
differentiable (``differentiable.py``) and so is the loss. Otherwise (``torch.no_grad()``, or
``gather_output=False``, where only the last stage's rank holds outputs) ``loss.backward()`` on it raises a
:class:`~hf_pipeline.errors.UsageError` that points at ``model.train_step``, instead of torch's
"element 0 of tensors does not require grad".
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from ..core import PipelineCore
from ..errors import UsageError
from ..families.losses import output_loss

__all__ = ["forward_result", "inference_only"]


class _NoBackward(torch.autograd.Function):
    """Identity whose backward says where training happens (the pipelined forward keeps no graph)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, guard: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise UsageError(
            "the loss of a pipelined forward() called under torch.no_grad() (or loaded with gather_output=False) "
            "cannot be backpropagated: call the forward with grad enabled, or train with loss = "
            "model.train_step(batch), which runs forward and backward through the pipeline schedule"
        )


def inference_only(loss: torch.Tensor) -> torch.Tensor:
    """``loss``'s value, with a backward that raises the :class:`UsageError` above."""
    # A graph of one node, so that loss.backward() reaches _NoBackward's message instead of torch's
    # "element 0 of tensors does not require grad".
    with torch.enable_grad():
        return _NoBackward.apply(loss.detach(), torch.zeros((), requires_grad=True))


def forward_result(model: PipelineCore, outputs: tuple[torch.Tensor, ...], names: tuple[str, ...],
                   targets: Mapping[str, Any], aux: tuple[torch.Tensor, float] | None, *, grad: bool,
                   num_items: Any = None):
    """The head's output class (e.g. ``CausalLMOutputWithPast``) for the gathered ``outputs``.

    Args:
        model: the pipelined model.
        outputs: the head's outputs in the recipe's order (differentiable when ``grad``).
        names: the targets of the head's loss; the loss is computed when every one is in ``targets``.
        targets: the call's targets under transformers' names.
        aux: the routers' load-balancing loss of the batch and its coefficient (``output_router_logits``), else None.
        grad: whether the outputs are differentiable (else the loss only reports).
        num_items: transformers' ``num_items_in_batch``: a token-level loss is then summed over it.
    """
    done = (lambda v: v) if grad else inference_only
    with torch.set_grad_enabled(grad):
        result = dict(zip(model.resolved.head.outputs, outputs))
        # As transformers: a loss when every target of the head's loss is given (QA: both positions).
        if names and all(k in targets for k in names):
            result["loss"] = output_loss(model, result, {k: targets[k] for k in names}, num_items=num_items)
        if aux is not None:
            result["aux_loss"], coef = aux
            if "loss" in result:
                result["loss"] = result["loss"] + coef * result["aux_loss"].to(result["loss"].device)
            return MoeCausalLMOutputWithPast(**{k: done(v) if k == "loss" else v for k, v in result.items()})
        if "loss" in result:
            result["loss"] = done(result["loss"])
    # The transformers output class of the head (a traced model records its own).
    return model.stage_maker.output_class(**result)
