"""Packed ops (:mod:`hf_pipeline.continuous_batching.packed_op`): an op's decoding and joining rows in one forward.

Pure: the packed layout (inputs, mask, past, the split of the new keys, the outputs) on hand-made tensors, exact.
In process: a model of two stages in one process (both stages' :class:`RingStage` here, no ranks) runs the same
ops packed and unpacked (two forwards an op, as on a glue that does not pack): rows joining whole and in chunks,
rows decoding beside them, a row leaving. Every op's last-stage logits agree to 1e-4 (another batch shape moves
them up to 1.5e-5 on ATen's generic kernels; a token that sees another row's keys or a key written to the wrong
row moves them by 4-7: weights of std 0.3), each row's greedy tokens equal transformers' ``generate`` of it
alone, and the group caches the two leave hold the same keys in every row's columns."""

from __future__ import annotations

import pytest
import tiny
import torch

from hf_pipeline.continuous_batching.packed_op import PackedCache, PackedOp
from hf_pipeline.continuous_batching.wire import NewRow, OpHeader, pack_rows

CPU = torch.device("cpu")


def _row(slot: int, n: int, start: int = 0, end: int = -1) -> NewRow:
    return NewRow(slot=slot, prompt=list(range(10 + slot * 10, 10 + slot * 10 + n)), max_new_tokens=4, start=start,
                  end=end)


@pytest.mark.unit
def test_packed_layout_inputs_mask_and_keys():
    # 2 decoding rows of 3 past columns (row 0's first is padding), a whole prompt of 2 tokens, a chunk 2..5 of a
    # 6-token prompt with its own past of 2 tokens.
    rows = [_row(2, 2), _row(3, 6, start=2, end=5)]
    op = PackedOp(decoding=2, columns=3, rows=rows, device=CPU)
    assert op.starts == [2, 4] and op.tokens == 7 and op.past_columns() == 2 * 3 + 2
    ids, pos = op.inputs(True, torch.tensor([[7], [8]]), None, torch.tensor([2, 3]))
    assert ids.tolist() == [[7, 8, 30, 31, 42, 43, 44]] and pos.tolist() == [[2, 3, 0, 1, 2, 3, 4]]
    hidden = torch.arange(2 * 3 * 1.0).view(2, 3, 1)  # (J, widest, 1): the whole prompt right aligned
    states, _ = op.inputs(False, torch.tensor([[[5.0]], [[6.0]]]), hidden, torch.tensor([2, 3]))
    assert states[0, :, 0].tolist() == [5, 6, 1, 2, 3, 4, 5]
    mask = op.mask(torch.tensor([[0, 1, 1], [1, 1, 1]]))[0, 0].int()
    assert mask.shape == (7, 8 + 7)
    assert mask[0].tolist() == [0, 1, 1, 0, 0, 0, 0, 0] + [1, 0, 0, 0, 0, 0, 0]  # its past, itself
    assert mask[1].tolist() == [0, 0, 0, 1, 1, 1, 0, 0] + [0, 1, 0, 0, 0, 0, 0]
    assert mask[3].tolist() == [0] * 8 + [0, 0, 1, 1, 0, 0, 0]  # the whole prompt's second token: causal
    assert mask[6].tolist() == [0] * 6 + [1, 1] + [0, 0, 0, 0, 1, 1, 1]  # the chunk's last: its past, its part
    # A sliding window of 3 positions: its layers hold 2 past columns a row (the group's last 2, the chunk's own
    # last 2: positions 0-1 of its 2); a token sees keys less than 3 positions before it.
    assert op.past_columns(3) == 2 * 2 + 2
    slide = op.mask(torch.tensor([[0, 1, 1], [1, 1, 1]]), 3)[0, 0].int()
    assert slide.shape == (7, 6 + 7)
    assert slide[0].tolist() == [1, 1, 0, 0, 0, 0] + [1, 0, 0, 0, 0, 0, 0]
    assert slide[4].tolist() == [0, 0, 0, 0, 1, 1] + [0, 0, 0, 0, 1, 0, 0]  # position 2: positions 0-2
    assert slide[6].tolist() == [0] * 6 + [0, 0, 0, 0, 1, 1, 1]  # position 4: 2-4, not its past 0-1
    # Past: the group's rows one after another, then the chunk's own; new keys split back by row.
    g = torch.arange(2 * 1 * 3 * 1.0).view(2, 1, 3, 1)  # (R, heads, C, D)
    own = [None, {0: (torch.tensor([[[90.0], [91.0]]]), torch.zeros(1, 2, 1))}]
    cache = PackedCache(op.past({0: (g, g)}, own))
    new = torch.arange(100.0, 107.0).view(1, 1, 7, 1)
    keys, _ = cache.update(new, new, 0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 90, 91] + list(range(100, 107))
    assert cache.get_seq_length() == 0
    decoded, per_row = op.new_keys(cache.new, own)
    assert decoded[0][0][:, 0, :, 0].tolist() == [[100], [101]]
    assert per_row[0][0][0][0, :, 0].tolist() == [102, 103]
    assert per_row[1][0][0][0, :, 0].tolist() == [90, 91, 104, 105, 106]
    assert op.keep().tolist() == [0, 1, 3]  # the decoding rows, the whole prompt's last token (the chunk: none)
    logits = torch.arange(3.0).view(1, 3, 1)
    old, joined = op.outputs(logits, last=True)
    assert old[:, 0, 0].tolist() == [0, 1] and joined[:, 0, 0].tolist() == [2, 0]
    old, joined = op.outputs(torch.arange(7.0).view(1, 7, 1), last=False)
    assert joined[:, :, 0].tolist() == [[0, 2, 3], [4, 5, 6]]


