"""What a pipelined ``forward()`` returns: the head's outputs and, as transformers, its loss when the targets are given.

``model(**inputs, labels=labels).loss`` is computed from the gathered outputs. Under grad mode those outputs are
differentiable (``differentiable.py``) and so is the loss. Otherwise (``torch.no_grad()``, or
``gather_output=False``, where only the last stage's rank holds outputs) ``loss.backward()`` on it raises a
:class:`~hf_pipeline.errors.UsageError` that points at ``model.train_step``, instead of torch's
"element 0 of tensors does not require grad".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from ..core import PipelineCore
from ..errors import InputError, UsageError
from ..families.losses import output_loss
from .fused_head import fused_output

__all__ = ["CallTargets", "forward_result", "inference_only"]


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


@dataclass(kw_only=True)
class CallTargets:
    """What a forward call's keyword arguments ask of the outputs, besides the model's inputs.

    Attributes:
        names: the targets of the head's loss (transformers' names); the loss is computed when all are given.
        targets: the given ones.
        num_items: transformers' ``num_items_in_batch``: a token-level loss is then summed over it.
        fused: TRL's ``fused_lm_head=True``: the labels' log-probabilities instead of the model's loss
            (``fused_head.py``), with its ``shift_labels`` if given.
    """

    names: tuple[str, ...]
    targets: dict[str, Any]
    num_items: Any = None
    fused: bool = False
    shift_labels: torch.Tensor | None = None

    @classmethod
    def take(cls, kwargs: dict[str, Any], names: tuple[str, ...]) -> CallTargets:
        """Pop them from a forward call's ``kwargs``."""
        targets = {k: kwargs.pop(k) for k in dict.fromkeys(("labels", *names)) if k in kwargs}
        call = cls(names=names, targets={k: v for k, v in targets.items() if v is not None},
                   num_items=kwargs.pop("num_items_in_batch", None), fused=bool(kwargs.pop("fused_lm_head", False)),
                   shift_labels=kwargs.pop("shift_labels", None))
        if call.shift_labels is not None and not call.fused:
            raise InputError("shift_labels is taken with fused_lm_head=True only (TRL's fused head); the model's own "
                             "loss shifts labels itself: pass labels")
        return call


def forward_result(model: PipelineCore, outputs: tuple[torch.Tensor, ...], call: CallTargets,
                   aux: tuple[torch.Tensor, float] | None, *, grad: bool):
    """The head's output class (e.g. ``CausalLMOutputWithPast``) for the gathered ``outputs``.

    Args:
        model: the pipelined model.
        outputs: the head's outputs in the recipe's order (differentiable when ``grad``).
        call: the call's targets and what it asks of the outputs.
        aux: the routers' load-balancing loss of the batch and its coefficient (``output_router_logits``), else None.
        grad: whether the outputs are differentiable (else the loss only reports).
    """
    done = (lambda v: v) if grad else inference_only
    with torch.set_grad_enabled(grad):
        if call.fused:
            return fused_output(outputs[0], call.targets.get("labels"), shift_labels=call.shift_labels,
                                num_items=call.num_items, head=model.fused_head)
        result = dict(zip(model.resolved.head.outputs, outputs))
        # As transformers: a loss when every target of the head's loss is given (QA: both positions).
        if call.names and all(k in call.targets for k in call.names):
            result["loss"] = output_loss(model, result, {k: call.targets[k] for k in call.names},
                                         num_items=call.num_items)
        if aux is not None:
            result["aux_loss"], coef = aux
            if "loss" in result:
                result["loss"] = result["loss"] + coef * result["aux_loss"].to(result["loss"].device)
            return MoeCausalLMOutputWithPast(**{k: done(v) if k == "loss" else v for k, v in result.items()})
        if "loss" in result:
            result["loss"] = done(result["loss"])
    # The transformers output class of the head (a traced model records its own).
    return model.stage_maker.output_class(**result)
