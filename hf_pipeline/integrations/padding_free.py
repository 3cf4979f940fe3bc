"""A padding-free batch (TRL's ``padding_free`` / ``packing``, transformers' ``DataCollatorWithFlattening``) as rows.

Such a collator puts the batch's sequences end to end in ONE row, ``position_ids`` restarting at 0 where each begins,
with flash attention's varlen arguments (``cu_seq_lens_q`` / ``_k``, ``max_length_q`` / ``_k``) and the label that
starts each sequence masked (-100), so no position predicts across a boundary; each sequence attends to itself only.
A pipeline splits a step's rows into microbatches, which one row cannot be, and its stages take no varlen arguments.
:func:`unflatten` gives the same sequences back as right-padded rows (an attention mask, the same position ids and
labels, -100 past each sequence's end), plus rows of padding with no labels up to a count the step splits: the
scored (position, target) pairs, the number of items and every token's attention are those of the flat row, so the
loss and gradients are the same up to float round-off (other matmul shapes), as transformers' own equivalence of
padded and padding-free training holds.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import InputError

__all__ = ["is_padding_free", "unflatten"]

# Varlen attention arguments the collators add (flash attention's, and mamba's seq_idx): padded rows need none.
_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def is_padding_free(batch: dict[str, Any]) -> bool:
    """Whether ``batch`` is one row of several sequences end to end (varlen arguments, or positions restarting)."""
    ids, positions = batch.get("input_ids"), batch.get("position_ids")
    if any(k in batch for k in _VARLEN):
        return True
    return (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1
            and isinstance(positions, torch.Tensor) and int((positions[0] == 0).sum()) > 1)


def unflatten(batch: dict[str, Any], *, pad_token_id: int, rows_for: Callable[[int, int], int]) -> dict[str, Any]:
    """``batch`` (padding-free: one row) as right-padded rows, one per sequence, and filler rows.

    Args:
        batch: the collator's batch: ``input_ids``, ``position_ids`` and ``labels`` of shape ``(1, N)``, varlen
            arguments (dropped), other ``(1, N)`` tensors split like the ids.
        pad_token_id: the id past each sequence's end (masked: any id).
        rows_for: ``(sequences, longest) -> rows`` the step takes (at least ``sequences``).
    Raises:
        InputError: the batch is not one row with position ids (naming what it has).
    """
    ids, positions = batch.get("input_ids"), batch.get("position_ids")
    one_row = isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1
    if not (one_row and isinstance(positions, torch.Tensor) and positions.shape == ids.shape):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
        raise InputError(
            f"a padding-free batch (varlen arguments {[k for k in _VARLEN if k in batch]}) must hold its sequences "
            f"in one row of input_ids with position_ids of the same shape; got input_ids of shape {shape} and "
            f"{'no' if positions is None else 'other'} position_ids"
        )
    n = ids.shape[1]
    starts = torch.nonzero(positions[0] == 0).flatten().tolist()
    starts = starts if starts and starts[0] == 0 else [0, *starts]
    bounds = list(zip(starts, starts[1:] + [n]))
    longest = max(b - a for a, b in bounds)
    total = rows_for(len(bounds), longest)
    fills = {"input_ids": pad_token_id, "labels": -100, "position_ids": 0}
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _VARLEN:
            continue
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == ids.shape):
            out[key] = value  # not per token: as given
            continue
        rows = value.new_full((total, longest, *value.shape[2:]), fills.get(key, 0))
        for r, (a, b) in enumerate(bounds):
            rows[r, : b - a] = value[0, a:b]
        out[key] = rows
    mask = torch.zeros(total, longest, dtype=torch.long, device=ids.device)
    for r, (a, b) in enumerate(bounds):
        mask[r, : b - a] = 1
    mask[len(bounds):, 0] = 1  # a filler row attends to its first (pad) token: finite, and it scores no label
    out["attention_mask"] = mask
    return out
