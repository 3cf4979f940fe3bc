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

Rows with caches of their own (chunked prompts, reused prefixes) run one batched forward on a cache
:func:`stack` builds, right aligned, their new tokens after it, right aligned too (so a row whose part
is narrower than the widest has masked columns between its past and its new tokens; positions are
explicit, so only the mask sees columns); :func:`compact` then moves each row's columns together at the
right and :func:`take_rows` copies rows out. These three hold full-attention layers only: a
sliding layer counts its window in columns, which the gap would stretch (the ring runs such rows one
by one, each on its own cache).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from ..errors import InternalError

__all__ = [
    "MERGED", "compact", "cut_columns", "cut_unused", "filled", "merge", "merge_refusal", "stack", "stored_columns",
    "take_rows",
]

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


def filled(cache: DynamicCache) -> dict[int, Any]:
    """The layers that hold keys, by index (a stage fills only its own; indices are the model's global ones)."""
    return {k: layer for k, layer in enumerate(cache.layers)
            if layer.is_initialized and layer.keys is not None and layer.keys.numel()}


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
    for k, b in filled(fresh).items():
        a = cache.layers[k]
        n = stored_columns(a, total)
        a.keys = torch.cat([_fit(a.keys, n), _fit(b.keys, n)])
        a.values = torch.cat([_fit(a.values, n), _fit(b.values, n)])
        _set_columns(a, total)
    return torch.cat([_fit(mask, total, 1), _fit(fresh_mask, total, 1)])


def cut_columns(cache: DynamicCache, cut: int, columns: int) -> None:
    """Drop the first ``cut`` columns (no row uses them any more), leaving ``columns``, from every filled layer."""
    if not cut:
        return
    for layer in filled(cache).values():
        n = stored_columns(layer, columns)
        layer.keys, layer.values = _fit(layer.keys, n), _fit(layer.values, n)
        _set_columns(layer, columns)


def _leading_unused(mask: torch.Tensor) -> int:
    """Leading columns of ``mask`` ``(rows, columns)`` no row uses."""
    used = mask.any(dim=0).nonzero()
    return int(used[0, 0]) if used.numel() else mask.shape[1]


def cut_unused(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Cut the leading columns of ``cache`` that no row of ``mask`` uses (after rows left); the mask so cut."""
    cut = _leading_unused(mask)
    if cut:
        mask = mask[:, cut:]
        cut_columns(cache, cut, mask.shape[1])
    return mask


def _full_only(layers: Iterable[Any], what: str) -> None:
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        raise InternalError(f"{what} holds full-attention cache layers only (a sliding window counts columns)")


def stack(cache: DynamicCache, rows: list[dict[int, tuple[torch.Tensor, torch.Tensor]] | None],
          columns: int, *, whole: bool = False) -> DynamicCache:
    """Fill the fresh ``cache`` with each row's keys and values (``{layer: (keys, values)}``, each
    ``(heads, length, D)``; None: the row has none), right aligned in ``columns``, zeros before; returns it.

    ``whole``: each row's keys and values are its last tokens with no column missing between them and its end
    (a sliding layer's, at least its window's last ``window - 1``), so a sliding layer may take them: it keeps
    its window's last columns of them and counts ``columns``. Otherwise full-attention layers only."""
    for k in sorted({k for kv in rows if kv for k in kv}):
        ref = next(kv[k] for kv in rows if kv)
        keys = torch.stack([_fit(kv[k][0] if kv else ref[0][:, :0], columns, 1) for kv in rows])
        values = torch.stack([_fit(kv[k][1] if kv else ref[1][:, :0], columns, 1) for kv in rows])
        cache.update(keys, values, k)
    if not whole:
        _full_only(filled(cache).values(), "a stacked cache")
    return cache


def compact(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Move each row's columns (its mask's ones, in order) to the right end, in place, zeros before them, and
    drop the leading columns no row uses; the mask so laid out ``(rows, most columns a row uses)``."""
    width = int(mask.sum(dim=1).max())
    # A stable sort puts each row's masked columns first and its own after them, each in their order.
    order = torch.sort(mask, dim=1, stable=True).indices[:, mask.shape[1] - width:]
    kept = torch.gather(mask, 1, order)
    layers = filled(cache).values()
    _full_only(layers, "compact")
    for layer in layers:
        index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        keep = kept[:, None, :, None].to(layer.keys.dtype)
        layer.keys = torch.gather(layer.keys, 2, index) * keep
        layer.values = torch.gather(layer.values, 2, index) * keep
    return kept


def take_rows(cache: DynamicCache, mask: torch.Tensor, rows: list[int], fresh: DynamicCache
              ) -> tuple[DynamicCache, torch.Tensor]:
    """Rows ``rows`` of ``cache`` (right aligned, ``mask``) copied into the fresh cache ``fresh``, the leading
    columns none of them uses cut: ``(fresh, their mask)``."""
    index = torch.tensor(rows, dtype=torch.long, device=mask.device)
    mask = mask[index]
    cut = _leading_unused(mask)
    layers = filled(cache)
    _full_only(layers.values(), "take_rows")
    for k, layer in layers.items():
        fresh.update(layer.keys[index, :, cut:], layer.values[index, :, cut:], k)
    return fresh, mask[:, cut:]
