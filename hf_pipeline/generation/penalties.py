"""OpenAI's sampling penalties as logits processors: transformers' own where it has one, one class where not.

* ``logit_bias`` ({token id: bias}) is transformers' ``SequenceBiasLogitsProcessor`` over one-token sequences;
* ``repetition_penalty`` (vLLM's extension) is transformers' ``RepetitionPenaltyLogitsProcessor``, over the
  prompt and the generated tokens, as vLLM applies it;
* ``presence_penalty`` / ``frequency_penalty`` have no transformers processor (its repetition penalty is
  multiplicative and counts the prompt), so :class:`PresenceFrequencyPenalty` writes OpenAI's formula as vLLM
  applies it: ``logit[j] -= frequency * count[j] + presence * (count[j] > 0)``, ``count`` over the generated
  tokens only.

:func:`penalty_processors` builds them in vLLM's order (the bias, then repetition, then frequency and
presence); given to transformers as custom processors they run after its own and before the sampling
warpers (temperature, top-k, top-p), where vLLM applies penalties.

Example:
    >>> procs = penalty_processors(prompt_length=5, presence=0.5, frequency=0.2, repetition=1.1, bias={7: -100.0})
    >>> scores = procs(input_ids, scores)
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

__all__ = ["PresenceFrequencyPenalty", "penalty_processors"]


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties (see the module docstring).

    Args:
        prompt_length: tokens of ``input_ids`` that are the prompt (not counted).
        presence: subtracted once from every token generated at least once.
        frequency: subtracted per time a token was generated.
    """

    def __init__(self, prompt_length: int, presence: float = 0.0, frequency: float = 0.0):
        self.prompt_length, self.presence, self.frequency = prompt_length, float(presence), float(frequency)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_length:]  # (B, generated)
        counts = torch.zeros_like(scores).scatter_add_(1, out.to(scores.device),
                                                      torch.ones(out.shape, dtype=scores.dtype, device=scores.device))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)  # (B, V)


def penalty_processors(*, prompt_length: int, presence: float = 0.0, frequency: float = 0.0,
                       repetition: float = 1.0, bias: dict[int, float] | None = None) -> LogitsProcessorList:
    """The processors a request's penalties need, in vLLM's order; empty when it asks for none."""
    out = LogitsProcessorList()
    if bias:
        out.append(SequenceBiasLogitsProcessor(sequence_bias=[[[int(t)], float(b)] for t, b in bias.items()]))
    if repetition != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty=repetition))
    if presence or frequency:
        out.append(PresenceFrequencyPenalty(prompt_length, presence, frequency))
    return out
