"""What the families' glues share: the :class:`Glue` interface, the head, the single-stack loop.

:class:`Glue` embeds on the first stage, runs the owned blocks and applies the head on the last;
:class:`SingleStackGlue` is that loop for decoder-only and encoder-only models (one stack,
``hidden_states`` flows between stages), each family filling in ``embed``, ``context``, ``block``
and ``block_half``. The small helpers (positions, cache length) are the ones the families'
forwards share.

Shapes: B batch rows, T positions, H hidden size, C choices of a multiple-choice head.
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import torch
from torch import nn

from ...compat import checkpointing_function
from ...errors import InternalError

__all__ = [
    "POOLS", "Glue", "SingleStackGlue", "first_attention_layer", "layer_index", "past_length", "positions",
]

# How a head reduces the sequence, as recipes name it: "last_token" here (below); "pooler" is the
# head's own pooler module (BERT), run as one of its modules.
POOLS = ("last_token", "pooler")


def layer_index(fqn: str) -> int:
    """The global index of a block from its FQN (``model.layers.7`` -> 7)."""
    return int(fqn.rpartition(".")[2])


class Glue:
    """Base: embed on the first stage, run the owned blocks, finish and apply the head on the last."""

    # Whether the glue can run half a block (a stage boundary between attention and MLP); a
    # recipe may declare block halves only for such a glue.
    runs_halves: bool = False
    # Whether a stage's forward can run ragged rows packed in one sequence (the continuous ring's packed ops,
    # continuous_batching/packed_op.py): transformers' layers given a 4D attention mask as it is, positions per
    # token, the cache's ``update`` called by every attention layer, and ``logits_to_keep`` as an index tensor.
    packs_rows: bool = False

    def check(self, stage: Any) -> None:
        """Refuse, when the stage is built, a model whose forward this glue cannot reproduce (default: none)."""

    def prepare_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Whole-batch input preprocessing done once, on every rank, before microbatching."""
        return inputs

    def forward(self, stage: Any, received: tuple[torch.Tensor, ...], inputs: dict[str, Any]):
        """One stage's forward: ``received`` from the previous stage -> what the next stage receives,
        or the head's outputs on the last stage."""
        # Not abstract: a glue that only prepares inputs (the traced stages' one) runs no stage forward.
        raise InternalError(f"{type(self).__name__} has no stage forward; a family's glue must define forward")

    # Head application shared by the families: ``hidden`` (B, T, H) after the final norm of the last stack.
    def head(self, stage: Any, hidden: torch.Tensor, inputs: dict[str, Any]):
        """The head modules of ``stage``'s model class applied to the final hidden states."""
        head = stage.resolved.head
        mods = [stage.get_submodule(m) for m in head.modules]
        if head.suffix.endswith("Model") and head.suffix == "Model":
            outs = [hidden] + [m(hidden) for m in mods]  # e.g. BertModel: (last_hidden_state, pooler_output)
            return tuple(outs) if len(outs) > 1 else hidden
        keep = inputs.get("logits_to_keep")
        if head.pool is None and isinstance(keep, torch.Tensor):
            hidden = hidden[:, keep, :]  # (B, len(keep), H): the positions asked for (transformers' index form)
        elif head.pool is None and keep:
            hidden = hidden[:, -int(keep) :, :]  # (B, keep, H): generation only needs the last position's logits
        out = hidden
        for m in mods:
            out = m(out)  # e.g. lm_head: (B, T, H) -> (B, T, V)
        if head.pool == "last_token":
            out = _pool_last_token(out, inputs, stage.config)  # (B, T, L) -> (B, L)
        if head.split_last_dim:
            # As transformers' QA heads: (B, T, n) -> n x (B, T), e.g. start_logits, end_logits
            return tuple(t.squeeze(-1).contiguous() for t in out.split(1, dim=-1))
        return out


def _pool_last_token(logits: torch.Tensor, inputs: dict[str, Any], config) -> torch.Tensor:
    # As transformers' GenericForSequenceClassification: the rightmost token that is not padding.
    ids = inputs.get("input_ids")  # (B, T)
    batch = logits.shape[0]
    if ids is None or config.pad_token_id is None:
        last = torch.full((batch,), -1, device=logits.device, dtype=torch.long)
    else:
        non_pad = (ids != config.pad_token_id).to(logits.device, torch.int32)
        positions = torch.arange(ids.shape[-1], device=logits.device, dtype=torch.int32)
        last = (positions * non_pad).argmax(-1)  # (B,)
    return logits[torch.arange(batch, device=logits.device), last]


