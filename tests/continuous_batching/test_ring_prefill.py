"""Chunked prefill and prefix caching in the continuous ring (one spawned job per world size): LLaMA at 2
ranks with one stage per rank and with two stages per rank (interleaved: stages 0, 2 | 1, 3), and at 4
ranks with tensor parallelism (pp2 x tp2: each tp rank's prefix cache holds its own heads), 4 slots
(one group per pipeline rank: groups of 2), ``prefill_chunk=4`` and prefix blocks of 4 tokens. A short
request decodes from the start; the next carries a 12-token head (3 blocks) and arrives with it; once it
has tokens the rest arrive, four of them with the same head and tails of their own, so their prompts (13
to 20 tokens, longer than a chunk) join in chunks beside the rows decoding and copy the head's keys and
values at each stage instead of computing them. Once all are done, five more are let in at once (the
feeder held while they are queued, so the plan is the same every run): two head rows join one group in
one op, one of them cut by the budget; a 9-token prompt's last chunk joins its group beside a head row
with a longer tail, in one forward with the group's decoding rows (LLaMA's glue packs an op's rows:
``packed_op.py``, whose own test compares it with the two forwards of a glue that does not);
the fifth reuses two blocks that 9-token row's stages stored from its columns as moved after that
forward. Every greedy output must equal transformers' ``generate`` of that request alone on one
process, token for token (fp32, a LLaMA whose weights are large enough that positions matter; a head
computed in another batch with other padding moves logits by ~1e-6, far below the top-two gaps of
~1e-2; a chunk run at wrong positions moves them by ~1, a block copied from another prompt, from the
wrong columns or into the wrong row too). The counters prove the mechanisms ran: rank 0's chunked row
ops and prefix hits (the head rows: 12 tokens each, the fifth: 8), on every rank the tokens its stages
copied from their prefix caches (each stage copies for each hit), one forward for each op with joining
rows, and two rows with a past (an earlier chunk, a reused head) in one forward where a group has two slots.

The pure parts (the block index, the planner's budget) are in ``test_prefill_plan.py``, the stacked
caches' helpers in ``test_group_stack.py``."""

from __future__ import annotations

import threading

import pytest
import tiny
import torch
from harness import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HEAD = 12  # shared prompt head: 3 blocks of 4
# (head or not, tail length, max_new_tokens): the first decodes while the others join
STREAM = [(False, 3, 14), (True, 5, 6), (True, 2, 5), (False, 17, 4), (True, 8, 7), (True, 1, 3), (True, 6, 5)]
# Then, every row done and every slot free, 4 requests let in at once (groups of 2 slots): two head rows join one
# group in one op (the second's tail cut by the budget: 2 of its 3 tokens, the last in the next op); the other
# group runs the long one in chunks of 4 (0-4, 4-8), its last chunk (8-9) beside the last head row's tail (3).
# A fifth, the long one's first 8 tokens and a tail of 2, waits for a slot and reuses the 2 blocks that row's
# stages stored from its columns as they were moved together after that forward.
TOGETHER = [(True, 2, 6), (True, 3, 6), (False, 9, 4), (True, 3, 4)]
HITS = 4 + 3 + 1  # head rows after the first, and the fifth
HIT_TOKENS = (4 + 3) * HEAD + 8


def _serve(path: str, load: dict, requests: list[dict], together: list[dict]) -> dict | None:
    """Every rank: one continuous engine; rank 0 submits 2 requests, the rest once the second has tokens; once
    all are done, ``together`` queued while the feeder admits nothing, then let in."""
    import hf_pipeline
    from hf_pipeline.serving import CompletionRequest, Engine

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", progress=False,
                                                             **load)
    engine = Engine(model, max_batch=4, batching="continuous", idle_s=0.05, prefill_chunk=4, prefix_block=4)
    out: dict = {"batching": engine.batching, "prefix": engine.prefix_reason, "stages": len(model.stages),
                 "pipeline": model.plan.pp_size}
    if model.ctx.rank == 0:
        gate = _gate()

        def client():
            handles = [engine.submit(CompletionRequest(**r)) for r in requests[:2]]
            next(iter(handles[1]))  # the head is in the prefix caches: the rest arrive while the first decodes
            handles += [engine.submit(CompletionRequest(**r)) for r in requests[2:]]
            out["choices"] = [[c.token_ids for c in h.result(timeout=120)] for h in handles]
            gate.clear()  # every slot is free: the next requests all wait, then join the ops a plan gives them
            handles = [engine.submit(CompletionRequest(**r)) for r in together]
            gate.set()
            out["together"] = [[c.token_ids for c in h.result(timeout=120)] for h in handles]
            engine.drain()

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
    engine.serve_forever()
    if model.ctx.rank == 0:
        thread.join(timeout=60)
    return {**out, "reused": engine.reused_tokens, "chunks": engine.prefill_chunks, "hits": engine.prefix_hits,
            "hit_tokens": engine.prefix_tokens, "prefill": (engine.prefill_ops, engine.prefill_forwards,
                                                            engine.peak_stacked), "times": engine.ring_times}


