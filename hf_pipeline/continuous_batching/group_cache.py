"""A continuous-ring group's KV cache: rows merged side by side, right aligned, and rows dropped.

A group's rows share one transformers ``DynamicCache`` and one 2D attention mask ``(rows, columns)``:
every row's tokens are its last columns, the columns before them are left padding that the mask
hides. Full-attention layers (``DynamicLayer``) keep every column. Sliding-window layers
(``DynamicSlidingWindowLayer``) keep only the last ``min(columns, sliding_window - 1)`` of them and
count ``cumulative_length`` (which the mask functions read through ``get_mask_sizes``: the key
columns the window shows start at ``kv_offset = columns - (sliding_window - 1)``). A window counted
in columns is the row's own window in positions: padding is only on the left, so a row's tokens are
consecutive columns. So each operation here keeps, for every layer, the last columns its kind
stores (:func:`stored_columns`) and, for a sliding layer, ``cumulative_length`` equal to the mask's
columns; the zero columns it adds are padding the mask hides.

Note (which layers merge): :data:`MERGED` maps each attention kind this module merges to the cache
layer class transformers builds for it; :func:`merge_refusal` names any other (chunked attention
also stores a ``DynamicSlidingWindowLayer``, but its chunk boundaries are counted in columns and
would move as the group's left padding changes).

Example:
    >>> mask = merge(group_cache, group_mask, fresh_cache, fresh_mask)   # rows of both, right aligned
    >>> cut_columns(group_cache, cut=3, columns=mask.shape[1] - 3)        # after rows left
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

__all__ = ["MERGED", "cut_columns", "merge", "merge_refusal", "stored_columns"]

# attention kind (``config.layer_types``, as the cache reads it) -> the cache layer class merged for it
MERGED: dict[str, type] = {"full_attention": DynamicLayer, "sliding_attention": DynamicSlidingWindowLayer}


def merge_refusal(config: Any) -> str | None:
    """Why the cache layers transformers builds for ``config`` cannot be merged by the ring, or None."""
    text = config.get_text_config(decoder=True)
    kinds = get_layer_types_and_kwargs(text)[0]
    cache = DynamicCache(config=text)
    odd = sorted({f"{kind!r} ({type(layer).__name__})" for kind, layer in zip(kinds, cache.layers)
                  if MERGED.get(kind) is not type(layer)})
    if not odd:
        return None
    return (f"cache layers of kind {', '.join(odd)} are not merged by the continuous ring (it merges "
            f"{', '.join(sorted(MERGED))})")


def stored_columns(layer: Any, columns: int) -> int:
    """How many of a group's last ``columns`` the cache layer keeps (a sliding layer: its window less one)."""
    if getattr(layer, "is_sliding", False):
        return min(columns, int(layer.sliding_window) - 1)
    return columns


def _fit(t: torch.Tensor, n: int, dim: int = 2) -> torch.Tensor:
    """The last ``n`` columns (along ``dim``) of ``t``, left padded with zeros when it has fewer: keys and
    values ``(B, heads, columns, D)``, masks ``(B, columns)`` with ``dim=1``."""
    have = t.shape[dim]
    if have >= n:
        return t.narrow(dim, have - n, n)
    shape = list(t.shape)
    shape[dim] = n - have
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _filled(cache: DynamicCache) -> list[Any]:
    """The layers that hold keys (a stage fills only its own; indices are the model's global ones)."""
    return [layer for layer in cache.layers if layer.is_initialized and layer.keys is not None
            and layer.keys.numel()]


def _set_columns(layer: Any, columns: int) -> None:
    if getattr(layer, "is_sliding", False):
        layer.cumulative_length = columns  # what get_mask_sizes counts the window's offset from


def merge(cache: DynamicCache, mask: torch.Tensor, fresh: DynamicCache, fresh_mask: torch.Tensor) -> torch.Tensor:
    """Put ``fresh``'s rows under ``cache``'s (in place), both right aligned to the longer; the merged mask.

    Args:
        cache, mask: the group's cache and mask ``(rows, columns)``.
        fresh, fresh_mask: the joining rows' cache (their prompts just ran on it) and mask ``(new, width)``.
    Returns:
        the mask ``(rows + new, max(columns, width))``: zeros where a side was left padded.
    """
    total = max(mask.shape[1], fresh_mask.shape[1])
    for a, b in zip(cache.layers, fresh.layers):
        if b.is_initialized and b.keys is not None and b.keys.numel():
            n = stored_columns(a, total)
            a.keys = torch.cat([_fit(a.keys, n), _fit(b.keys, n)])
            a.values = torch.cat([_fit(a.values, n), _fit(b.values, n)])
            _set_columns(a, total)
    return torch.cat([_fit(mask, total, 1), _fit(fresh_mask, total, 1)])


def cut_columns(cache: DynamicCache, cut: int, columns: int) -> None:
    """Drop the first ``cut`` columns (no row uses them any more), leaving ``columns``, from every filled layer."""
    if not cut:
        return
    for layer in _filled(cache):
        n = stored_columns(layer, columns)
        layer.keys, layer.values = _fit(layer.keys, n), _fit(layer.values, n)
        _set_columns(layer, columns)
