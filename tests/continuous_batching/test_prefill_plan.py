"""The pure parts of chunked prefill and prefix caching: the block index (LRU, mirrored between the
coordinator and each stage) and the planner's per-op token budget."""

from __future__ import annotations

import pytest

from hf_pipeline.continuous_batching.prefill_plan import PrefillPlanner
from hf_pipeline.continuous_batching.prefix_cache import PrefixCache, block_keys
from hf_pipeline.continuous_batching.wire import NewRow

pytestmark = pytest.mark.unit


def test_prefix_cache_matches_whole_blocks_and_evicts_tails_first():
    cache = PrefixCache(block=4, capacity=3)
    head = list(range(10, 18))  # 2 blocks
    cache.add(head + [1, 2, 3, 4, 5])  # 3 whole blocks kept, the last token's partial block not
    assert cache.match(head + [1, 2, 3, 4, 9]) == 12  # 3 blocks, the last token left to run
    assert cache.match(head + [1, 2, 3, 4]) == 8  # never the whole prompt: its last token must run
    assert cache.match(head + [7, 7, 7, 7, 7]) == 8 and cache.match([0] + head) == 0
    cache.add(head + [6, 6, 6, 6])  # a 4th block: the least recent, the first prompt's tail, goes
    assert cache.match(head + [1, 2, 3, 4, 9]) == 8 and cache.match(head + [6, 6, 6, 6, 0]) == 12
    assert len(cache.take(head + [6, 6, 6, 6, 0], 12)) == 3


def test_block_keys_name_the_whole_prefix_by_a_digest():
    # A key stands for everything before it: equal second blocks under different first blocks get different
    # keys, so a row never reuses keys and values computed after another prompt's head. The keys are SHA-256
    # digests (32 bytes), not Python's 64-bit hash, which crafted prompts could collide (another client's
    # prompt would then become a request's context).
    a, b = block_keys([1, 2, 3, 4, 5, 6], 3, 2), block_keys([9, 2, 3, 4, 5, 6], 3, 2)
    assert a[0] != b[0] and a[1] != b[1] and all(len(k) == 32 for k in a + b)
    assert block_keys([1, 2, 3, 4, 5, 6, 7], 3, 2) == a  # the same blocks, the same keys (every process alike)
    assert block_keys([3, 2, 1, 4, 5, 6], 3, 2)[1] != a[1]  # order within a block counts


def test_prefix_cache_counts_the_bytes_it_holds():
    # What a ring reports as its peak KV bytes includes the prefix blocks (the budget also pays for them):
    # added blocks count, evicted ones stop counting, and an index (no tensors) holds none.
    import torch

    cache, index = PrefixCache(block=2, capacity=2), PrefixCache(block=2, capacity=2)
    kv = lambda b: {0: (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))}  # noqa: E731 - one layer's keys and values
    cache.add([1, 2, 3, 4], kv)
    index.add([1, 2, 3, 4])
    assert cache.nbytes == 2 * 2 * 8 * 4 and index.nbytes == 0  # 2 blocks x (keys, values) x 8 floats x 4 bytes
    cache.add([5, 6, 7, 8, 9, 10], kv)  # 3 more blocks: 3 of 5 evicted
    assert len(cache.blocks) == 2 and cache.nbytes == 2 * 2 * 8 * 4


def test_planner_splits_prompts_by_the_budget_and_reuses_prefixes():
    index = PrefixCache(block=4, capacity=16)
    planner = PrefillPlanner(chunk=6, indexes=[index])
    queue = [NewRow(slot=-1, prompt=list(range(5, 19)), max_new_tokens=2),  # 14 tokens
             NewRow(slot=-1, prompt=[3, 4], max_new_tokens=2)]

    def admit(free):
        return [NewRow(**{**queue.pop(0).__dict__, "slot": free[0]})] if queue else []

    ops = [planner.plan(0, range(0, 3), [], admit) for _ in range(3)]
    # 6 tokens an op; the short prompt is admitted beside the long one's last chunk and, whole, runs first
    assert [[(r.slot, r.start, r.end) for r in op] for op in ops] == [[(0, 0, 6)], [(0, 6, 12)],
                                                                      [(1, 0, 2), (0, 12, 14)]]
    assert not planner.partial and planner.chunks == 3
    queue.append(NewRow(slot=-1, prompt=list(range(5, 17)) + [40, 41], max_new_tokens=2))  # shares 12 tokens
    (r,) = planner.plan(0, range(0, 3), [1], admit)
    assert (r.slot, r.start, r.end, r.reused) == (0, 12, 14, 12) and planner.prefix_hits == 1
