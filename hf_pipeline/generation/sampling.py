"""Small pure helpers of pipelined generation: positions, seeded per-row sampling.

Everything here is a function of its arguments only, so it is tested alone (``tests/generation/test_sampling.py``)
and the decode ring in ``ring.py`` stays about communication and caches.

Sampling as transformers samples (no ``seed`` given). transformers draws every step's tokens with one
``torch.multinomial(probs, 1)`` over the whole batch on the device's global random stream. For one sample per
row torch computes that as ``argmax(probs / q)`` with ``q`` one ``(B, vocab)`` block of Exp(1) draws (the
exponential race: ``aten/src/ATen/native/Distributions.cpp``; checked against ``torch.multinomial`` in
``tests/generation/test_sampling.py``, so a torch that changes it fails there). The pipeline samples one
microbatch at a time, but its last stage chooses every microbatch's step ``t`` before any step ``t + 1``: it
draws step ``t``'s whole block once, at the step's first choice (:func:`step_noise`), and gives each microbatch
its rows of it (:func:`select_from_noise`), so each row gets the numbers transformers gives it and the stream
advances by what transformers draws.

Seeded sampling (``generate(..., seed=s)``, the pipeline's own argument). Each row gets its own
``torch.Generator`` seeded from ``(seed, row index in the whole batch)`` (:func:`row_seed`): a row draws the same
numbers whatever the microbatching, the number of stages or data-parallel replicas, and whatever the global
stream, so a seed gives the same tokens at every world size. (It is a different stream from transformers' own.)

Example:
    >>> gens = row_generators(1234, range(0, 4))
    >>> select_tokens(scores, do_sample=True, generators=gens)   # (4,) token ids
    >>> noise = step_noise(16, scores.shape[-1], scores.device)     # the whole batch's step, global stream
    >>> select_from_noise(scores, noise[4:8])                       # rows 4..7 as transformers samples them
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..errors import InputError

__all__ = [
    "left_padded_position_ids",
    "row_generators",
    "row_seed",
    "select_from_noise",
    "select_tokens",
    "step_noise",
]

# Odd 64-bit constants of splitmix64: consecutive rows get unrelated seeds, not seed, seed+1, ...
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def left_padded_position_ids(attention_mask: torch.Tensor | None, length: int, *, batch: int = 1) -> torch.Tensor:
    """Position ids of a (left-)padded prompt exactly as transformers' generate makes them.

    ``cumsum(mask) - 1`` with padding positions set to 0; without a mask ``arange(length)``.

    Args:
        attention_mask: ``(B, T)`` 0/1 mask, or None.
        length: ``T``.
        batch: rows to expand to when there is no mask.
    Returns:
        ``(B, T)`` long tensor.
    """
    if attention_mask is None:
        return torch.arange(length, dtype=torch.long).unsqueeze(0).expand(batch, length)
    pos = attention_mask.long().cumsum(-1) - 1  # (B, T)
    return pos.masked_fill(attention_mask == 0, 0)


def row_seed(seed: int, row: int) -> int:
    """A 63-bit seed for row ``row`` of a request seeded with ``seed`` (splitmix64 of both)."""
    z = (int(seed) * _GOLDEN + (int(row) + 1) * _MIX1) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def row_generators(seed: int, rows: Iterable[int], device: str | torch.device = "cpu") -> list[torch.Generator]:
    """One seeded ``torch.Generator`` per row (global row indices of the whole batch)."""
    return [torch.Generator(device=device).manual_seed(row_seed(seed, r)) for r in rows]


def select_tokens(
    scores: torch.Tensor, *, do_sample: bool, generators: Sequence[torch.Generator] | None = None
) -> torch.Tensor:
    """Next token per row from processed scores: argmax, or a multinomial draw from each row's generator.

    Args:
        scores: ``(N, V)`` processed logits (after temperature / top-k / top-p ...), float.
        do_sample: sample (True) or greedy (False).
        generators: with sampling, one generator per row of ``scores``.
    Returns:
        ``(N,)`` long token ids.
    """
    if not do_sample:
        # transformers' greedy pick is ``argmax``; ``max(dim).indices`` is the same index (the first
        # maximum on ties, a NaN's position where a row has one) at a third of the time on CPU
        # (8 x 8192: 95 -> 32 us), and it runs on the decode ring's critical path.
        return scores.max(dim=-1).indices
    if generators is None or len(generators) != scores.shape[0]:
        got = 0 if generators is None else len(generators)
        raise InputError(f"sampling needs one generator per row: {scores.shape[0]} rows, got {got}")
    probs = torch.softmax(scores.float(), dim=-1)  # (N, V)
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    for j, gen in enumerate(generators):
        out[j] = torch.multinomial(probs[j], 1, generator=gen)[0]
    return out


def step_noise(rows: int, vocab: int, device: str | torch.device) -> torch.Tensor:
    """One sampling step's ``(rows, vocab)`` float32 block of Exp(1) draws from the device's global random stream:
    what ``torch.multinomial`` of a ``(rows, vocab)`` float32 ``probs`` draws for one sample per row."""
    return torch.empty(rows, vocab, dtype=torch.float32, device=device).exponential_(1)


def select_from_noise(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The token ``torch.multinomial(softmax(scores), 1)`` picks for each row given its draws ``noise``.

    Args:
        scores: ``(N, V)`` processed logits (after temperature / top-k / top-p ...).
        noise: ``(N, V)`` the rows' part of :func:`step_noise`.
    Returns:
        ``(N,)`` long token ids.
    """
    probs = torch.softmax(scores.float(), dim=-1)  # as transformers' generate: softmax of float32 scores
    return (probs / noise).argmax(dim=-1)
