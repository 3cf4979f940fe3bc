"""The pipelined forward as a differentiable function: ``loss = f(model(**inputs)); loss.backward()``.

transformers' models train as ``loss = f(model(**batch)); loss.backward(); optimizer.step()``, and so does
every Trainer with a loss of its own (a ``compute_loss`` over the logits: TRL's trainers, a user's subclass).
The pipelined forward runs the stages on different ranks without keeping a graph (an inference run of torch's
schedule, :meth:`~hf_pipeline.model.PipelinedModel.forward`) and gives every rank the head's outputs. Under
grad mode those outputs come back as the outputs of one autograd node (:func:`differentiable_outputs`). Its
backward receives ``g``, the gradient of the caller's loss with respect to each output, and runs one training
step of the pipeline (``model.train_step``: the model's schedule, its data-parallel split and gradient sync)
whose loss on the last stage is ``sum(outputs * g)``. That loss's gradient with respect to every parameter is
``(d outputs / d theta)^T g``, by the chain rule what ``loss.backward()`` leaves in ``.grad`` on one process.

* **Collective.** Every rank computes the same loss from the same (gathered) outputs, so every rank calls
  ``backward`` and reaches the node; only the last stage's ranks read their ``g`` (each replica its own
  rows), so ``g`` need not be bitwise equal across ranks.
* **Cost.** The forward runs twice (once for the outputs, once inside the step, which keeps each
  microbatch's graph under the schedule), and every rank gathers the outputs and computes the loss over them:
  1.44-1.52x ``train_step``'s time for the model's own loss on the benchmark's LLaMA (16 x 128 tokens, vocab
  8192, 2 ranks). A loss the pipeline knows (the model's own, TRL's SFT and DPO through
  ``PipelineTrainerMixin``) trains through ``model.train_step`` and pays neither.
* **Any batch.** The step pads the rows to what the schedule splits (repeating the last row, with a zero
  ``g``), as the inference forward pads.
* **Refused at backward, on every rank**, naming the cause: dropout active while the forward ran in training
  mode (the step's forward would draw other masks than the outputs the loss saw: set the config's dropout
  probabilities to 0, or ``model.eval()``), the routers' load-balancing loss (``output_router_logits``, whose
  gradient the step adds by itself), and ``logits_to_keep`` as a tensor of positions.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ..core import PipelineCore
from ..distributed.agreement import collective_errors
from ..errors import InputError, UsageError
from ..families.losses import LossFunction
from ..runtime.cache import pad_batch
from ..runtime.checks import check_microbatches
from .step import forward_arguments

__all__ = ["differentiable_outputs", "padded_rows"]

# Forward arguments that change what comes back, not what is computed: the step takes none of them.
_OUTPUT_ONLY = ("use_cache", "return_dict", "logits_to_keep")
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass(kw_only=True)
class _Gradients:
    """The output gradients of the backward running now, read by the surrogate loss on the last stage."""

    grads: Sequence[torch.Tensor | None] = ()
    loss: LossFunction | None = field(default=None)


def _surrogate(holder: _Gradients) -> LossFunction:
    # sum(outputs * g) over the microbatch's rows: its gradient with respect to the outputs is g. The targets are
    # the rows' places in the call's batch (a padded row points past the end, at a zero gradient).
    def share(outputs, rows, config, denominator):
        rows = rows.long()
        total = None
        for out, g in zip(outputs, holder.grads):
            if g is None:
                continue
            term = (out.float() * g.to(out.device)[rows]).sum()
            total = term if total is None else total + term
        return total if total is not None else outputs[0].float().sum() * 0.0

    return LossFunction(name="pipeline_output_gradient", share=share, count=lambda targets, config: 1,
                        token_level=False, targets=("rows",), make_targets=lambda given, length: given["rows"])


# One per model, one loss object each: the step keeps the schedule built with a loss.
_HOLDERS: weakref.WeakKeyDictionary[nn.Module, _Gradients] = weakref.WeakKeyDictionary()


def _state(model: nn.Module) -> _Gradients:
    holder = _HOLDERS.get(model)
    if holder is None:
        holder = _Gradients()
        holder.loss = _surrogate(holder)
        _HOLDERS[model] = holder
    return holder


def _dropout(model: nn.Module) -> str | None:
    """A module of this rank's stages that drops out in training mode (its name and probability), if any."""
    for stage in model.stages:
        for name, module in stage.named_modules():
            if isinstance(module, _DROPOUTS) and module.p > 0:
                return f"{name} (p={module.p})"
            p = getattr(module, "attention_dropout", None)  # transformers' attention passes it to its kernel
            if isinstance(p, float) and p > 0:
                return f"{name}.attention_dropout ({p})"
    return None


