"""GPT-2 glue: token + learned position embeddings, pre-LN blocks, final LayerNorm."""

from __future__ import annotations

from transformers.masking_utils import create_causal_mask

from .base import SingleStackGlue, first_attention_layer, past_length, positions

__all__ = ["GPT2Glue"]


class GPT2Glue(SingleStackGlue):
    """GPT-2: token + learned position embeddings, pre-LN blocks, final LayerNorm."""

    packs_rows = True  # an op's rows packed in one sequence (continuous_batching/packed_op.py)

    def embed(self, stage, inputs):
        wte, wpe, drop = stage.embeds
        hidden = inputs.get("inputs_embeds")
        if hidden is None:
            hidden = wte(inputs["input_ids"])
        pos = positions(hidden, inputs, past_length(stage, inputs))
        hidden = hidden + wpe(pos)
        if inputs.get("token_type_ids") is not None:
            hidden = hidden + wte(inputs["token_type_ids"])
        return drop(hidden)

    def context(self, stage, hidden, inputs):
        cache = inputs.get("cache")
        pos = positions(hidden, inputs, past_length(stage, inputs))
        mask = inputs.get("attention_mask")
        if mask is not None and mask.ndim < 4:
            mask = mask.view(hidden.shape[0], -1)
        mask = create_causal_mask(
            config=stage.config, inputs_embeds=hidden, attention_mask=mask, cache=cache, position_ids=pos,
            layer_idx=first_attention_layer(stage) if cache is not None else None,
        )
        return {"cache": cache, "attention_mask": mask, "use_cache": cache is not None, "position_ids": pos}

    def block(self, layer, hidden, ctx):
        return layer(
            hidden, ctx["cache"], ctx["attention_mask"], None,
            use_cache=ctx["use_cache"], position_ids=ctx["position_ids"],
        )  # (B, T, H)

    def block_half(self, layer, half, hidden, ctx):
        residual = hidden
        if half == 0:
            out, _ = layer.attn(
                layer.ln_1(hidden), cache=ctx["cache"], attention_mask=ctx["attention_mask"],
                use_cache=ctx["use_cache"], position_ids=ctx["position_ids"],
            )
            return out + residual
        return residual + layer.mlp(layer.ln_2(hidden))
