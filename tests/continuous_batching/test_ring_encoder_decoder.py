"""Continuous batching of an encoder-decoder model (T5; one spawned 2-rank job): the encoder runs once per
request as it joins, its output travels with the row and is kept per slot on the decoder stages, the
cross-attention cache is merged and cut per row. Three layouts: 2 stages (encoder | decoder: the kept rows'
tokens pass through the encoder's stage), interleaved over 4 stages (a stage holding the encoder's tail and
the decoder's head, then decoder stages after decoder stages) and 2 stages whose first holds the whole encoder
and the decoder's first block (it encodes joining rows and decodes kept ones from their tokens). Tensor
parallelism and data-parallel replicas of T5 are in ``test_ring_parallel.py``'s 4-rank job. A stream of 7
requests of different prompt lengths and ``max_new_tokens`` (two ended by a stop id of their own continuation,
four submitted while the first decodes, 3 slots) must run with ``engine.batching == "continuous"`` and every
greedy output must equal transformers' ``generate`` of that request alone, token for token (fp32; left padding
of the encoder input and of the group's caches is masked and T5's relative position bias sees only distances,
so a row run with another row's padding, encoder output or cache moves its tokens)."""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# (prompt length, max_new_tokens); prompts are seeded word ids.
STREAM = [(3, 9), (8, 3), (5, 12), (2, 5), (10, 7), (4, 10), (6, 4)]
EARLY = (2, 5)  # requests ended by a stop id of their own continuation
# enc | dec; interleaved enc | enc, dec | dec | dec (stages 0, 2 on rank 0): the kept rows' tokens pass through
# an encoder-only stage into one of both stacks, then decoder stages follow decoder stages; enc, dec | dec.
LAYOUTS = {"2 stages": {}, "interleaved": {"schedule": "interleaved-1f1b", "virtual_stages": 2, "n_microbatches": 2,
                                           "split": ["encoder.block.2", "decoder.block.1", "decoder.block.2"]},
           "both stacks first": {"split": ["decoder.block.1"]}}


def _serve(path: str, load: dict, requests: list[dict]) -> dict:
    """Every rank: one continuous engine; rank 0 submits 3 requests, the rest once the first has tokens."""
    import hf_pipeline
    from hf_pipeline.errors import ServingRequestError
    from hf_pipeline.serving import CompletionRequest, Engine

    model = hf_pipeline.AutoModelForSeq2SeqLM.from_pretrained(path, pipeline=True, device="cpu", progress=False,
                                                              **load)
    engine = Engine(model, max_batch=3, batching="continuous", idle_s=0.05)
    out: dict = {"batching": engine.batching, "reason": engine.static_reason,
                 "stacks": [s.stacks for s in model.plan.stages]}
    if model.ctx.rank != 0:
        engine.serve_forever()
        return out
    try:
        engine.check(CompletionRequest(prompt_ids=[5, 6], max_new_tokens=1, echo=True, logprobs=0))
    except ServingRequestError as e:
        out["echo"] = e.param
    choices = tiny.serve_staggered(engine, requests)
    out.update(choices=[[(c.token_ids, c.finish_reason) for c in cs] for cs in choices], peak_rows=engine.peak_rows)
    return out


def _job(cases):
    torch.set_num_threads(1)
    return [_serve(*c) for c in cases]


def test_continuous_ring_serves_t5_at_2_ranks(tmp_path):
    # T5 at the default init scale answers every prompt with the same token; 3x gives varied outputs.
    path = str(tiny.make_checkpoint(tmp_path / "t5", "t5", shards=1, initializer_factor=3.0))
    ref = tiny.reference(path, "AutoModelForSeq2SeqLM")
    requests = tiny.stopping_stream(ref, STREAM, EARLY)
    per_rank = run_distributed(_job, 2, [(path, load, requests) for load in LAYOUTS.values()], timeout=600)
    for k, name in enumerate(LAYOUTS):
        ranks = [r[k] for r in per_rank]
        assert all(r["batching"] == "continuous" for r in ranks), (name, ranks[0]["reason"])
        got = ranks[0]
        assert got["echo"] == "echo", name  # no prompt log-probabilities: the prompt is the encoder's input
        assert got["peak_rows"] == 3, (name, got["peak_rows"])  # the slots were shared: rows waited and joined
        for j, req in enumerate(requests):
            assert got["choices"][j] == [tiny.alone_choice(ref, req)], (name, j, req)
        assert all(got["choices"][j][0][1] == "stop" for j in EARLY), name
    # the interleaved layout has a stage of both stacks, and decoder stages after decoder stages
    assert per_rank[0][1]["stacks"] == [("encoder",), ("encoder", "decoder"), ("decoder",), ("decoder",)]
    # stage 0 holds the whole encoder and the decoder's first block: it encodes and takes the kept rows' tokens
    assert per_rank[0][2]["stacks"] == [("encoder", "decoder"), ("decoder",)]
