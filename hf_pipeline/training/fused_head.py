"""TRL's fused LM head on a pipelined model: ``model(..., labels=labels, fused_lm_head=True)``.

TRL's trainers (SFT, DPO, GRPO, RLOO, KTO) patch their model with ``trl.add_fused_lm_head``: ``model.forward`` is
replaced on the instance by one that, given ``fused_lm_head=True``, runs the model's backbone and projects its last
hidden states through the LM head tile by tile, returning each label's log-probability (and the next-token
distribution's entropy, top-1 hit...) instead of the logits. A pipelined model has no backbone to call on one
rank: :func:`take_over` removes that patch once the Trainer is built and keeps its temperature, and the pipelined
forward computes the same fields from its gathered logits (:func:`fused_output`; differentiable under grad mode, as
TRL's are). The logits already carry the head's own scale and soft-capping, which TRL's kernel applies itself; the
kernel sums in tiles, so its values differ from these by float round-off (~1e-6 relative in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InputError

__all__ = ["FusedHead", "fused_output", "take_over"]


@dataclass(frozen=True)
class FusedHead:
    """The fused head's settings a TRL trainer chose (``add_fused_lm_head``'s ``temperature``)."""

    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise InputError(f"the fused LM head's temperature must be > 0, got {self.temperature}")


def take_over(model: nn.Module, temperature: float) -> FusedHead | None:
    """Remove ``add_fused_lm_head``'s patch of ``model.forward`` (an instance attribute), if TRL made one.

    Returns:
        The head's settings, or None when the forward was not patched.
    """
    if "forward" not in vars(model):
        return None
    del model.forward  # the class's forward again: it takes fused_lm_head itself
    return FusedHead(temperature=float(temperature))


def fused_output(logits: torch.Tensor, labels: torch.Tensor, *, shift_labels: torch.Tensor | None = None,
                 num_items: Any = None, head: FusedHead | None = None):
    """TRL's ``FusedCausalLMOutput`` of ``logits`` (batch, length, vocab) for ``labels`` (-100: not scored).

    Args:
        logits: the head's logits (differentiable or not).
        labels: next-token labels as transformers takes them (shifted here), or None with ``shift_labels``.
        shift_labels: labels already shifted (TRL passes them under context parallelism).
        num_items: ``num_items_in_batch``: the loss is the summed negative log-likelihood over it (else over the
            scored tokens).
        head: the temperature (TRL's default 1.0 when None).
    """
    from trl.trainer.utils import FusedCausalLMOutput

    head = head or FusedHead()
    if shift_labels is None:
        if labels is None:
            raise InputError("fused_lm_head=True needs labels (the tokens whose log-probabilities it returns)")
        logits, labels = logits[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    labels = labels.to(logits.device)
    mask = labels != -100
    scaled = logits.float() / head.temperature
    logp = scaled.log_softmax(-1)
    log_probs = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0)
    entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0)
    with torch.no_grad():  # TRL's kernel marks these non-differentiable
        log_sum_sq_probs = torch.logsumexp(2 * logp, -1).masked_fill(~mask, 0)
        mean_logits = scaled.mean(-1).masked_fill(~mask, 0)
        is_top1 = (scaled.argmax(-1) == labels) & mask  # argmax: the first maximum, as the kernel's test
    denominator = mask.sum().clamp(min=1) if num_items is None else num_items
    return FusedCausalLMOutput(
        loss=-log_probs.sum() / denominator, log_probs=log_probs, entropy=entropy,
        log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits, is_top1=is_top1, label_mask=mask,
    )
