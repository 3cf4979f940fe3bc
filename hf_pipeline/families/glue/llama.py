"""LLaMA-family glue (LLaMA, Mistral, Qwen2): rotary positions, one mask per attention kind, RMSNorm.

Example:
    >>> attention_kinds(MistralConfig(num_hidden_layers=2, sliding_window=4096))
    ('sliding_attention', 'sliding_attention')
"""

from __future__ import annotations

from typing import Callable

from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ...errors import InputError
from .base import SingleStackGlue, layer_index, past_length, positions

__all__ = ["LlamaGlue", "attention_kinds"]

# The attention kinds the LLaMA family's decoder layers implement, each with the transformers mask function
# its model's own forward builds for it (LlamaModel: full; MistralModel: sliding when ``sliding_window`` is
# set; Qwen2Model: one mask per kind in ``config.layer_types``).
_LLAMA_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def attention_kinds(config) -> tuple[str, ...]:
    """Each decoder layer's attention kind, by global layer index, as transformers chooses its mask.

    As ``transformers.masking_utils.create_masks_for_generate`` (which mirrors the modeling files):
    ``config.layer_types`` when the config has it (Qwen2: from ``use_sliding_window`` and
    ``max_window_layers``), else one kind for every layer: ``"sliding_attention"`` when
    ``config.sliding_window`` is set (Mistral), ``"full_attention"`` otherwise (LLaMA).

    Example:
        >>> attention_kinds(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1))
        ('full_attention', 'sliding_attention', 'sliding_attention')
    """
    text = config.get_text_config(decoder=True)
    kinds = getattr(text, "layer_types", None)
    if kinds is not None:
        return tuple(kinds)
    kind = "sliding_attention" if getattr(text, "sliding_window", None) is not None else "full_attention"
    return (kind,) * text.num_hidden_layers


# ----------------------------------------------------------------------------- refusals at load
# Each returns why the glue cannot compute what the HF model computes for this config, or None.
def _unknown_kinds(name: str, config, kinds: tuple[str, ...], blocks) -> str | None:
    unknown = sorted({k for k in kinds if k not in _LLAMA_MASKS})
    if not unknown:
        return None
    return (
        f"{name}: config.layer_types has attention kind(s) {unknown}, which LLaMA-family decoder layers do not "
        f"implement (supported: {sorted(_LLAMA_MASKS)}); use layer types this model class supports"
    )


def _sliding_without_window(name: str, config, kinds: tuple[str, ...], blocks) -> str | None:
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    if not sliding or getattr(config, "sliding_window", None) is not None:
        return None
    return (
        f"{name}: config.layer_types makes layers {sliding} 'sliding_attention' but config.sliding_window is None "
        f"(Qwen2: use_sliding_window=False); set sliding_window (and use_sliding_window=True) or make them "
        f"'full_attention'"
    )


def _cache_disagrees(name: str, config, kinds: tuple[str, ...], blocks) -> str | None:
    cache_kinds = tuple(get_layer_types_and_kwargs(config)[0])
    if cache_kinds == kinds:
        return None
    return (
        f"{name}: the KV cache transformers builds from this config has layer kinds {list(cache_kinds)} but the "
        f"masks would be {list(kinds)}; pipelined generation needs them to agree"
    )


def _layers_disagree(name: str, config, kinds: tuple[str, ...], blocks) -> str | None:
    # transformers' attention classes that follow config.layer_types record their layer's kind
    # (Qwen2Attention.layer_type); the others' models build one mask for every layer (MistralModel,
    # LlamaModel), so per-layer kinds in config.layer_types would not be what the model itself computes.
    uniform = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    for fqn, layer in blocks:
        i = layer_index(fqn)
        attn = getattr(layer, "self_attn", None)
        own = getattr(attn, "layer_type", None) if attn is not None else None
        if attn is not None and own is None and kinds[i] != uniform:
            return (
                f"{name}: config.layer_types makes layer {i} {kinds[i]!r}, but {type(attn).__name__} does not follow "
                f"config.layer_types (its model builds one mask kind for every layer) while the KV cache built from "
                f"the config would; remove layer_types from the config or use a model class with per-layer "
                f"attention kinds"
            )
        if own is not None and own != kinds[i]:
            return f"{name}: layer {i} was built as {own!r} but config.layer_types says {kinds[i]!r}"
    return None