@pytest.mark.unit
def test_packing_pays_while_the_masked_scores_cost_less_than_a_weight_read():
    # The decode-heavy model's stage: hidden 1024, 12.6M parameters a layer. Four rows of 100 columns and a
    # 40-token prompt: 44 x 444 score elements, most masked, ~0.07 GFLOP a layer against 16 tokens' 0.4: packs.
    # Eight rows of 2000 columns beside a 512-token chunk: ~34 GFLOP a layer of masked scores: two forwards.
    short = PackedOp(decoding=4, columns=100, rows=[_row(4, 40)], device=CPU)
    long = PackedOp(decoding=8, columns=2000, rows=[NewRow(slot=9, prompt=[5] * 600, max_new_tokens=1, end=512)],
                    device=CPU)
    assert short.pays(1024, 12.6e6) and not long.pays(1024, 12.6e6)
    assert not short.pays(1024, 0.1e6)  # a layer of few weights: their read is cheap, the masked scores are not


def _two_stages(directory, config):
    """A pipelined model of ``config`` (weights of std 0.3) on two stages in this process, and transformers' own."""
    import transformers

    import hf_pipeline

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(directory, pipeline=True, device="cpu", progress=False,
                                                             num_stages=2, virtual_stages=2)
    return model, tiny.reference(str(directory), "AutoModelForCausalLM")


def _ops(g: torch.Generator):
    """(kept slots, joining rows) per op: rows join whole and in chunks beside decoding rows, one leaves."""
    p = {s: torch.randint(5, tiny.VOCAB, (n,), generator=g).tolist() for s, n in ((0, 6), (1, 9), (2, 3), (3, 7))}
    row = lambda s, start=0, end=-1: NewRow(slot=s, prompt=p[s], max_new_tokens=8, start=start, end=end)  # noqa: E731
    return p, [((), [row(0), row(1, 0, 4)]), ((0,), [row(2), row(1, 4, 9)]), ((0, 1, 2), [row(3, 0, 3)]),
               ((0, 1, 2), [row(3, 3, 7)]), ((0, 1, 2, 3), []), ((1, 2, 3), []), ((1, 2, 3), [])]


