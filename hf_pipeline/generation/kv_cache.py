"""The per-stage KV caches of pipelined generation: built as transformers' generate builds them, measured.

Each rank keeps one cache per (local decode stage, microbatch); :func:`new_cache` makes it and
:func:`cache_nbytes` is what ``GenerationStats.peak_cache_bytes`` adds up.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from ..loading.compiled import CompiledStepCache

__all__ = ["cache_nbytes", "new_cache"]


def new_cache(config: Any, *, encoder_decoder: bool, stage: Any = None) -> DynamicCache | EncoderDecoderCache:
    """An empty cache for one (stage, microbatch), as transformers' generate makes it.

    A ``DynamicCache`` built from the (decoder) config, so layer indices are the model's own and each
    layer has its kind's cache (sliding-window layers keep only the window, as
    ``DynamicSlidingWindowLayer``); a stage only ever fills the layers it owns, and the glue sizes each
    layer's mask against the cache layer of its kind.

    Args:
        config: the model's config (its decoder's text config is used).
        encoder_decoder: an ``EncoderDecoderCache`` (self- and cross-attention) instead.
        stage: the stage the cache is for: one whose blocks are compiled (``stage.compiled_blocks``; traced stages
            have none) gets a decoder-only model's cache as a :class:`~hf_pipeline.loading.compiled.CompiledStepCache`,
            which its compiled blocks run with.
    """
    decoder_config = config.get_text_config(decoder=True)
    if encoder_decoder:
        return EncoderDecoderCache(DynamicCache(config=decoder_config), DynamicCache(config=decoder_config))
    compiled = getattr(stage, "compiled_blocks", 0) > 0
    return (CompiledStepCache if compiled else DynamicCache)(config=decoder_config)


def cache_nbytes(cache: Any) -> int:
    """Bytes allocated for the key/value tensors of a transformers ``Cache`` (EncoderDecoderCache: both parts).

    Storage bytes, each storage once, not ``numel``: a sliding-window layer keeps a view of the last
    ``window - 1`` positions into the ``window``-position tensor its update made, and the memory
    held is the whole tensor's.
    """
    if cache is None:
        return 0
    if isinstance(cache, EncoderDecoderCache):
        parts = (cache.self_attention_cache, cache.cross_attention_cache)
    else:
        parts = (cache,)
    seen: dict[int, int] = {}
    for part in parts:
        for layer in getattr(part, "layers", ()):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor) and t.numel():
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
