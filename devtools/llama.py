"""The random LLaMA configuration the benchmark, the device check and the default-model maker build from."""

from __future__ import annotations

from typing import Any

__all__ = ["llama_config"]


def llama_config(
    *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, max_pos: int, dtype: str,
    **overrides: Any,
):
    """A ``transformers.LlamaConfig`` of this shape with an untied LM head (pad id 0, bos id 1, no eos).

    Args:
        hidden, intermediate, layers, heads, kv_heads, vocab, max_pos: the shape.
        dtype: the weights' dtype name, e.g. ``"bfloat16"``.
        **overrides: any other ``LlamaConfig`` field (e.g. a tokenizer's special token ids).
    """
    import transformers

    fields = dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=max_pos, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=None, dtype=dtype,
    )
    return transformers.LlamaConfig(**{**fields, **overrides})
