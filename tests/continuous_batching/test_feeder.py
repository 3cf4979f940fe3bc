"""Rank 0's feeder of the continuous ring, alone (no ranks, no model): the serving queue's requests
join free slots within the pool, a request's choices each take a row, a cancelled request waiting for
a slot is skipped, and a row's slot frees when its choice ends."""

from __future__ import annotations

from collections import deque

import pytest

from hf_pipeline.serving import CompletionRequest, Handle

pytestmark = pytest.mark.unit


def test_ring_feeder_fills_free_slots_within_the_pool_and_frees_them():
    import random
    import threading as th
    import types
    from types import SimpleNamespace

    from hf_pipeline.continuous_batching.feeder import RingFeeder
    from hf_pipeline.serving.engine import Engine, _ChoiceWriter

    handles = [Handle(CompletionRequest(prompt_ids=[1, 2], max_new_tokens=2), "a"),
               Handle(CompletionRequest(prompt_ids=[3], temperature=0.5, seed=9, n=2), "b"),
               Handle(CompletionRequest(prompt_ids=[4]), "c"), Handle(CompletionRequest(prompt_ids=[5]), "d")]
    engine = SimpleNamespace(_lock=th.Lock(), _queue=deque(handles), _rng=random.Random(0), running=[], eos={2},
                             tokenizer=None)
    engine.next_request = types.MethodType(Engine.next_request, engine)  # the engine's own, on this queue
    engine.stop_ids = types.MethodType(Engine.stop_ids, engine)
    engine.queued = 4
    feeder = RingFeeder(engine, capacity=3, writer=_ChoiceWriter)
    rows = feeder.admit([0, 1, 5, 7])  # 4 free slots, but a pool of 3 rows: a, then both choices of b
    assert [(r.slot, r.prompt, r.index, r.seed) for r in rows] == [(0, [1, 2], 0, None), (1, [3], 0, 9), (5, [3], 1, 9)]
    assert feeder.admit([7]) == [] and not feeder.idle()  # full: nothing joins, c and d wait
    handles[2].cancel()
    assert not feeder.deliver(0, 11) and feeder.deliver(0, 12)  # a's second token ends it ("length"), slot 0 frees
    assert handles[0].result()[0].token_ids == [11, 12] and handles[0] not in engine.running
    assert feeder.deliver(1, 2)  # EOS ends b's first choice
    rows = feeder.admit([0, 1])  # c was cancelled while it waited: skipped; d joins
    assert [(r.slot, r.prompt) for r in rows] == [(0, [5])] and handles[2] not in engine.running
    assert feeder.peak_rows == 3
