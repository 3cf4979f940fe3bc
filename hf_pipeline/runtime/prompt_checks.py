"""Checks of ``generate``'s prompts before anything else: prompt lists (text or token ids) and empty batches.

Callers import them from here; the other call checks (shapes, ids, labels, microbatches) live in
:mod:`.checks`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import InputError, InputTypeError

__all__ = ["check_generate_inputs", "check_prompts"]


def check_prompts(prompts: Any) -> str:
    """Raise InputError unless ``prompts`` is a non-empty list of strings or of token-id lists.

    Returns:
        ``"text"`` or ``"ids"``.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InputError(f"prompts must be a list of strings (or of token-id lists), got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise InputError("the prompt list is empty; pass at least one prompt")
    kinds = []
    for p in prompts:
        if isinstance(p, str):
            kinds.append("text")
        elif isinstance(p, (list, tuple)):
            kinds.append(
                "ids"
                if all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                else "list holding non-int items"
            )
        else:
            kinds.append(type(p).__name__)
    odd = next((i for i, k in enumerate(kinds) if k not in ("text", "ids")), None)
    if odd is not None:
        raise InputError(f"prompts must be strings or lists of int token ids, got a {kinds[odd]} at index {odd}")
    if len(set(kinds)) > 1:
        seen = sorted(set(kinds))
        first = {k: kinds.index(k) for k in seen}
        raise InputError(
            "prompts must all be strings or all be token-id lists, got a mix: "
            + ", ".join(f"{k} (first at index {first[k]})" for k in seen)
        )
    if kinds[0] == "ids" and any(len(p) == 0 for p in prompts):
        raise InputError(f"prompt {next(i for i, p in enumerate(prompts) if len(p) == 0)} is an empty token list")
    return kinds[0]


def check_generate_inputs(input_ids: Any) -> None:
    """Raise a clear error for prompts ``generate`` cannot take: lists (untokenized or mixed) and empty batches.

    A list is checked with :func:`check_prompts` first, so an empty or mixed list gets that message.
    """
    if isinstance(input_ids, (list, tuple)):
        kind = check_prompts(input_ids)
        hint = (
            "tok(prompts, return_tensors='pt', padding=True)"
            if kind == "text"
            else "torch.tensor(ids) (pad rows to one length)"
        )
        raise InputTypeError(
            f"generate takes input_ids as a (batch, length) tensor of token ids, got a list of {kind} prompts; pass "
            f"{hint}"
        )
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and 0 in input_ids.shape:
        raise InputError(
            f"input_ids of shape {tuple(input_ids.shape)} holds no "
            + (
                "prompts; pass at least one"
                if input_ids.shape[0] == 0
                else "tokens; every prompt needs at least one (e.g. the BOS token)"
            )
        )