def _gate() -> threading.Event:
    """Rank 0: the ring's feeder admits rows only while the returned event is set (it starts set)."""
    from hf_pipeline.continuous_batching.feeder import RingFeeder

    gate, admit = threading.Event(), RingFeeder.admit
    gate.set()
    RingFeeder.admit = lambda self, free: admit(self, free) if gate.is_set() else []
    return gate


def _job(cases):
    torch.set_num_threads(1)
    return [_serve(*c) for c in cases]


def _alone(ref, req: dict) -> list[int]:
    """transformers' greedy generate of the request alone, cut at EOS (2) as the engine cuts it."""
    return tiny.greedy_alone(ref, req["prompt_ids"], req["max_new_tokens"])[0]


def _requests() -> tuple[list[dict], list[dict]]:
    g = torch.Generator().manual_seed(7)
    head = torch.randint(5, tiny.VOCAB, (HEAD,), generator=g).tolist()
    stream, together = ([dict(prompt_ids=(head if shared else []) + torch.randint(5, tiny.VOCAB, (n,), generator=g
                                                                                  ).tolist(), max_new_tokens=m)
                          for shared, n, m in kinds] for kinds in (STREAM, TOGETHER))
    tail = torch.randint(5, tiny.VOCAB, (2,), generator=g).tolist()
    return stream, together + [dict(prompt_ids=together[2]["prompt_ids"][:8] + tail, max_new_tokens=4)]


def _sharp_llama(directory) -> str:
    """Tiny LLaMA with weights of std 0.3: its attention is peaked enough that positions matter (at the default
    0.02 scores are ~0, attention ~uniform, and a chunk run at wrong positions moves logits by only ~1e-3)."""
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny.config_for("llama", initializer_range=0.3)).save_pretrained(
        directory)
    return str(directory)


def _check(tmp_path, world: int, layouts: dict) -> None:
    path = _sharp_llama(tmp_path / "llama")
    ref = tiny.reference(path, "AutoModelForCausalLM")
    requests, together = _requests()
    per_rank = run_distributed(_job, world, [(path, load, requests, together) for load in layouts.values()],
                               timeout=600)
    for k, name in enumerate(layouts):
        ranks = [r[k] for r in per_rank]
        got = ranks[0]
        assert got["batching"] == "continuous" and got["prefix"] is None, (name, got)
        for j, req in enumerate(requests):
            assert got["choices"][j] == [_alone(ref, req)], (name, j, req)
        for j, req in enumerate(together):
            assert got["together"][j] == [_alone(ref, req)], (name, j, req)
        assert got["chunks"] >= 8, (name, got["chunks"])  # prompts of 13-20 tokens ran 4 at a time
        assert got["hits"] == HITS and got["hit_tokens"] == HIT_TOKENS, (name, got)
        for r in ranks:  # each of the rank's stages copied the head for each hit
            assert r["reused"] == r["stages"] * HIT_TOKENS, (name, r)
            ops, forwards, stacked = r["prefill"]
            assert forwards == ops, (name, r["prefill"])  # all of an op's joining rows ran in one forward
            # one group per pipeline rank (2: interleaved stages too), so groups of 2 slots: two rows with a past (an
            # earlier chunk, a reused head) in one forward
            assert r["pipeline"] == 2 and stacked == 2, (name, r["prefill"])
            # The time split is of this rank's rings: its stages decoded and prefilled (joining rows at every stage),
            # and its parts fit inside the time it spent in the rings.
            t = r["times"]
            assert t.decode > 0 and t.prefill > 0 and t.wait >= 0, (name, t)
            assert t.decode + t.prefill + t.wait <= t.total, (name, t)
        # a ring without slack: some rank waited for a message
        assert max(r["times"].wait for r in ranks) > 0, (name, [r["times"] for r in ranks])


def test_chunked_prefill_and_prefix_caching_at_2_ranks(tmp_path):
    _check(tmp_path, 2, {"one stage per rank": {}, "interleaved": {"schedule": "interleaved-1f1b",
                                                                   "virtual_stages": 2, "n_microbatches": 2}})


def test_chunked_prefill_and_prefix_caching_under_tensor_parallelism_at_4_ranks(tmp_path):
    _check(tmp_path, 4, {"pp2 x tp2": {"tp_size": 2}})
