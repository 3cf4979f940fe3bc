"""Per-family forward glue: the few lines that run HF's own modules for one stage.

A stage holds some of a model's modules (embeddings, a run of blocks, final norm, head) under their
original names. The glue calls them in the order the HF model's ``forward`` would, building the
attention masks with transformers' own ``masking_utils`` and the position embeddings with the
model's own rotary module, so numerics equal the unsplit model. A whole block is the HF block
itself; only where a stage boundary cuts a block between its attention and MLP halves does the
glue repeat the few lines of that block's ``forward`` for each half (``block_half``; the tests check
that both halves in a row equal the block).

:mod:`.decoder` runs any standard transformers decoder through the model class's own forward
(the generic ``decoder.toml`` recipe); one module per hand-written family: :mod:`.llama` (LLaMA,
Mistral, Qwen2, whose blocks may be cut in halves), :mod:`.gpt2`, :mod:`.bert`, :mod:`.t5`;
:mod:`.base` holds what they share (the head, the single-stack loop, positions).

A glue sees ``received`` (the tensors sent by the previous stage, see the recipe's ``flows``) and
``inputs`` (the model inputs, which every stage of a pipelined call gets: ids, masks, position
ids, labels; and, when generating, a per-stage ``cache``). It returns a tensor or a tuple of
tensors: the next stage's ``received``, or the head outputs on the last stage.

Note: glue names are looked up from recipes (``glue = "llama"``), never from ``model_type``.

Example:
    >>> glue = get_glue("llama")
    >>> out = glue.forward(stage, received, inputs)   # (B, T, H) hidden states, or the head's outputs
"""

from __future__ import annotations

from .base import POOLS, Glue
from .bert import BertGlue
from .decoder import DecoderGlue
from .gpt2 import GPT2Glue
from .llama import LlamaGlue, attention_kinds
from .t5 import T5Glue

__all__ = [
    "GLUES", "POOLS", "BertGlue", "DecoderGlue", "GPT2Glue", "Glue", "LlamaGlue", "T5Glue", "attention_kinds",
    "get_glue",
]

# The glues recipes may name (``glue = "llama"``): the generic decoder's, and one per hand-written family.
GLUES: dict[str, type[Glue]] = {
    "decoder": DecoderGlue, "llama": LlamaGlue, "gpt2": GPT2Glue, "bert": BertGlue, "t5": T5Glue,
}


def get_glue(name: str) -> Glue:
    """A new glue of the family a recipe names (a key of :data:`GLUES`)."""
    return GLUES[name]()
