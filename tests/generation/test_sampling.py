"""Tier 1: the pure helpers of pipelined generation (no model, no processes)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationMixin
from transformers.generation.logits_process import TopKLogitsWarper

from hf_pipeline.generation.microbatches import microbatch_bounds
from hf_pipeline.generation.sampling import (
    left_padded_position_ids,
    row_generators,
    row_seed,
    select_from_noise,
    select_tokens,
    step_noise,
)


@pytest.mark.parametrize("batch,n", [(1, 1), (7, 3), (16, 4), (5, 5)])
def test_microbatch_bounds_cover_the_batch_in_order(batch, n):
    bounds = microbatch_bounds(batch, n)
    assert len(bounds) == n
    assert [r for lo, hi in bounds for r in range(lo, hi)] == list(range(batch))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert sizes == [len(c) for c in torch.arange(batch).tensor_split(n)]  # as torch splits


def test_microbatch_bounds_reject_impossible_splits():
    with pytest.raises(ValueError, match="n_microbatches"):
        microbatch_bounds(3, 4)
    with pytest.raises(ValueError, match="empty batch"):
        microbatch_bounds(0, 1)


def test_position_ids_equal_transformers_for_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    ids = torch.ones_like(mask)
    want = GenerationMixin._prepare_position_ids_for_generation(None, ids, {"attention_mask": mask})
    assert torch.equal(left_padded_position_ids(mask, 5), want)
    assert left_padded_position_ids(mask, 5)[0].tolist() == [0, 0, 0, 1, 2]
    no_mask = GenerationMixin._prepare_position_ids_for_generation(None, ids, {})
    assert torch.equal(left_padded_position_ids(None, 5, batch=3), no_mask.expand(3, 5))


def test_row_seeds_are_deterministic_and_distinct():
    seeds = {row_seed(s, r) for s in range(4) for r in range(1000)}
    assert len(seeds) == 4000
    assert row_seed(7, 3) == row_seed(7, 3)
    assert all(0 <= x < 2**63 for x in seeds)


def test_greedy_is_argmax_on_ties_nan_and_inf_rows():
    # transformers' greedy pick is argmax; ours must give the same index wherever they could part:
    # ties (the first maximum), a NaN in a row, a row of -inf, bf16-rounded scores, large vocabularies.
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        vocab = int(torch.randint(1, 40000, (1,), generator=g))
        scores = torch.randint(-2, 3, (6, vocab), generator=g).float()  # few distinct values: many ties
        if trial % 3 == 0:
            scores[0, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
        if trial % 4 == 0:
            scores[1] = float("-inf")
        if trial % 5 == 0:
            scores = scores + torch.randn(6, vocab, generator=g).to(torch.bfloat16).float()
        assert torch.equal(select_tokens(scores, do_sample=False), scores.argmax(-1)), trial


def test_sampling_does_not_depend_on_how_rows_are_grouped():
    # The property that makes seeded sampling identical at every world size: row r draws from its own stream.
    scores = torch.randn(8, 50)
    whole = select_tokens(scores, do_sample=True, generators=row_generators(123, range(8)))
    parts = torch.cat(
        [
            select_tokens(scores[lo:hi], do_sample=True, generators=row_generators(123, range(lo, hi)))
            for lo, hi in [(0, 3), (3, 4), (4, 8)]
        ]
    )
    assert torch.equal(whole, parts)
    other = select_tokens(scores, do_sample=True, generators=row_generators(124, range(8)))
    assert not torch.equal(whole, other), "another seed should change the draw"


def test_sampling_follows_softmax_of_the_scores():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    scores = probs.log().expand(4000, 4)  # 4000 rows, one draw each
    draws = select_tokens(scores, do_sample=True, generators=row_generators(0, range(4000)))
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert (freq - probs).abs().max() < 0.03, freq  # ~4 standard deviations of the largest cell


def test_sampling_respects_transformers_top_k():
    scores = torch.randn(64, 30)
    warped = TopKLogitsWarper(top_k=3)(None, scores.clone())
    draws = select_tokens(warped, do_sample=True, generators=row_generators(5, range(64)))
    top3 = scores.topk(3, dim=-1).indices
    assert (draws[:, None] == top3).any(-1).all()


def test_sampling_needs_one_generator_per_row():
    with pytest.raises(ValueError, match="one generator per row"):
        select_tokens(torch.randn(3, 4), do_sample=True, generators=row_generators(0, range(2)))


@pytest.mark.parametrize("rows, vocab", [(1, 10), (6, 96), (16, 8192), (3, 50257)])
def test_a_step_of_noise_samples_what_torch_multinomial_samples(rows, vocab):
    # transformers samples with torch.multinomial(probs, 1) on the global stream; the pipeline's last stage draws
    # that step's block once (step_noise) and picks each microbatch's rows from it (select_from_noise). Equal tokens
    # and an equal stream afterwards, whole or in row groups: a torch that samples otherwise fails here.
    scores = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
    scores[0, : vocab // 2] = float("-inf")  # a warper's masked tokens
    torch.manual_seed(7)
    want = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
    after = torch.rand(3)
    torch.manual_seed(7)
    noise = step_noise(rows, vocab, "cpu")
    parts = [select_from_noise(scores[lo:hi], noise[lo:hi]) for lo, hi in [(0, rows // 2), (rows // 2, rows)]]
    assert torch.equal(torch.cat(parts), want) and torch.equal(torch.rand(3), after)
