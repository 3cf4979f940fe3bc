"""Per-family forward glue: the few lines that run HF's own modules for one stage.

A stage holds some of a model's modules (embeddings, a run of blocks, final norm, head) under their
original names. The glue calls them in the order the HF model's ``forward`` would, building the
attention masks with transformers' own ``masking_utils`` and the position embeddings with the
model's own rotary module, so numerics equal the unsplit model. A whole block is the HF block
itself; only where a stage boundary cuts a block between its attention and MLP halves does the
glue repeat the few lines of that block's ``forward`` for each half (``block_half``; the tests check
that both halves in a row equal the block).

A glue sees ``received`` (the tensors sent by the previous stage, see the recipe's ``flows``) and
``inputs`` (the model inputs, which every stage of a pipelined call gets: ids, masks, position
ids, labels; and, when generating, a per-stage ``cache``). It returns a tensor or a tuple of
tensors: the next stage's ``received``, or the head outputs on the last stage.

Note: glue names are looked up from recipes (``glue = "llama"``), never from ``model_type``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask, create_sliding_window_causal_mask
from transformers.pytorch_utils import apply_chunking_to_forward

__all__ = ["GLUES", "POOLS", "Glue", "attention_kinds", "get_glue"]


def _layer_index(fqn: str) -> int:
    return int(fqn.rpartition(".")[2])


class Glue:
    """Base: embed on the first stage, run the owned blocks, finish and apply the head on the last."""

    # Whether the glue can run half a block (a stage boundary between attention and MLP); a
    # recipe may declare block halves only for such a glue.
    runs_halves: bool = False

    def check(self, stage: Any) -> None:
        """Refuse, when the stage is built, a model whose forward this glue cannot reproduce (default: none)."""

    def prepare_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Whole-batch input preprocessing done once, on every rank, before microbatching."""
        return inputs

    def forward(self, stage: Any, received: tuple[torch.Tensor, ...], inputs: dict[str, Any]):
        raise NotImplementedError

    # Head application shared by the families: ``hidden`` after the final norm of the last stack.
    def head(self, stage: Any, hidden: torch.Tensor, inputs: dict[str, Any]):
        head = stage.resolved.head
        mods = [stage.get_submodule(m) for m in head.modules]
        if head.suffix.endswith("Model") and head.suffix == "Model":
            outs = [hidden] + [m(hidden) for m in mods]  # e.g. BertModel: (last_hidden_state, pooler_output)
            return tuple(outs) if len(outs) > 1 else hidden
        keep = inputs.get("logits_to_keep")
        if head.pool is None and keep:
            hidden = hidden[:, -int(keep) :, :]  # generation only needs the last position's logits
        out = hidden
        for m in mods:
            out = m(out)
        if head.pool == "last_token":
            out = _pool_last_token(out, inputs, stage.config)
        if head.split_last_dim:
            # As transformers' QA heads: (B, T, n) -> n x (B, T), e.g. start_logits, end_logits
            return tuple(t.squeeze(-1).contiguous() for t in out.split(1, dim=-1))
        return out


# How a head reduces the sequence, as recipes name it: "last_token" here (below); "pooler" is the
# head's own pooler module (BERT), run as one of its modules.
POOLS = ("last_token", "pooler")


def _pool_last_token(logits: torch.Tensor, inputs: dict[str, Any], config) -> torch.Tensor:
    # As transformers' GenericForSequenceClassification: the rightmost token that is not padding.
    ids = inputs.get("input_ids")
    batch = logits.shape[0]
    if ids is None or config.pad_token_id is None:
        last = torch.full((batch,), -1, device=logits.device, dtype=torch.long)
    else:
        non_pad = (ids != config.pad_token_id).to(logits.device, torch.int32)
        positions = torch.arange(ids.shape[-1], device=logits.device, dtype=torch.int32)
        last = (positions * non_pad).argmax(-1)
    return logits[torch.arange(batch, device=logits.device), last]


