"""Tier 1: generate's length checks, before any request is built (a stand-in model, no processes)."""

from __future__ import annotations

import types

import pytest
import torch
import transformers

from hf_pipeline.errors import InputError
from hf_pipeline.generation.generate import generate


def test_encoder_input_beyond_a_learned_position_table_is_refused_before_the_request():
    # BART's encoder embeds positions from a learned table (no recipe: "learned"), as GPT-2 does.
    config = transformers.BartConfig(
        vocab_size=96, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
    )
    model = types.SimpleNamespace(config=config, check_inputs=False)
    with pytest.raises(InputError, match=r"^the encoder input has 20 tokens, more than the model's maximum of 16 "
                                         r"positions \(config\.max_position_embeddings\); truncate the input to at "
                                         r"most 16 tokens$"):
        generate(model, torch.ones(2, 20, dtype=torch.long), max_new_tokens=2)
