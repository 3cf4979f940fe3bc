"""The group cache's helpers for rows with caches of their own run in one forward (pure, one process):
:func:`~hf_pipeline.continuous_batching.group_cache.stack` puts each row's keys and values right aligned (zeros
before, none for a row without a past), :func:`~.compact` moves each row's columns (its mask's ones, in order)
together at the right with zeros before and drops columns no row uses, :func:`~.take_rows` copies rows out with
the leading columns none of them uses cut; all three refuse sliding-window layers (a window counts columns).
Exact comparisons: these only move and copy values (a column moved to the wrong place or from the wrong row
changes them)."""

from __future__ import annotations

import pytest
import tiny
import torch
from transformers import DynamicCache

from hf_pipeline.continuous_batching.group_cache import compact, stack, take_rows
from hf_pipeline.errors import InternalError

pytestmark = pytest.mark.unit

HEADS, D = 2, 3


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS, n, D, generator=g), torch.randn(HEADS, n, D, generator=g)


def _cache() -> DynamicCache:
    return DynamicCache(config=tiny.config_for("llama"))


def test_stack_right_aligns_each_rows_past_with_zeros_before():
    pasts = [{1: _kv(3, 0)}, None, {1: _kv(5, 1)}]
    cache = stack(_cache(), pasts, 5)
    layer = cache.layers[1]
    assert layer.keys.shape == (3, HEADS, 5, D) and not cache.layers[0].is_initialized
    assert torch.equal(layer.keys[0, :, 2:], pasts[0][1][0]) and not layer.keys[0, :, :2].any()
    assert not layer.keys[1].any() and torch.equal(layer.values[2], pasts[2][1][1])


def test_compact_moves_each_rows_columns_together_at_the_right():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1],    # a past of 2, a gap of 2, a part of 1
                         [1, 1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 1, 1]])   # no past
    cache = _cache()
    keys, values = torch.randn(3, HEADS, 6, D), torch.randn(3, HEADS, 6, D)
    cache.update(keys, values, 2)
    kept = compact(cache, mask)
    assert torch.equal(kept, torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 1, 1]]))
    layer = cache.layers[2]
    assert torch.equal(layer.keys[0, :, 3:], keys[0, :, [1, 2, 5]]) and not layer.keys[0, :, :3].any()
    assert torch.equal(layer.values[1], values[1]) and torch.equal(layer.keys[2, :, 4:], keys[2, :, 4:])
    assert not layer.values[2, :, :4].any()


def test_compact_drops_columns_no_row_uses():
    cache = _cache()
    keys = torch.randn(2, HEADS, 4, D)
    cache.update(keys, keys.clone(), 0)
    kept = compact(cache, torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1]]))
    assert torch.equal(kept, torch.ones(2, 2, dtype=torch.long))
    assert torch.equal(cache.layers[0].keys[0], keys[0, :, [1, 3]])


def test_take_rows_copies_rows_and_cuts_columns_none_of_them_uses():
    cache = _cache()
    keys = torch.randn(3, HEADS, 5, D)
    cache.update(keys, keys + 1, 3)
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    fresh, got = take_rows(cache, mask, [2, 1], _cache())
    assert torch.equal(got, torch.tensor([[1, 1, 1], [0, 1, 1]]))
    assert torch.equal(fresh.layers[3].keys, keys[[2, 1], :, 2:])
    assert torch.equal(fresh.layers[3].values, keys[[2, 1], :, 2:] + 1)
    assert cache.layers[3].keys.shape[0] == 3  # the source keeps its rows


def test_sliding_window_layers_are_refused():
    cache = DynamicCache(config=tiny.config_for("mistral", sliding_window=5))
    with pytest.raises(InternalError, match="sliding"):
        stack(cache, [{0: _kv(2, 0)}, {0: _kv(1, 1)}], 2)