class SingleStackGlue(Glue, abc.ABC):
    """Decoder-only and encoder-only models: one stack, ``hidden_states`` flows between stages."""

    runs_halves = True  # block_half: the block's own forward split at its residual boundary

    @abc.abstractmethod
    def embed(self, stage, inputs) -> torch.Tensor:
        """The first stage's hidden states from the inputs: (B, T, H)."""

    @abc.abstractmethod
    def context(self, stage, hidden, inputs) -> dict[str, Any]:
        """What the stage's blocks take besides the hidden states (masks, positions, cache)."""

    @abc.abstractmethod
    def block(self, layer, hidden, ctx) -> torch.Tensor:
        """One whole HF block: (B, T, H) -> (B, T, H)."""

    def layer_context(self, ctx: dict[str, Any], fqn: str) -> dict[str, Any]:
        """The context block ``fqn`` runs with (default: the stage's, the same for every block)."""
        return ctx

    @abc.abstractmethod
    def block_half(self, layer, half: int, hidden, ctx) -> torch.Tensor:
        """Half of ``layer``'s forward (0: attention with its residual, 1: MLP with its residual).

        These are the lines of the HF block's own ``forward``, split where the recipe's ``halves``
        cut it; ``tests/loading/test_stages.py`` checks that both halves in a row equal the block.
        """

    def _half(self, layer, half: int, hidden, ctx) -> torch.Tensor:
        # A checkpointed block (activation_checkpointing_enable) cut at a stage boundary: each half is
        # checkpointed on its own stage, through the function and under the condition transformers'
        # GradientCheckpointingLayer uses for the whole block (training mode, gradients on).
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            return checkpointing_function(layer)(functools.partial(self.block_half, layer, half, ctx=ctx), hidden)
        return self.block_half(layer, half, hidden, ctx)

    def forward(self, stage, received, inputs):
        choices = None
        if stage.resolved.head.choices:
            inputs, choices = _flatten_choices(inputs)
        if stage.spec.is_first:
            hidden = self.embed(stage, inputs)  # (B, T, H); (B * C, T, H) for a multiple-choice head
        else:
            (hidden,) = received  # (B, T, H)
        # A stage that runs only the MLP half of a block needs no mask, positions or cache.
        ctx = self.context(stage, hidden, inputs) if stage.attention_blocks else {}
        for (fqn, layer), half in zip(stage.blocks, stage.block_halves):
            if half is None:
                hidden = self.block(layer, hidden, self.layer_context(ctx, fqn))  # (B, T, H)
            else:  # only the attention half needs the layer's own context (its mask)
                hidden = self._half(layer, half, hidden, self.layer_context(ctx, fqn) if half == 0 else ctx)
        for m in stage.finals:
            hidden = m(hidden)  # final norm: (B, T, H)
        if stage.spec.is_last:
            out = self.head(stage, hidden, inputs)
            return out if choices is None else out.view(-1, choices)  # (B * C, 1) -> (B, C)
        return hidden  # (B, T, H) to the next stage


# The inputs a multiple-choice head takes as (B, C, T) (inputs_embeds: (B, C, T, H)), as
# transformers' ForMultipleChoice forwards flatten them before the base model.
_CHOICE_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")


def _flatten_choices(inputs: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``inputs`` with the choices folded into the batch, and the number of choices C."""
    ref = inputs.get("input_ids")
    choices = ref.shape[1] if ref is not None else inputs["inputs_embeds"].shape[1]
    flat = dict(inputs)
    for k in _CHOICE_INPUTS:
        v = inputs.get(k)
        if isinstance(v, torch.Tensor):
            keep = 2 if k == "inputs_embeds" else 1  # (T,) or (T, H) per row
            flat[k] = v.reshape(-1, *v.shape[v.dim() - keep :])  # (B, C, T) -> (B * C, T)
    return flat, choices


def positions(hidden: torch.Tensor, inputs: dict[str, Any], past: int) -> torch.Tensor:
    """The position ids of ``hidden`` (B, T, H): the given ones, else ``past .. past + T - 1`` as (1, T)."""
    pos = inputs.get("position_ids")
    if pos is None:
        pos = (torch.arange(hidden.shape[1], device=hidden.device) + past).unsqueeze(0)  # (1, T)
    return pos


def first_attention_layer(stage) -> int:
    """The global index of the stage's first block that runs attention."""
    # A stage that starts with the MLP half of a block does not hold that block's KV cache.
    return layer_index(stage.attention_blocks[0])


def past_length(stage, inputs) -> int:
    """Positions already in the stage's KV cache (0 without a cache)."""
    cache = inputs.get("cache")
    if cache is None or not stage.attention_blocks:
        return 0
    return cache.get_seq_length(first_attention_layer(stage))
