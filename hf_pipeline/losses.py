"""Training losses of the task heads, equal to what transformers computes for the same batch.

A recipe's head names its loss (``loss = "causal_lm"``). Each loss is split into two pure parts:
``sum`` (the summed per-item loss of some rows, in fp32) and ``count`` (how many items the mean
is over). A pipelined step computes ``sum(microbatch) / count(global batch)`` for every
microbatch, so the microbatch losses add up to the mean over the real tokens of the WHOLE global
batch — not a mean of microbatch means, which differs when microbatches hold different numbers
of real tokens. That is what transformers computes on one process (and what its Trainer computes
with ``num_items_in_batch`` under gradient accumulation).

Semantics copied from transformers 5 (``transformers.loss.loss_utils`` and the model classes):
  causal_lm                labels shifted inside the loss (position t predicts t+1), -100 ignored
  masked_lm, seq2seq_lm    no shift, -100 ignored (T5 builds decoder_input_ids from the labels)
  sequence_classification  regression (MSE), single-label (cross entropy, -100 ignored) or
                           multi-label (BCE with logits), picked like ``config.problem_type``
  token_classification     one class per token, no shift, -100 ignored (``ForTokenClassification``)

Example:
    >>> loss = model_loss(model, logits, labels)          # == hf_model(**batch, labels=labels).loss
    >>> fn = get_loss("causal_lm")
    >>> fn.sum(logits[:2], labels[:2], config) / fn.count(labels, config)   # one microbatch's share
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "LOSSES", "LossFunction", "PipelineLoss", "get_loss", "model_loss", "problem_type"]

IGNORE_INDEX = -100  # transformers' label value for "no loss here" (padding, unmasked MLM tokens)


def _token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Upcast as transformers' ForCausalLMLoss / ForMaskedLMLoss do; sum, the mean is taken globally.
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


def _shift(labels: torch.Tensor) -> torch.Tensor:
    # As ForCausalLMLoss: pad one ignored label on the right, drop the first: position t predicts t+1.
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _causal_sum(logits, labels, config):
    return _token_sum(logits, _shift(labels))


def _causal_count(labels, config):
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _token_count(labels, config):
    return int((labels != IGNORE_INDEX).sum())


def _token_loss_sum(logits, labels, config):
    return _token_sum(logits, labels)


def problem_type(config, labels: torch.Tensor) -> str:
    """The sequence classification problem type transformers picks for ``labels`` (config wins if set)."""
    if getattr(config, "problem_type", None):
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def _cls_sum(logits, labels, config):
    kind = problem_type(config, labels)
    labels = labels.to(logits.device)
    if kind == "regression":
        # MSELoss on squeezed tensors when num_labels == 1, as transformers does
        pred, target = (logits.squeeze(-1), labels.reshape(labels.shape[0], -1).squeeze(-1)) if config.num_labels == 1 else (logits, labels)
        return F.mse_loss(pred.float(), target.float(), reduction="sum")
    if kind == "single_label_classification":
        return F.cross_entropy(logits.float().reshape(-1, config.num_labels), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    if kind == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum")
    raise ValueError(f"unknown problem_type {kind!r}; use 'regression', 'single_label_classification' or 'multi_label_classification'")


def _cls_count(labels, config):
    kind = problem_type(config, labels)
    if kind == "single_label_classification":
        return int((labels != IGNORE_INDEX).sum())
    if kind == "regression" and config.num_labels == 1:
        return labels.shape[0]
    return labels.numel()


@dataclass(frozen=True, kw_only=True)
class LossFunction:
    """One head's loss as ``sum`` (rows -> summed fp32 loss) and ``count`` (labels -> items averaged over).

    Attributes:
        name: the recipe's loss name.
        sum: ``(logits, labels, config) -> Tensor``: summed loss of these rows.
        count: ``(labels, config) -> int``: the number of items the mean runs over.
        token_level: labels are per token (same shape as the input ids).
    """

    name: str
    sum: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
    count: Callable[[torch.Tensor, Any], int]
    token_level: bool

    def mean(self, logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
        """The loss transformers reports for this batch."""
        return self.sum(logits, labels, config) / self.count(labels, config)


LOSSES: dict[str, LossFunction] = {
    "causal_lm": LossFunction(name="causal_lm", sum=_causal_sum, count=_causal_count, token_level=True),
    "masked_lm": LossFunction(name="masked_lm", sum=_token_loss_sum, count=_token_count, token_level=True),
    "seq2seq_lm": LossFunction(name="seq2seq_lm", sum=_token_loss_sum, count=_token_count, token_level=True),
    "sequence_classification": LossFunction(name="sequence_classification", sum=_cls_sum, count=_cls_count, token_level=False),
    "token_classification": LossFunction(name="token_classification", sum=_token_loss_sum, count=_token_count, token_level=True),
}


def get_loss(name: str | None, *, class_name: str = "this model") -> LossFunction:
    """The :class:`LossFunction` a recipe head names.

    Raises:
        ValueError: the head has no loss (a base model such as ``LlamaModel``).
    """
    if name is None:
        raise ValueError(
            f"{class_name} has no pipelined training loss: it is a base model without a task head, or a head whose "
            "recipe names no loss (question answering: its start/end-position loss is not implemented; forward "
            "works). Train with a head that has one, e.g. AutoModelForCausalLM, AutoModelForMaskedLM, "
            "AutoModelForSeq2SeqLM, AutoModelForSequenceClassification or AutoModelForTokenClassification"
        )
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; known losses: {sorted(LOSSES)}")
    return LOSSES[name]


class PipelineLoss:
    """The ``loss_fn`` given to torch's schedules: one microbatch's share of the global mean.

    torch calls it as ``loss_fn(output, target, **loss_kwargs)`` on the last stage for every
    microbatch; ``loss_kwargs`` carries ``denominator`` (items in the whole global batch, over all
    data-parallel replicas) and ``loss_scale`` (gradient accumulation), known on every rank
    from the labels before the step. With ``scale_grads=False`` torch backpropagates exactly
    this value, so the gradients are those of the global mean.
    """

    def __init__(self, loss: LossFunction, config):
        self.loss = loss
        self.config = config

    def __call__(self, output, target: torch.Tensor, *, denominator: float, loss_scale: float = 1.0) -> torch.Tensor:
        logits = output[0] if isinstance(output, (tuple, list)) else output
        value = self.loss.sum(logits, target, self.config) / denominator
        return value if loss_scale == 1.0 else value * loss_scale


def model_loss(model, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss transformers' own model computes from these logits and labels (used by ``forward(labels=...)``).

    Args:
        model: a :class:`~hf_pipeline.model.PipelinedModel` (its head names the loss).
        logits: the full batch's logits.
        labels: the labels as passed to transformers.
    Returns:
        A scalar tensor.
    """
    fn = get_loss(model.resolved.head.loss, class_name=model.resolved.class_name)
    return fn.mean(logits, labels.to(logits.device), model.config)
