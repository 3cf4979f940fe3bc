"""KV-cache sizes from a config alone: per token, per layer kind (full or sliding-window), per stage.

Pure config arithmetic, so it lives with planning: the memory planner
(:func:`hf_pipeline.memory.planner.plan_report`) and the serving engine's KV budget both read it. The
sizes follow transformers' own ``DynamicCache`` layers built from the config (no weights, no
forward pass).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import DynamicCache

__all__ = ["config_attr", "kv_cache_bytes", "kv_cache_bytes_per_token", "kv_cache_tokens"]


def config_attr(config, *names: str, default=None):
    """The first of ``names`` the config sets (not None), else ``default``: one field under its names per family."""
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _kv_bytes_per_layer_token(config, dtype: torch.dtype) -> int:
    # 2 (K and V) x KV heads x head dim x itemsize: one token of one layer's self-attention cache
    heads = int(config_attr(config, "num_attention_heads", "n_head", "num_heads"))
    kv_heads = int(config_attr(config, "num_key_value_heads", default=heads) or heads)
    hidden = int(config_attr(config, "hidden_size", "n_embd", "d_model"))
    head_dim = int(config_attr(config, "head_dim", "d_kv", default=hidden // heads) or hidden // heads)
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes_per_token(config, *, decoder_layers: int, dtype: torch.dtype) -> int:
    """KV-cache bytes one sequence adds per token over ``decoder_layers`` attention layers.

    2 (K and V) x KV heads x head dim x itemsize per layer; encoder-decoder models also cache the
    cross-attention K/V, counted here per encoder token with the encoder as long as the decoder.
    Sliding-window layers add this only until the sequence fills their window (:func:`kv_cache_bytes`).
    """
    per_layer = _kv_bytes_per_layer_token(config, dtype)
    if getattr(config, "is_encoder_decoder", False):
        per_layer *= 2  # self-attention cache + cross-attention cache
    return decoder_layers * per_layer


def kv_cache_tokens(config, *, seq: int) -> tuple[int, ...]:
    """Tokens each decoder layer's KV cache keeps allocated for one sequence of ``seq`` tokens, by layer index.

    Read from the cache transformers' ``generate`` (and the pipelined one) builds,
    ``DynamicCache(config=...)``: a full-attention layer (``DynamicLayer``) keeps every token; a
    sliding-window or chunked layer (``DynamicSlidingWindowLayer``) keeps ``min(seq, sliding_window)``.
    Note: its ``keys`` / ``values`` are views of the last ``sliding_window - 1`` positions of the
    past concatenated with the new token, so ``numel()`` shows one token less than the
    ``sliding_window`` tokens that stay allocated (and, right after a prefill longer than the window,
    the storage is the whole prompt's until the layer's next step).

    Example:
        >>> kv_cache_tokens(MistralConfig(num_hidden_layers=2, sliding_window=5), seq=12)
        (5, 5)
    """
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    return tuple(
        min(seq, int(layer.sliding_window)) if getattr(layer, "is_sliding", False) else seq for layer in cache.layers
    )


def kv_cache_bytes(config, *, layers: Sequence[int], dtype: torch.dtype, batch: int, seq: int) -> int:
    """KV-cache bytes the decoder layers ``layers`` (indices in the decoder stack) hold for ``batch`` x ``seq`` tokens.

    Each layer holds :func:`kv_cache_tokens` tokens of its self-attention keys and values; an
    encoder-decoder's layers also hold the cross-attention cache of ``seq`` encoder tokens.

    Example:
        >>> kv_cache_bytes(config, layers=range(config.num_hidden_layers), dtype=torch.bfloat16, batch=8, seq=4096)
    """
    per_token = _kv_bytes_per_layer_token(config, dtype)
    tokens = kv_cache_tokens(config, seq=seq)
    held = sum(tokens[i] for i in layers)
    if getattr(config, "is_encoder_decoder", False):
        held += seq * len(layers)  # cross-attention: every encoder token, never windowed
    return batch * per_token * held
