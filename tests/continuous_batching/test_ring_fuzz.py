"""``devtools.ring_fuzz``, the differential fuzz of continuous batching: its seeded streams (pure), and one seed run
at 2 ranks on LLaMA (a stage per rank): 12 requests, 3 rows in flight, prompts joining in 4-token chunks beside
decoding rows and reusing 4-token prefix blocks; every request's greedy tokens must equal transformers' alone,
and the Engine's counters must show the chunks and prefix hits ran (a stream that exercised neither would pass
without testing them). The fuzz over many seeds, layouts and families is run by hand (its docstring)."""

from __future__ import annotations

import pytest
import tiny
from harness import run_distributed

from devtools import ring_fuzz

SEED = 1  # 12 requests, max_batch 3, prefill_chunk 4, prefix blocks of 4, 7 requests at once


@pytest.mark.unit
def test_a_seed_draws_the_same_stream_within_the_model():
    a, b = (ring_fuzz.stream_for(SEED, vocab=tiny.VOCAB, positions=40) for _ in range(2))
    assert a == b  # every rank draws the same stream and settings from the seed
    assert a.engine == {"max_batch": 3, "prefill_chunk": 4, "prefix_cache": True, "prefix_block": 4}
    assert 1 <= a.first < len(a.requests)
    for r in a.requests:
        assert all(5 <= t < tiny.VOCAB for t in r["prompt_ids"]) and r["ignore_eos"]
        assert 1 <= len(r["prompt_ids"]) and len(r["prompt_ids"]) + r["max_new_tokens"] <= 40
    heads = {tuple(r["prompt_ids"][:4]) for r in a.requests}
    assert len(heads) < len(a.requests)  # some prompts share a head: the prefix cache has something to reuse
    assert ring_fuzz._seeds("3,7-9") == [3, 7, 8, 9]


def _fuzz(path: str) -> list | None:
    return ring_fuzz.fuzz(path, [SEED], "pp2")


@pytest.mark.dist
def test_one_seed_at_two_ranks_equals_transformers(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama", shards=1, initializer_range=0.3)
    rank0, rank1 = run_distributed(_fuzz, 2, str(path))
    assert rank1 is None
    (stream,) = rank0
    assert len(stream.requests) == 12 and stream.mismatches == []
    assert stream.counters["continuous"] and stream.counters["chunks"] > 0 and stream.counters["prefix_hits"] > 0