def padded_rows(model: PipelineCore, rows: int, length: int) -> int:
    """The fewest rows, at least ``rows``, that a training step of ``length`` tokens splits into its microbatches."""
    dp = model.dims.dp_size
    total = math.ceil(rows / dp) * dp
    while True:
        m = model.microbatches_for(total // dp, training=True, seq=length)
        try:
            check_microbatches(batch=total // dp, n_microbatches=m, training=True)
            return total
        except InputError:
            total += dp


class _Call:
    """One differentiable forward call: what its backward needs to run the pipeline's step."""

    def __init__(self, model: PipelineCore, inputs: dict[str, Any], training: bool, count: int,
                 router_aux: bool) -> None:
        self.model = weakref.ref(model)
        self.inputs, self.training, self.count, self.router_aux = inputs, training, count, router_aux

    def backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        model = self.model()
        if model is None:
            raise UsageError("the pipelined model of this forward was deleted before its backward")
        with collective_errors(model.ctx, "backpropagating a pipelined forward", describe=model.rank_label):
            self._check(model)
        # What the forward ran on: a key its transformers forward takes only through **kwargs was ignored there, as
        # transformers ignores it (TRL's reward trainer passes its batch's margin), and the step would refuse it.
        takes = forward_arguments(model.skeleton)
        inputs = {k: v for k, v in self.inputs.items() if k not in _OUTPUT_ONLY and k in takes}
        keep = self.inputs.get("logits_to_keep")
        ids = inputs.get("input_ids", inputs.get("decoder_input_ids", inputs.get("inputs_embeds")))
        length = ids.shape[1]
        if isinstance(keep, int) and keep:  # outputs of the last `keep` positions: zero gradient before them
            grads = [g if g is None else torch.cat([g.new_zeros(g.shape[0], length - g.shape[1], *g.shape[2:]), g], 1)
                     for g in grads]
        rows = self.count
        total = padded_rows(model, rows, length)
        batch = pad_batch(inputs, rows, total) if total > rows else dict(inputs)
        if total > rows:  # the padded rows are copies of the last one: pointed at a zero gradient
            grads = [g if g is None else torch.cat([g, g.new_zeros(1, *g.shape[1:])]) for g in grads]
        batch["rows"] = torch.cat([torch.arange(rows), torch.full((total - rows,), rows)]).to(ids.device)
        holder = _state(model)
        holder.grads = [g if g is None else g.detach() for g in grads]
        was = model.training
        model.training = self.training  # the step runs the stages in the mode the forward saw
        try:
            with torch.enable_grad():  # autograd runs a node's backward without grad mode; the step needs it
                model.train_step(batch, loss=holder.loss)
        finally:
            model.training, holder.grads = was, ()

    def _check(self, model: PipelineCore) -> None:
        if self.router_aux:
            raise InputError(
                "a pipelined forward with output_router_logits=True cannot be backpropagated: the routers' "
                "load-balancing loss is added by the pipeline's own step; train with model.train_step(batch) (or "
                "PipelineTrainer), or load the model without output_router_logits"
            )
        keep = self.inputs.get("logits_to_keep")
        if keep is not None and not isinstance(keep, int):
            raise InputError("backpropagating a pipelined forward takes logits_to_keep as an int, not a tensor of "
                             "positions; pass the number of last positions to keep")
        found = _dropout(model) if self.training else None
        if found is not None:
            raise InputError(
                f"dropout is active ({found}) and the forward ran in training mode: backpropagating a pipelined "
                "forward computes it again inside the pipeline's step, which would draw other dropout masks than "
                "the outputs the loss saw; set the config's dropout probabilities to 0 (e.g. attention_dropout, "
                "hidden_dropout, resid_pdrop), or call model.eval() before the forward"
            )


class _PipelineOutputs(torch.autograd.Function):
    """Identity on the gathered outputs whose backward runs the pipeline's step with the outputs' gradients."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, call: _Call, *outputs: torch.Tensor):
        ctx.call = call
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.call.backward(grads)
        return (None, None, *(None for _ in grads))


def differentiable_outputs(model: PipelineCore, inputs: dict[str, Any], outputs: tuple[torch.Tensor, ...], *,
                           rows: int, router_aux: bool) -> tuple[torch.Tensor, ...]:
    """``outputs`` (the head's, gathered on every rank) as outputs of a node whose backward trains the pipeline.

    Args:
        model: the :class:`~hf_pipeline.model.PipelinedModel` the forward ran on.
        inputs: the forward's model inputs without its targets (the step runs them again).
        outputs: the head's outputs of the ``rows`` rows, in the recipe's order.
        rows: the call's batch size.
        router_aux: whether the forward added the routers' load-balancing loss (``output_router_logits``): its
            backward is refused.
    """
    anchor = torch.zeros((), requires_grad=True)  # gives the node an input that requires grad
    with torch.enable_grad():
        return _PipelineOutputs.apply(anchor, _Call(model, inputs, model.training, rows, router_aux), *outputs)