class _SingleStack(Glue):
    runs_halves = True  # block_half: the block's own forward split at its residual boundary
    """Decoder-only and encoder-only models: one stack, ``hidden_states`` flows between stages."""

    def embed(self, stage, inputs):
        raise NotImplementedError

    def context(self, stage, hidden, inputs) -> dict[str, Any]:
        raise NotImplementedError

    def block(self, layer, hidden, ctx):
        raise NotImplementedError

    def layer_context(self, ctx: dict[str, Any], fqn: str) -> dict[str, Any]:
        """The context block ``fqn`` runs with (default: the stage's, the same for every block)."""
        return ctx

    def block_half(self, layer, half: int, hidden, ctx):
        """Half of ``layer``'s forward (0: attention with its residual, 1: MLP with its residual).

        These are the lines of the HF block's own ``forward``, split where the recipe's ``halves``
        cut it; ``tests/test_stages.py`` checks that both halves in a row equal the block.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot run half a block")

    def forward(self, stage, received, inputs):
        choices = None
        if stage.resolved.head.choices:
            inputs, choices = _flatten_choices(inputs)
        if stage.spec.is_first:
            hidden = self.embed(stage, inputs)  # (B, T, H); (B * C, T, H) for a multiple-choice head
        else:
            (hidden,) = received
        # A stage that runs only the MLP half of a block needs no mask, positions or cache.
        ctx = self.context(stage, hidden, inputs) if stage.attention_blocks else {}
        for (fqn, layer), half in zip(stage.blocks, stage.block_halves):
            if half is None:
                hidden = self.block(layer, hidden, self.layer_context(ctx, fqn))
            else:  # only the attention half needs the layer's own context (its mask)
                hidden = self.block_half(layer, half, hidden, self.layer_context(ctx, fqn) if half == 0 else ctx)
        for m in stage.finals:
            hidden = m(hidden)
        if stage.spec.is_last:
            out = self.head(stage, hidden, inputs)
            return out if choices is None else out.view(-1, choices)  # (B * C, 1) -> (B, C)
        return hidden


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
            flat[k] = v.reshape(-1, *v.shape[v.dim() - keep :])
    return flat, choices


def _positions(hidden: torch.Tensor, inputs: dict[str, Any], past: int) -> torch.Tensor:
    pos = inputs.get("position_ids")
    if pos is None:
        pos = (torch.arange(hidden.shape[1], device=hidden.device) + past).unsqueeze(0)  # (1, T)
    return pos


def _first_attention_layer(stage) -> int:
    # A stage that starts with the MLP half of a block does not hold that block's KV cache.
    return _layer_index(stage.attention_blocks[0])


def _past_length(stage, inputs) -> int:
    cache = inputs.get("cache")
    if cache is None or not stage.attention_blocks:
        return 0
    return cache.get_seq_length(_first_attention_layer(stage))


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


class LlamaGlue(_SingleStack):
    """LLaMA / Mistral / Qwen2: embed_tokens, decoder layers with rotary embeddings, RMSNorm.

    Note (per-layer masks): each layer gets the mask of its own attention kind (:func:`attention_kinds`,
    by global layer index), one mask per kind present in the stage. With a KV cache each mask is sized
    against the stage's first layer of that kind: a sliding layer's cache keeps only the last
    ``sliding_window - 1`` positions (transformers' ``DynamicCache(config=...)`` builds it so), a full
    layer's keeps them all, so their key lengths differ once the sequence passes the window.
    """

    def check(self, stage):
        config = stage.config.get_text_config(decoder=True)
        name = type(config).__name__
        kinds = attention_kinds(config)
        unknown = sorted({k for k in kinds if k not in _LLAMA_MASKS})
        if unknown:
            raise ValueError(
                f"{name}: config.layer_types has attention kind(s) {unknown}, which LLaMA-family decoder layers do not "
                f"implement (supported: {sorted(_LLAMA_MASKS)}); use layer types this model class supports"
            )
        sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
        if sliding and getattr(config, "sliding_window", None) is None:
            raise ValueError(
                f"{name}: config.layer_types makes layers {sliding} 'sliding_attention' but config.sliding_window is None "
                f"(Qwen2: use_sliding_window=False); set sliding_window (and use_sliding_window=True) or make them 'full_attention'"
            )
        cache_kinds = tuple(get_layer_types_and_kwargs(config)[0])
        if cache_kinds != kinds:
            raise ValueError(
                f"{name}: the KV cache transformers builds from this config has layer kinds {list(cache_kinds)} but the "
                f"masks would be {list(kinds)}; pipelined generation needs them to agree"
            )
        # transformers' attention classes that follow config.layer_types record their layer's kind
        # (Qwen2Attention.layer_type); the others' models build one mask for every layer (MistralModel,
        # LlamaModel), so per-layer kinds in config.layer_types would not be what the model itself computes.
        uniform = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
        for fqn, layer in stage.blocks:
            i = _layer_index(fqn)
            attn = getattr(layer, "self_attn", None)
            own = getattr(attn, "layer_type", None) if attn is not None else None
            if attn is not None and own is None and kinds[i] != uniform:
                raise ValueError(
                    f"{name}: config.layer_types makes layer {i} {kinds[i]!r}, but {type(attn).__name__} does not follow "
                    f"config.layer_types (its model builds one mask kind for every layer) while the KV cache built from the "
                    f"config would; remove layer_types from the config or use a model class with per-layer attention kinds"
                )
            if own is not None and own != kinds[i]:
                raise ValueError(f"{name}: layer {i} was built as {own!r} but config.layer_types says {kinds[i]!r}")

    def embed(self, stage, inputs):
        if inputs.get("inputs_embeds") is not None:
            return inputs["inputs_embeds"]
        return stage.embeds[0](inputs["input_ids"])

    def context(self, stage, hidden, inputs):
        cache = inputs.get("cache")
        pos = _positions(hidden, inputs, _past_length(stage, inputs))
        kinds = attention_kinds(stage.config)
        first: dict[str, int] = {}  # attention kind -> the stage's first layer of that kind
        for fqn in stage.attention_blocks:
            first.setdefault(kinds[_layer_index(fqn)], _layer_index(fqn))
        masks = {
            kind: _LLAMA_MASKS[kind](
                config=stage.config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask"),
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
        mask = ctx["masks"][ctx["kinds"][_layer_index(fqn)]]
        return {k: v for k, v in ctx.items() if k not in ("masks", "kinds")} | {"attention_mask": mask}

    def block(self, layer, hidden, ctx):
        return layer(hidden, **ctx)

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
        return residual + hidden


class GPT2Glue(_SingleStack):
    """GPT-2: token + learned position embeddings, pre-LN blocks, final LayerNorm."""

    def embed(self, stage, inputs):
        wte, wpe, drop = stage.embeds
        hidden = inputs.get("inputs_embeds")
        if hidden is None:
            hidden = wte(inputs["input_ids"])
        pos = _positions(hidden, inputs, _past_length(stage, inputs))
        hidden = hidden + wpe(pos)
        if inputs.get("token_type_ids") is not None:
            hidden = hidden + wte(inputs["token_type_ids"])
        return drop(hidden)

    def context(self, stage, hidden, inputs):
        cache = inputs.get("cache")
        pos = _positions(hidden, inputs, _past_length(stage, inputs))
        mask = inputs.get("attention_mask")
        if mask is not None and mask.ndim < 4:
            mask = mask.view(hidden.shape[0], -1)
        mask = create_causal_mask(
            config=stage.config, inputs_embeds=hidden, attention_mask=mask, cache=cache, position_ids=pos,
            layer_idx=_first_attention_layer(stage) if cache is not None else None,
        )
        return {"cache": cache, "attention_mask": mask, "use_cache": cache is not None, "position_ids": pos}

    def block(self, layer, hidden, ctx):
        return layer(hidden, ctx["cache"], ctx["attention_mask"], None, use_cache=ctx["use_cache"], position_ids=ctx["position_ids"])

    def block_half(self, layer, half, hidden, ctx):
        residual = hidden
        if half == 0:
            out, _ = layer.attn(
                layer.ln_1(hidden), cache=ctx["cache"], attention_mask=ctx["attention_mask"], use_cache=ctx["use_cache"],
                position_ids=ctx["position_ids"],
            )
            return out + residual
        return residual + layer.mlp(layer.ln_2(hidden))


class BertGlue(_SingleStack):
    """BERT: embeddings, bidirectional encoder layers, then pooler / MLM head / classifier."""

    def embed(self, stage, inputs):
        return stage.embeds[0](
            input_ids=inputs.get("input_ids"), token_type_ids=inputs.get("token_type_ids"),
            position_ids=inputs.get("position_ids"), inputs_embeds=inputs.get("inputs_embeds"),
        )

    def context(self, stage, hidden, inputs):
        mask = create_bidirectional_mask(config=stage.config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask"))
        return {"attention_mask": mask}

    def block(self, layer, hidden, ctx):
        return layer(hidden, ctx["attention_mask"])

    def block_half(self, layer, half, hidden, ctx):
        if half == 0:
            return layer.attention(hidden, ctx["attention_mask"])[0]
        return apply_chunking_to_forward(layer.feed_forward_chunk, layer.chunk_size_feed_forward, layer.seq_len_dim, hidden)


class T5Glue(Glue):
    """T5: encoder stages then decoder stages; the encoder output travels with the decoder state.

    What a stage receives and sends depends on where it sits:
      inside the encoder            (enc_hidden,)            -> (enc_hidden,)
      ending the encoder            ...                      -> (encoder_output,)
      starting the decoder          (encoder_output,)        -> (dec_hidden, encoder_output)
      inside the decoder            (dec_hidden, encoder_output)
    Block 0 of each stack owns the relative position bias; a stage starting mid-stack recomputes
    the bias from its replica of block 0's bias embedding (the recipe's ``every_stage``).
    """

    def prepare_inputs(self, model, inputs):
        if inputs.get("labels") is not None and inputs.get("decoder_input_ids") is None and inputs.get("decoder_inputs_embeds") is None:
            inputs = dict(inputs, decoder_input_ids=model._shift_right(inputs["labels"]))
        return inputs

    def forward(self, stage, received, inputs):
        received = list(received)
        enc_out = None
        cache = inputs.get("cache")
        if inputs.get("encoder_outputs") is not None:
            enc_out = inputs["encoder_outputs"]  # generation: the encoder ran once, its output is given
        hidden = None
        for stack in stage.stack_runs:
            is_decoder = stack.name == "decoder"
            if not is_decoder and inputs.get("encoder_outputs") is not None:
                continue  # generation: the encoder already ran once for this request
            if is_decoder and inputs.get("decoder_input_ids") is None and inputs.get("encoder_outputs") is None:
                return enc_out  # an encoder-only pass (generation encodes once, then decodes step by step)
            if stack.starts:
                if is_decoder:
                    if enc_out is None:
                        enc_out = received.pop(0)
                    hidden = stack.embed(inputs["decoder_input_ids"])
                else:
                    hidden = stack.embed(inputs["input_ids"])
                hidden = stack.dropout(hidden)
            else:
                hidden = received.pop(0)
                if is_decoder and enc_out is None:
                    enc_out = received.pop(0)
            hidden = self._run_stack(stage, stack, hidden, enc_out if is_decoder else None, inputs, cache if is_decoder else None)
            if stack.ends:
                for m in stack.finals:
                    hidden = m(hidden)
                hidden = stack.dropout(hidden)
                if not is_decoder:
                    enc_out, hidden = hidden, None
        if stage.spec.is_last:
            if hidden is None:
                return self.head(stage, enc_out, inputs)  # a model of the encoder alone (T5EncoderModel)
            if stage.config.scale_decoder_outputs:
                hidden = hidden * (stage.config.d_model**-0.5)
            return self.head(stage, hidden, inputs)
        if hidden is None:
            return enc_out  # this stage ended the encoder: the decoder starts next
        if enc_out is None:
            return hidden  # still inside the encoder
        return hidden, enc_out

    def _run_stack(self, stage, stack, hidden, enc_out, inputs, cache):
        config = stack.config
        if config.is_decoder:
            self_cache = cache.self_attention_cache if cache is not None else None
            first = _layer_index(stack.blocks[0])
            past = self_cache.get_seq_length(first) if self_cache is not None else 0
            mask = create_causal_mask(
                config=config, inputs_embeds=hidden, attention_mask=inputs.get("decoder_attention_mask"),
                cache=self_cache, layer_idx=first if self_cache is not None else None,
            )
            enc_mask = create_bidirectional_mask(
                config=config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask"), encoder_hidden_states=enc_out
            )
        else:
            past = 0
            mask = create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask"))
            enc_mask = None
        position_bias = None
        if not stack.starts:
            q = hidden.shape[1]
            # the replica is block 0's bias embedding; its parent attention module knows the bucketing
            bias_module = stage.get_submodule(stack.replicas[0].rpartition(".")[0])
            position_bias = bias_module.compute_bias(q, past + q, device=hidden.device, past_seen_tokens=past)
        enc_position_bias = None
        for block in stack.modules:
            hidden, position_bias, cross_bias = block(
                hidden, mask, position_bias, enc_out, enc_mask, enc_position_bias, cache=cache
            )
            if config.is_decoder:
                enc_position_bias = cross_bias
        return hidden


GLUES: dict[str, type[Glue]] = {"llama": LlamaGlue, "gpt2": GPT2Glue, "bert": BertGlue, "t5": T5Glue}


def get_glue(name: str) -> Glue:
    return GLUES[name]()
