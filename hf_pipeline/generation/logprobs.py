"""Token log-probabilities as OpenAI's ``logprobs`` reports them: pure functions, tested alone.

A chosen token's log-probability is ``log_softmax`` of the processed scores that chose it (after the
row's logits processors: penalties, temperature, top-p), as transformers' ``compute_transition_scores
(normalize_logits=True)`` and vLLM's processed logprobs give it; a prompt token's is ``log_softmax`` of
the raw logits of the position before it, as a forward pass gives it. Each position travels as one
float64 row ``[logprob, top ids..., top logprobs...]`` (:func:`entries`; ids below 2**53 are exact in
float64) and is read back as a :class:`TokenLogprob` (:func:`read_entries`).

Example:
    >>> rows = entries(torch.log_softmax(scores, -1), tokens, k=2)     # (N, 1 + 2 * 2) float64
    >>> read_entries(rows, tokens.tolist(), k=2)[0]
    TokenLogprob(token=5, logprob=-0.31, top=((5, -0.31), (9, -1.6)))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenLogprob", "entries", "entry_width", "read_entries"]


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and its ``top`` alternatives, ``(token id, log-probability)`` best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def entry_width(k: int) -> int:
    """Floats per position with ``k`` alternatives: the token's log-probability, ``k`` ids, ``k`` log-probabilities."""
    return 1 + 2 * k


def entries(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Each position's entry.

    Args:
        logprobs: ``(N, V)`` log-probabilities (``log_softmax`` over the vocabulary).
        tokens: ``(N,)`` the token of each position.
        k: top alternatives per position (0..V).
    Returns:
        ``(N, entry_width(k))`` float64: ``[logprob of the token, top ids..., top logprobs...]``.
    """
    chosen = logprobs.gather(1, tokens.view(-1, 1).to(logprobs.device))  # (N, 1)
    top = torch.topk(logprobs, k, dim=-1)  # values, indices: (N, k) each
    return torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1)


def read_entries(rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` s that ``rows`` (``(N, entry_width(k))``, from :func:`entries`) hold."""
    out = []
    for token, row in zip(tokens, rows.tolist()):
        ids, values = row[1: 1 + k], row[1 + k:]
        out.append(TokenLogprob(token=int(token), logprob=row[0], top=tuple((int(i), v) for i, v in zip(ids, values))))
    return out
