"""BERT glue: embeddings, bidirectional encoder layers, then pooler / MLM head / classifier."""

from __future__ import annotations

from transformers.masking_utils import create_bidirectional_mask
from transformers.pytorch_utils import apply_chunking_to_forward

from .base import SingleStackGlue

__all__ = ["BertGlue"]


class BertGlue(SingleStackGlue):
    """BERT: embeddings, bidirectional encoder layers, then pooler / MLM head / classifier."""

    def embed(self, stage, inputs):
        return stage.embeds[0](
            input_ids=inputs.get("input_ids"), token_type_ids=inputs.get("token_type_ids"),
            position_ids=inputs.get("position_ids"), inputs_embeds=inputs.get("inputs_embeds"),
        )

    def context(self, stage, hidden, inputs):
        mask = create_bidirectional_mask(
            config=stage.config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask")
        )  # (B, 1, T, T), or None where transformers needs no mask
        return {"attention_mask": mask}

    def block(self, layer, hidden, ctx):
        return layer(hidden, ctx["attention_mask"])

    def block_half(self, layer, half, hidden, ctx):
        if half == 0:
            return layer.attention(hidden, ctx["attention_mask"])[0]
        return apply_chunking_to_forward(
            layer.feed_forward_chunk, layer.chunk_size_feed_forward, layer.seq_len_dim, hidden
        )  # (B, T, H)