def _serve(model, packs: bool):
    from hf_pipeline.continuous_batching.ring_stage import RingStage

    lanes = [RingStage(model, s, groups=1, group_size=4) for s in sorted(model.stages, key=lambda s: s.spec.index)]
    for lane in lanes:
        lane.packs = lane.packs and packs
    prompts, ops = _ops(torch.Generator().manual_seed(3))
    tokens: dict[int, list[int]] = {}
    logits = []
    for kept, new in ops:
        header = OpHeader(run=True, kept=kept, joining=tuple(r.slot for r in new),
                          payload_bytes=pack_rows(new).numel() if new else 0)
        old_in = torch.tensor([[tokens[s][-1]] for s in kept], dtype=torch.long)
        old, joined = lanes[0].run(0, header, new, old_in, None)
        old, joined = lanes[1].run(0, header, new, old, joined)
        lanes[1].choose(0, new, old, joined)
        fin = [r.slot for r in new if r.final]
        scores = torch.cat([o[:, -1] for o in (old, None if joined is None else joined[[r.final for r in new]])
                            if o is not None])
        logits.append(scores)
        for s, t in zip(list(kept) + fin, scores.argmax(-1).tolist()):
            tokens.setdefault(s, []).append(t)
    return lanes, prompts, tokens, logits


def _check(model, ref, packs: bool) -> None:
    """The ops packed (where the model packs) and in two forwards: the same logits, tokens and caches."""
    packed, prompts, tokens, logits = _serve(model, True)
    plain, _, tokens_2, logits_2 = _serve(model, False)
    assert [lane.packed_ops for lane in packed] == ([4, 4] if packs else [0, 0])
    # two forwards an op with joining rows (on sliding caches the rows that are no whole prompt one by one: 2 more)
    unpacked = 10 if plain[0].full_attention else 12
    assert [lane.packed_ops for lane in plain] == [0, 0] and [lane.forwards for lane in plain] == [unpacked] * 2
    assert [lane.forwards for lane in packed] == ([7, 7] if packs else [unpacked] * 2)
    for a, b in zip(logits, logits_2):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert tokens == tokens_2
    for s, got in tokens.items():  # transformers' generate stops at EOS (2), which the ops here run past
        alone = tiny.greedy_alone(ref, prompts[s], len(got), stops=())[0]
        assert got[: len(alone)] == alone and (len(alone) == len(got) or alone[-1] == 2), (s, got, alone)
    for lane_a, lane_b in zip(packed, plain):  # the same keys in every row's columns
        a, b = lane_a.state[0], lane_b.state[0]
        assert a.slots == b.slots == [1, 2, 3] and torch.equal(a.next_pos, b.next_pos)
        for la, lb in zip(a.cache.layers, b.cache.layers):
            if la.is_initialized and la.keys is not None and la.keys.numel():
                for row in range(3):  # a sliding layer holds the mask's last columns
                    ma, mb = a.mask[row, -la.keys.shape[2]:].bool(), b.mask[row, -lb.keys.shape[2]:].bool()
                    ka, kb = la.keys[row][:, ma], lb.keys[row][:, mb]
                    torch.testing.assert_close(ka, kb, atol=1e-4, rtol=0)


@pytest.mark.unit
def test_packed_ops_equal_two_forwards_and_generate_alone(tmp_path):
    # LLaMA's glue (its own loop over the layers)
    _check(*_two_stages(tmp_path, tiny.config_for("llama", initializer_range=0.3)), packs=True)


@pytest.mark.equiv
@pytest.mark.parametrize("family", ["gpt2", "mistral", "qwen2", "qwen3_moe", "gpt_bigcode", "phi", "olmo2",
                                    "gemma3_text", "gemma2", "gpt_oss", "xglm", "bloom"])
def test_packed_ops_across_glues_and_families(tmp_path, family):
    # GPT-2's glue; LLaMA's with a window of 5 on every layer (Mistral) and on some (Qwen2); the decoder glue
    # (transformers' model forward over the stage's layers): an MoE, learned positions, partial rotary, QK norms,
    # sliding and full layers mixed (a mask per kind), eager attention (an additive mask: soft-capping in Gemma 2,
    # sinks and a window in gpt-oss); two of its recipe's [unpacked] types (positions offset by the cache's
    # length, ALiBi from the 2D mask), whose ops run in two forwards. Prompts of 3-9 tokens, chunks of 4-5:
    # windows of 5 cut both rows' pasts and chunks.
    from decoders import decoder_config

    if family == "gpt2":
        config = tiny.config_for("gpt2", initializer_range=0.3)
    elif family in ("mistral", "qwen2"):
        config = tiny.sliding_config(family, initializer_range=0.3)
    else:
        config = decoder_config(family, initializer_range=0.3)
    _check(*_two_stages(tmp_path, config), packs=family not in ("xglm", "bloom"))
