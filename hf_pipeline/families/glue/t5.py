"""T5 glue: encoder stages then decoder stages; the encoder output travels with the decoder state."""

from __future__ import annotations

from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

from ...compat import shift_right
from .base import Glue, layer_index

__all__ = ["T5Glue"]


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
        if (
            inputs.get("labels") is not None and inputs.get("decoder_input_ids") is None
            and inputs.get("decoder_inputs_embeds") is None
        ):
            inputs = dict(inputs, decoder_input_ids=shift_right(model, inputs["labels"]))
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
                    hidden = stack.embed(inputs["decoder_input_ids"])  # (B, T_dec, H)
                else:
                    hidden = stack.embed(inputs["input_ids"])  # (B, T_enc, H)
                hidden = stack.dropout(hidden)
            else:
                hidden = received.pop(0)
                if is_decoder and enc_out is None:
                    enc_out = received.pop(0)
            hidden = self._run_stack(
                stage, stack, hidden, enc_out if is_decoder else None, inputs, cache if is_decoder else None
            )  # (B, T, H)
            if stack.ends:
                for m in stack.finals:
                    hidden = m(hidden)
                hidden = stack.dropout(hidden)
                if not is_decoder:
                    enc_out, hidden = hidden, None  # encoder output (B, T_enc, H) goes with the decoder
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
            first = layer_index(stack.blocks[0])
            past = self_cache.get_seq_length(first) if self_cache is not None else 0
            mask = create_causal_mask(
                config=config, inputs_embeds=hidden, attention_mask=inputs.get("decoder_attention_mask"),
                cache=self_cache, layer_idx=first if self_cache is not None else None,
            )
            enc_mask = create_bidirectional_mask(
                config=config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask"),
                encoder_hidden_states=enc_out,
            )
        else:
            past = 0
            mask = create_bidirectional_mask(
                config=config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask")
            )
            enc_mask = None
        position_bias = None
        if not stack.starts:
            q = hidden.shape[1]
            # the replica is block 0's bias embedding; its parent attention module knows the bucketing
            bias_module = stage.get_submodule(stack.replicas[0].rpartition(".")[0])
            position_bias = bias_module.compute_bias(
                q, past + q, device=hidden.device, past_seen_tokens=past
            )  # (1, heads, q, past + q)
        enc_position_bias = None
        for block in stack.modules:
            hidden, position_bias, cross_bias = block(
                hidden, mask, position_bias, enc_out, enc_mask, enc_position_bias, cache=cache
            )
            if config.is_decoder:
                enc_position_bias = cross_bias
        return hidden