# In order: the first that applies is the one raised.
_REFUSALS: tuple[Callable[..., str | None], ...] = (
    _unknown_kinds, _sliding_without_window, _cache_disagrees, _layers_disagree,
)


class LlamaGlue(SingleStackGlue):
    """LLaMA / Mistral / Qwen2: embed_tokens, decoder layers with rotary embeddings, RMSNorm.

    Note (per-layer masks): each layer gets the mask of its own attention kind (:func:`attention_kinds`,
    by global layer index), one mask per kind present in the stage. With a KV cache each mask is sized
    against the stage's first layer of that kind: a sliding layer's cache keeps only the last
    ``sliding_window - 1`` positions (transformers' ``DynamicCache(config=...)`` builds it so), a full
    layer's keeps them all, so their key lengths differ once the sequence passes the window.
    """

    packs_rows = True

    def check(self, stage):
        config = stage.config.get_text_config(decoder=True)
        kinds = attention_kinds(config)
        for refusal in _REFUSALS:
            problem = refusal(type(config).__name__, config, kinds, stage.blocks)
            if problem is not None:
                raise InputError(problem)

    def embed(self, stage, inputs):
        if inputs.get("inputs_embeds") is not None:
            return inputs["inputs_embeds"]
        return stage.embeds[0](inputs["input_ids"])  # (B, T) -> (B, T, H)

    def context(self, stage, hidden, inputs):
        cache = inputs.get("cache")
        pos = positions(hidden, inputs, past_length(stage, inputs))
        kinds = attention_kinds(stage.config)
        first: dict[str, int] = {}  # attention kind -> the stage's first layer of that kind
        for fqn in stage.attention_blocks:
            first.setdefault(kinds[layer_index(fqn)], layer_index(fqn))
        given = inputs.get("attention_mask")
        # A mask per kind already made (a dict, as transformers' hybrid models take it: the continuous ring's packed
        # ops), else each kind's from the 2D mask.
        masks = {
            kind: given[kind] if isinstance(given, dict) else _LLAMA_MASKS[kind](
                config=stage.config, inputs_embeds=hidden, attention_mask=given,
                cache=cache, position_ids=pos, layer_idx=layer if cache is not None else None,
            )
            for kind, layer in first.items()
        }
        return {
            "masks": masks,
            "kinds": kinds,
            "position_ids": pos,
            "position_embeddings": stage.replicas[0](hidden, position_ids=pos),  # rotary (cos, sin)
            "cache": cache,
            "use_cache": cache is not None,
        }

    def layer_context(self, ctx, fqn):
        # What the HF decoder layer takes: the shared arguments and the mask of this layer's kind.
        mask = ctx["masks"][ctx["kinds"][layer_index(fqn)]]
        return {k: v for k, v in ctx.items() if k not in ("masks", "kinds")} | {"attention_mask": mask}

    def block(self, layer, hidden, ctx):
        return layer(hidden, **ctx)  # (B, T, H)

    def block_half(self, layer, half, hidden, ctx):
        residual = hidden
        if half == 0:
            hidden, _ = layer.self_attn(
                hidden_states=layer.input_layernorm(hidden), attention_mask=ctx["attention_mask"],
                position_ids=ctx["position_ids"], cache=ctx["cache"], use_cache=ctx["use_cache"],
                position_embeddings=ctx["position_embeddings"],
            )
        else:
            hidden = layer.mlp(layer.post_attention_layernorm(hidden))
        return residual + hidden  # (B, T, H)
