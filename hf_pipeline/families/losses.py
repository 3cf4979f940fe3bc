"""Training losses of the task heads, equal to what transformers computes for the same batch.

A recipe's head names its loss (``loss = "causal_lm"``). Each loss has two pure parts: ``share``
(the loss of some rows as a share of a mean over ``denominator`` items, in fp32) and ``count``
(how many items the mean is over; one count per term for a loss of several means). A pipelined
step computes ``share(microbatch, denominator=count(global batch))`` for every microbatch, so the
microbatch losses add up to the mean over the real items of the WHOLE global batch — not a mean
of microbatch means, which differs when microbatches hold different numbers of real tokens. That
is what transformers computes on one process (and what its Trainer computes with
``num_items_in_batch`` under gradient accumulation).

Where transformers 5 has the loss in ``transformers.loss.loss_utils.LOSS_MAPPING`` (what
``model.loss_function`` returns) and it takes ``num_items_in_batch`` (it then returns
``sum / num_items_in_batch``), the share is that function called with the global count; the others
say below why they cannot be, and compute the same thing from transformers' ``fixed_cross_entropy``
or, where transformers has only a mean, from torch:
  causal_lm                ForCausalLM: labels shifted inside the loss (t predicts t+1), -100 ignored
  masked_lm, seq2seq_lm    ForMaskedLM: no shift, -100 ignored (T5 builds decoder_input_ids from the labels)
  sequence_classification  regression (MSE), single-label (ForSequenceClassification: cross entropy,
                           -100 ignored) or multi-label (BCE with logits), picked like ``config.problem_type``
  token_classification     ForTokenClassification: one class per token, no shift, -100 ignored
  question_answering       (start_loss + end_loss) / 2, each a cross entropy over the positions;
                           targets ``start_positions`` / ``end_positions`` travel as one (B, 2) tensor
  multiple_choice          cross entropy over the (B, num_choices) logits, -100 ignored

Example:
    >>> loss = output_loss(model, {"logits": logits}, {"labels": labels})   # == hf_model(**batch, labels=labels).loss
    >>> fn = get_loss("causal_lm")
    >>> fn.share((logits[:2],), labels[:2], config, denominator=fn.count(labels, config))   # one microbatch's share
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import LOSS_MAPPING, fixed_cross_entropy

from ..errors import InputError

__all__ = [
    "IGNORE_INDEX", "LOSSES", "LossFunction", "PipelineLoss", "check_sequence_labels", "get_loss", "output_loss",
    "problem_type",
]

IGNORE_INDEX = -100  # transformers' label value for "no loss here" (padding, unmasked MLM tokens)

Denominator = float | tuple[float, ...]


def _vocab_loss(key: str):
    # ForCausalLMLoss / ForMaskedLMLoss(logits, labels, vocab_size, num_items_in_batch): they upcast
    # the logits to fp32 as transformers' models do and return the summed loss / num_items_in_batch.
    def share(outputs, labels, config, denominator):
        logits = outputs[0]
        return LOSS_MAPPING[key](logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=denominator)

    return share


def _causal_count(labels, config):
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _token_count(labels, config):
    return int((labels != IGNORE_INDEX).sum())


def _token_cls_share(outputs, labels, config, denominator):
    return LOSS_MAPPING["ForTokenClassification"](outputs[0], labels, config, num_items_in_batch=denominator)


def problem_type(config, labels: torch.Tensor) -> str:
    """The sequence classification problem type transformers picks for ``labels`` (config wins if set)."""
    if getattr(config, "problem_type", None):
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def check_sequence_labels(config, labels: torch.Tensor) -> str:
    """Refuse ``labels`` that transformers' sequence classification loss rejects, before any stage runs.

    transformers' ``*ForSequenceClassification.forward`` (and ``ForSequenceClassificationLoss``) picks
    the problem type like :func:`problem_type`, then: multi-label takes float (batch, num_labels)
    targets (BCEWithLogitsLoss; integer targets fail to cast, other shapes fail the size check);
    regression takes numbers of the logits' shape ((batch,) or (batch, 1) for one label: it squeezes
    both); single-label takes integer class ids, one per row (it flattens them). What it runs, the
    pipeline runs equal to it; what it raises on the last stage alone is refused here, on every rank.

    Returns:
        The problem type.
    """
    kind = problem_type(config, labels)
    if labels.dim() == 0:
        return kind  # check_labels names the missing batch dimension
    rows, n, shape = labels.shape[0], config.num_labels, tuple(labels.shape)
    because = f"config.num_labels={n}" + ("" if kind == "regression" else " and the labels' dtype")
    how = f"problem_type={kind!r}" + (
        "" if getattr(config, "problem_type", None) else f" (picked, as transformers does, from {because})"
    )
    bad = None
    if kind == "multi_label_classification" and not labels.dtype.is_floating_point:
        bad = f"float targets (BCEWithLogitsLoss), got dtype {labels.dtype}; pass labels.float()"
    elif kind == "multi_label_classification" and shape != (rows, n):
        bad = f"shape (batch, num_labels) = {(rows, n)}, got {shape}"
    elif kind == "regression" and (labels.numel() != rows if n == 1 else shape != (rows, n)):
        bad = f"one value per logit, shape {(rows,) if n == 1 else (rows, n)}, got {shape}"
    elif kind == "single_label_classification" and labels.dtype.is_floating_point:
        bad = (
            f"integer class ids (cross entropy), got dtype {labels.dtype}; pass labels.long(), or set "
            "config.problem_type='multi_label_classification' for float (batch, num_labels) targets"
        )
    elif kind == "single_label_classification" and labels.numel() != rows:
        bad = f"one class id per row, shape ({rows},), got {shape}"
    if bad:
        picked = kind == "multi_label_classification" and not getattr(config, "problem_type", None)
        hint = "" if not picked or labels.dtype.is_floating_point else (
            "; for class ids set config.num_labels > 1 and pass torch.long labels of shape (batch,)"
        )
        raise InputError(f"labels for {how} must be {bad} (transformers' loss raises the same){hint}")
    return kind


def _cls_share(outputs, labels, config, denominator):
    logits = outputs[0]
    kind = problem_type(config, labels)
    labels = labels.to(logits.device)
    if kind == "single_label_classification":
        # transformers' ForSequenceClassificationLoss, given the resolved problem type on a stand-in
        # config: it would otherwise write problem_type into the config of the last stage's rank only.
        resolved = types.SimpleNamespace(num_labels=config.num_labels, problem_type=kind)
        return LOSS_MAPPING["ForSequenceClassification"](labels, logits, resolved, num_items_in_batch=denominator)
    # Regression (MSELoss) and multi-label (BCEWithLogitsLoss) are means in ForSequenceClassificationLoss,
    # with no num_items_in_batch: a microbatch's share of the global mean needs its sum, computed here.
    if kind == "regression":
        # MSELoss on squeezed tensors when num_labels == 1, as transformers does
        pred, target = (
            (logits.squeeze(-1), labels.reshape(labels.shape[0], -1).squeeze(-1))
            if config.num_labels == 1
            else (logits, labels)
        )
        return F.mse_loss(pred.float(), target.float(), reduction="sum") / denominator
    if kind == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum") / denominator
    raise InputError(
        f"unknown problem_type {kind!r}; use 'regression', 'single_label_classification' or "
        "'multi_label_classification'"
    )


def _cls_count(labels, config):
    kind = problem_type(config, labels)
    if kind == "single_label_classification":
        return int((labels != IGNORE_INDEX).sum())
    if kind == "regression" and config.num_labels == 1:
        return labels.shape[0]
    return labels.numel()


def question_answering_targets(start_positions: torch.Tensor, end_positions: torch.Tensor, length: int) -> torch.Tensor:
    """``start_positions`` / ``end_positions`` as one (B, 2) target, positions outside the input ignored.

    As transformers' question-answering heads: (B, 1) positions are squeezed, positions are clamped
    to ``[0, length]`` and ``length`` (past the input) is the ignored index; here it is written as
    :data:`IGNORE_INDEX`, so the count of real positions needs no sequence length.
    """
    cols = []
    for name, t in (("start_positions", start_positions), ("end_positions", end_positions)):
        if t.dim() > 1:
            t = t.squeeze(-1)
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InputError(
                f"{name} must be (batch,) integer positions, got shape {tuple(t.shape)} and dtype {t.dtype}"
            )
        t = t.clamp(0, length)
        cols.append(t.masked_fill(t == length, IGNORE_INDEX))
    if cols[0].shape != cols[1].shape:
        raise InputError(
            f"start_positions has {cols[0].shape[0]} rows but end_positions {cols[1].shape[0]}; "
            "pass one of each per row"
        )
    return torch.stack(cols, dim=-1)  # (B, 2)


def _qa_share(outputs, targets, config, denominator):
    # ForQuestionAnsweringLoss passes one num_items_in_batch to both halves, but transformers' loss
    # is a mean over each half's own real positions, and the two counts differ when a start position
    # is ignored and its end position is not: each half goes through fixed_cross_entropy with its own.
    start_logits, end_logits = outputs[:2]
    targets = targets.to(start_logits.device)
    start = fixed_cross_entropy(
        start_logits, targets[:, 0], num_items_in_batch=denominator[0], ignore_index=IGNORE_INDEX
    )
    end = fixed_cross_entropy(end_logits, targets[:, 1], num_items_in_batch=denominator[1], ignore_index=IGNORE_INDEX)
    return (start + end) / 2


def _qa_count(targets, config):
    return tuple(int((targets[:, i] != IGNORE_INDEX).sum()) for i in range(2))


def _qa_targets(given: Mapping[str, torch.Tensor], length: int) -> torch.Tensor:
    return question_answering_targets(given["start_positions"], given["end_positions"], length)


def _choice_share(outputs, labels, config, denominator):
    # BertForMultipleChoice computes CrossEntropyLoss() on the (B, num_choices) logits itself (no
    # LOSS_MAPPING entry); fixed_cross_entropy is that cross entropy summed / num_items_in_batch.
    logits = outputs[0]
    return fixed_cross_entropy(logits, labels.reshape(-1).to(logits.device), num_items_in_batch=denominator)


def _labels(given: Mapping[str, torch.Tensor], length: int) -> torch.Tensor:
    return given["labels"]


@dataclass(frozen=True, kw_only=True)
class LossFunction:
    """One head's loss as ``share`` (rows -> their part of the mean) and ``count`` (targets -> items averaged over).

    Attributes:
        name: the recipe's loss name.
        share: ``(outputs, targets, config, denominator) -> Tensor``: the loss of these rows divided
            by ``denominator`` (what :attr:`count` gives for the whole batch); ``outputs`` is the
            head's outputs in the recipe's order.
        count: ``(targets, config) -> int | tuple[int, ...]``: the items the mean runs over (one per mean).
        token_level: labels are per token (same shape as the input ids).
        targets: the batch keys holding the targets, transformers' argument names.
        make_targets: ``(batch, sequence length) -> Tensor``: the one (B, ...) target tensor the
            schedule splits into microbatches, from the ``targets`` keys of the batch.
        labels_as: the loss whose label checks the batch's ``labels`` pass before :attr:`make_targets` packs
            them with other per-row targets (None: the made targets are checked as this loss's labels).
    """

    name: str
    share: Callable[[Sequence[torch.Tensor], torch.Tensor, Any, Denominator], torch.Tensor]
    count: Callable[[torch.Tensor, Any], int | tuple[int, ...]]
    token_level: bool
    targets: tuple[str, ...] = ("labels",)
    make_targets: Callable[[Mapping[str, torch.Tensor], int], torch.Tensor] = _labels
    labels_as: str | None = None

    def denominator(self, targets: torch.Tensor, config) -> Denominator:
        """:attr:`count` as the float(s) each microbatch's share is divided by."""
        n = self.count(targets, config)
        return tuple(float(c) for c in n) if isinstance(n, tuple) else float(n)

    def mean(self, outputs: torch.Tensor | Sequence[torch.Tensor], targets: torch.Tensor, config) -> torch.Tensor:
        """The loss transformers reports for this batch."""
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return self.share(outputs, targets, config, self.denominator(targets, config))


LOSSES: dict[str, LossFunction] = {
    "causal_lm": LossFunction(
        name="causal_lm", share=_vocab_loss("ForCausalLM"), count=_causal_count, token_level=True
    ),
    "masked_lm": LossFunction(name="masked_lm", share=_vocab_loss("ForMaskedLM"), count=_token_count, token_level=True),
    # LOSS_MAPPING's "ForConditionalGeneration" is the shifted causal loss; T5ForConditionalGeneration
    # computes an unshifted cross entropy itself (its decoder inputs are the labels shifted right),
    # which is ForMaskedLMLoss.
    "seq2seq_lm": LossFunction(
        name="seq2seq_lm", share=_vocab_loss("ForMaskedLM"), count=_token_count, token_level=True
    ),
    "sequence_classification": LossFunction(
        name="sequence_classification", share=_cls_share, count=_cls_count, token_level=False
    ),
    "token_classification": LossFunction(
        name="token_classification", share=_token_cls_share, count=_token_count, token_level=True
    ),
    "question_answering": LossFunction(
        name="question_answering",
        share=_qa_share,
        count=_qa_count,
        token_level=False,
        targets=("start_positions", "end_positions"),
        make_targets=_qa_targets,
    ),
    "multiple_choice": LossFunction(name="multiple_choice", share=_choice_share, count=_token_count, token_level=False),
}


def get_loss(name: str | None, *, class_name: str = "this model") -> LossFunction:
    """The :class:`LossFunction` a recipe head names.

    Raises:
        InputError: the head has no loss (a base model such as ``LlamaModel``), or ``name`` is no known loss.
    """
    if name is None:
        raise InputError(
            f"{class_name} has no pipelined training loss: it is a base model without a task head (or a head whose "
            "recipe names no loss). Train with a head that has one, e.g. AutoModelForCausalLM, AutoModelForMaskedLM, "
            "AutoModelForSeq2SeqLM, AutoModelForSequenceClassification, AutoModelForTokenClassification, "
            "AutoModelForQuestionAnswering or AutoModelForMultipleChoice"
        )
    if name not in LOSSES:
        raise InputError(f"unknown loss {name!r}; known losses: {sorted(LOSSES)}")
    return LOSSES[name]


class PipelineLoss:
    """The ``loss_fn`` given to torch's schedules: one microbatch's share of the global mean.

    torch calls it as ``loss_fn(output, target, **loss_kwargs)`` on the last stage for every
    microbatch; ``loss_kwargs`` carries ``denominator`` (items in the whole global batch, over all
    data-parallel replicas; one per mean for question answering) and ``loss_scale`` (gradient
    accumulation), known on every rank from the targets before the step. With ``scale_grads=False``
    torch backpropagates exactly this value, so the gradients are those of the global mean.
    """

    def __init__(self, loss: LossFunction, config):
        self.loss = loss
        self.config = config

    def __call__(
        self, output, target: torch.Tensor, *, denominator: Denominator, loss_scale: float = 1.0
    ) -> torch.Tensor:
        outputs = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        value = self.loss.share(outputs, target, self.config, denominator)
        return value if loss_scale == 1.0 else value * loss_scale


def output_loss(model, outputs: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], *,
                num_items: Any = None) -> torch.Tensor:
    """The loss transformers' forward returns for the head's ``outputs`` and the targets in ``given``; with
    ``num_items`` (transformers' ``num_items_in_batch``) a token-level loss is its sum over ``num_items``, as
    transformers' loss functions return it (a plain mean ignores it there too).

    For any head: ``given`` holds the loss's :attr:`LossFunction.targets`
    under transformers' names (``labels``; ``start_positions`` / ``end_positions`` for question
    answering, clamped to the length of ``start_logits`` as transformers does).

    Example:
        >>> output_loss(model, {"start_logits": s, "end_logits": e}, {"start_positions": sp, "end_positions": ep})
    """
    fn = get_loss(model.resolved.head.loss, class_name=model.resolved.class_name)
    head = tuple(outputs[name] for name in model.resolved.head.outputs)
    length = head[0].shape[1] if head[0].dim() > 1 else 0
    targets = fn.make_targets({k: v.to(head[0].device) for k, v in given.items()}, length)
    if num_items is not None and fn.token_level:
        return fn.share(head, targets, model.config, float(num_items))
    return fn.mean(head, targets, model.config)
