"""Tier 1: every index tensor against the table it indexes, and the dtypes embeddings and losses take
(no model, no processes). The 2-rank cases are in ``tests/model/test_bad_inputs.py``."""

from __future__ import annotations

import pytest
import tiny
import torch

from hf_pipeline.errors import InputError
from hf_pipeline.runtime import checks


def test_tables_come_from_the_config_fields():
    bert, gpt2, llama = (tiny.config_for(a) for a in ("bert", "gpt2", "llama"))
    assert checks.index_table(bert, "token_type_ids") == (bert.type_vocab_size, "config.type_vocab_size")
    assert checks.index_table(gpt2, "token_type_ids") == (96, "config.vocab_size")  # GPT-2 embeds types with wte
    assert checks.index_table(gpt2, "position_ids") == (128, "config.max_position_embeddings")
    assert checks.index_table(llama, "position_ids") is None  # rotary: no table to run off


def test_bert_token_types_beyond_type_vocab_size_are_refused():
    bert = tiny.config_for("bert")
    ids = torch.ones(2, 5, dtype=torch.long)
    checks.check_model_inputs(bert, None, {"input_ids": ids, "token_type_ids": torch.ones(2, 5, dtype=torch.long)})
    types = torch.zeros(2, 5, dtype=torch.long)
    types[1, 3] = bert.type_vocab_size
    with pytest.raises(InputError, match=r"token_type_ids holds 2 at \[1, 3\], outside the table of 2 entries it "
                                         r"indexes \(config\.type_vocab_size\)"):
        checks.check_model_inputs(bert, None, {"input_ids": ids, "token_type_ids": types})
    with pytest.raises(InputError, match=r"token_type_ids has dtype torch\.int16"):
        checks.check_model_inputs(bert, None, {"input_ids": ids, "token_type_ids": types.short()})


def test_positions_checked_only_against_a_learned_table():
    ids = torch.ones(1, 4, dtype=torch.long)
    far = torch.tensor([[0, 1, 2, 500]])
    checks.check_model_inputs(tiny.config_for("llama"), None, {"input_ids": ids, "position_ids": far})
    with pytest.raises(InputError, match=r"position_ids holds 500 at \[0, 3\].*\(config\.max_position_embeddings\)"):
        checks.check_model_inputs(tiny.config_for("gpt2"), None, {"input_ids": ids, "position_ids": far})
    with pytest.raises(InputError, match=r"position_ids holds -1 at \[0, 0\]"):
        checks.check_model_inputs(tiny.config_for("gpt2"), None, {"input_ids": ids, "position_ids": far * 0 - 1})


def test_dtypes_as_transformers_takes_them():
    vocab = 96
    checks.check_token_ids(torch.ones(2, 3, dtype=torch.int32), vocab=vocab)  # embeddings take Int too
    for dtype in (torch.int16, torch.uint8, torch.int8):
        with pytest.raises(InputError, match=rf"input_ids has dtype {dtype}, but embeddings take torch\.long"):
            checks.check_token_ids(torch.ones(2, 3, dtype=dtype), vocab=vocab)
    ids = torch.ones(2, 3, dtype=torch.long)
    checks.check_labels("causal_lm", ids.to(torch.uint8), input_ids=ids)  # the loss takes Byte targets
    checks.check_labels("sequence_classification", torch.tensor([0, 1]), input_ids=ids, num_labels=3)
    checks.check_labels("sequence_classification", torch.tensor([[0.0, 1.0]] * 2), input_ids=ids, num_labels=2)
    with pytest.raises(InputError, match=r"for sequence_classification, got dtype torch\.int32"):
        checks.check_labels("sequence_classification", torch.tensor([0, 1], dtype=torch.int32), input_ids=ids,
                            num_labels=3)
    with pytest.raises(InputError, match=r"labels must be a torch\.long tensor for masked_lm, got dtype torch\.int32"):
        checks.check_labels("masked_lm", ids.int(), input_ids=ids)


def test_inputs_embeds_width_and_one_dimensional_masks():
    llama = tiny.config_for("llama")
    checks.check_model_inputs(llama, None, {"inputs_embeds": torch.zeros(2, 3, 32)})
    for bad in (torch.zeros(2, 3, 31), torch.zeros(2, 32), torch.zeros(2, 3, 32, dtype=torch.long)):
        with pytest.raises(InputError, match=r"inputs_embeds must be a floating point tensor of shape "
                                             r"\(batch, length, 32\) \(config\.hidden_size\)"):
            checks.check_model_inputs(llama, None, {"inputs_embeds": bad})
    with pytest.raises(InputError, match=r"got shape \(3,\) \(1-D\); pass attention_mask\[None\]"):
        checks.check_model_inputs(
            llama, None, {"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.ones(3)}
        )


def test_inputs_embeds_dtype_as_transformers_takes_it():
    # transformers runs narrower floats (float16 embeds of a float32 model are promoted where they meet
    # its weights) and raises on wider ones (float64: "expected m1 and m2 to have the same dtype" in
    # LLaMA and T5, "mixed dtype (CPU)" in GPT-2's and BERT's layer norm). The pipelined results of
    # the accepted ones equal transformers': tests/model/test_attacker_inputs.py.
    llama = tiny.config_for("llama")
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    for dtype in (f32, f16, bf16):
        checks.check_model_inputs(llama, None, {"inputs_embeds": torch.zeros(2, 3, 32, dtype=dtype)}, dtype=f32)
    for given, model in ((torch.float64, f32), (f32, bf16), (f16, bf16)):
        with pytest.raises(InputError, match=rf"inputs_embeds has dtype {given}, but the model computes in {model} "
                                             rf"\(transformers raises too.*pass inputs_embeds\.to\({model}\)"):
            checks.check_model_inputs(llama, None, {"inputs_embeds": torch.zeros(2, 3, 32, dtype=given)}, dtype=model)
