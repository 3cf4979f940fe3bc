"""Tier 1: the refusal table of pipelined generate alone (no model, no processes).

The end-to-end cases (each refusal raised on every rank, with its message) are in
``tests/model/test_bad_inputs.py``; here, the table's own rules: stages known, first row wins,
every message fills from its stage's facts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_pipeline.errors import InputError, InputTypeError, InternalError
from hf_pipeline.generation.refusals import REFUSALS, refuse

_ROWS_OK = dict(
    copies=1, beams=1, do_sample=False, batch=8, dp_size=2, n_microbatches=4, return_dict=False, criteria=False,
)


def test_rows_refusals_in_table_order():
    refuse("rows", **_ROWS_OK)  # nothing to refuse
    with pytest.raises(InputError, match=r"^batch of 1 rows is smaller than the 2 data-parallel replicas; pass more"):
        refuse("rows", **dict(_ROWS_OK, batch=1))
    # Two rows apply: the first in the table is the one raised.
    with pytest.raises(InputError, match=r"^num_return_sequences > 1 needs do_sample=True"):
        refuse("rows", **dict(_ROWS_OK, copies=2, batch=1, n_microbatches=0))
    with pytest.raises(InputError, match=r"^n_microbatches must be >= 1, got 0$"):
        refuse("rows", **dict(_ROWS_OK, n_microbatches=0))
    # The caller's stopping criteria see the whole batch: one replica has only its share of it.
    refuse("rows", **dict(_ROWS_OK, criteria=True, dp_size=1))
    with pytest.raises(InputError, match=r"^stopping_criteria with 2 data-parallel replicas: each replica would"):
        refuse("rows", **dict(_ROWS_OK, criteria=True))


def test_config_refusals_keep_their_builtin_bases():
    facts = dict(extra={}, encoder_decoder=False, streamer=None)
    with pytest.raises(TypeError, match=r"unexpected generate\(\) argument\(s\) \['a', 'b'\]") as caught:
        refuse("config", config=GenerationConfig(), **dict(facts, extra={"b": 1, "a": 2}))
    assert isinstance(caught.value, InputTypeError)
    with pytest.raises(ValueError, match=r"^prefill_chunk_size=4 is not supported for encoder-decoder models"):
        refuse("config", config=GenerationConfig(prefill_chunk_size=4), **dict(facts, encoder_decoder=True))
    refuse("config", config=GenerationConfig(num_beams=2), **facts)  # beam search runs
    with pytest.raises(ValueError, match=r"^generation mode 'beam_sample' is not supported"):
        refuse("config", config=GenerationConfig(num_beams=2, do_sample=True), **facts)
    with pytest.raises(ValueError, match=r"^a streamer cannot be used with beam search"):
        refuse("config", config=GenerationConfig(num_beams=2), **dict(facts, streamer=object()))
    with pytest.raises(ValueError, match=r"^output_attentions / output_hidden_states are not supported"):
        refuse("config", config=GenerationConfig(return_dict_in_generate=True, output_attentions=True), **facts)
    # Beam search's neighbours, refused by name; its arguments checked before transformers fails deep inside
    for config, start in (
        (GenerationConfig(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "generation mode .group_beam"),
        (GenerationConfig(num_beams=2, force_words_ids=[[3]]), "generation mode 'constrained_beam_search'"),
        (GenerationConfig(num_beams=2, low_memory=True), "low_memory=True is not supported with beam search"),
        (GenerationConfig(num_beams=0), "num_beams must be >= 1, got 0"),
    ):
        with pytest.raises(InputError, match=f"^{start}"):
            refuse("config", config=config, **facts)
    for field, value in (("num_beams", 2.5), ("num_beams", True), ("length_penalty", "a")):
        config = GenerationConfig(num_beams=2)
        setattr(config, field, value)
        with pytest.raises(InputTypeError, match=f"^{field} must be"):
            refuse("config", config=config, **facts)


def test_input_shapes_are_named():
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(InputError, match=r"^attention_mask shape \(2, 4\) does not match input_ids \(2, 5\)$"):
        refuse("inputs", input_ids=ids, attention_mask=torch.ones(2, 4), token_type_ids=None, skeleton=None,
               encoder_decoder=False)


def test_every_row_has_a_known_stage_and_a_library_class():
    assert {rule.stage for rule in REFUSALS} == {"call", "inputs", "config", "rows", "tokens", "length"}
    assert all(issubclass(rule.error, InputError) for rule in REFUSALS)
    with pytest.raises(InternalError, match="unknown refusal stage"):
        refuse("nonsense")


def test_seed_and_streamer_are_checked_like_transformers_checks_them():
    import types

    import numpy as np
    from transformers import TextStreamer

    skel = types.SimpleNamespace(can_generate=lambda: True)
    call = dict(skeleton=skel, kwargs={}, input_ids=torch.zeros(1, 2, dtype=torch.long))
    for seed in (None, 0, 2**40, np.int64(3)):
        refuse("call", **call, seed=seed, streamer=None)
    for seed, shown in ((float("nan"), "nan of type float"), ("abc", "'abc' of type str"), (True, "True of type bool"),
                        (1.5, "1.5 of type float")):
        with pytest.raises(InputTypeError, match=rf"^seed must be an int .*got {shown}; pass e\.g\. seed=0$"):
            refuse("call", **call, seed=seed, streamer=None)
    refuse("call", **call, seed=None, streamer=TextStreamer.__new__(TextStreamer))
    with pytest.raises(InputTypeError, match=r"put\(ids\) and end\(\) methods .*got object without put\(\) and end"):
        refuse("call", **call, seed=None, streamer=object())
    with pytest.raises(InputTypeError, match=r"got SimpleNamespace without end\(\)$"):
        refuse("call", **call, seed=None, streamer=types.SimpleNamespace(put=print))


def test_a_pad_token_outside_the_vocabulary_is_refused_only_when_a_row_can_finish_early():
    # transformers feeds a finished row's pad token back to the embedding (IndexError); without EOS or
    # stopping criteria no row finishes early and the pad token is never used.
    refuse("tokens", pad=500, vocab=96, can_finish=False)
    refuse("tokens", pad=95, vocab=96, can_finish=True)
    for pad in (96, 500, -1):
        with pytest.raises(InputError, match=rf"^pad_token_id={pad} is outside the model's vocabulary of 96 tokens "
                                             r"\(config\.vocab_size\).*pass a pad_token_id in \[0, 95\]"):
            refuse("tokens", pad=pad, vocab=96, can_finish=True)
