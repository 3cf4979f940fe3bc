"""What pipelined ``generate`` refuses, as a table: when each refusal applies, its message, its error class.

``request.py`` builds a request in steps and, after each, calls :func:`refuse` with the facts known by
then (the call's arguments, the inputs' shapes, the merged ``GenerationConfig``, the rows, the length);
the first row of that stage that applies raises. Every rank evaluates the same table on the same
(agreed) arguments, so every rank refuses alike before any message is sent.

Example:
    >>> facts = dict(copies=1, beams=1, do_sample=False, dp_size=2, n_microbatches=4, return_dict=False, criteria=False)
    >>> refuse("rows", batch=8, **facts)
    >>> refuse("rows", batch=1, **facts)
    InputError: batch of 1 rows is smaller than the 2 data-parallel replicas; pass more prompts
"""

from __future__ import annotations

import functools
import inspect
import numbers
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from transformers.generation.configuration_utils import GenerationMode

from ..errors import InputError, InputTypeError, InternalError, PipelineError

__all__ = ["REFUSALS", "Refusal", "SUPPORTED_MODES", "UNSUPPORTED_INPUTS", "refuse"]

# Beam sampling (num_beams > 1 with do_sample=True) draws from transformers' one global random stream over
# (prompts, beams x vocab): a pipeline choosing one microbatch at a time can neither reproduce it nor
# give a per-row seed a meaning, so it stays refused; group and constrained beam search moved out of
# transformers (its custom_generate repositories).
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH)
# generate() inputs of transformers that the ring has no use for (it feeds input_ids and keeps its own caches).
UNSUPPORTED_INPUTS = (
    "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds", "cache", "past_key_values", "assistant_model",
)


@dataclass(frozen=True)
class Refusal:
    """One input pipelined ``generate`` refuses.

    Attributes:
        stage: when it is checked; the facts its row reads are known from then on: ``"call"`` (the
            arguments as given), ``"inputs"`` (the prompt tensors), ``"config"`` (the merged
            ``GenerationConfig``), ``"rows"`` (the batch and its microbatches), ``"tokens"`` (the special
            tokens transformers prepared), ``"length"``.
        applies: whether the facts (a namespace of :func:`refuse`'s keywords) are refused.
        message: what to change, a ``str.format`` template over the facts (``{f.name}``).
        error: the library class raised (its builtin base is the one the refusal always had).
    """

    stage: str
    applies: Callable[[Any], bool]
    message: str
    error: type[PipelineError] = InputError


def _shape(tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def _bad_seed(seed) -> bool:
    # An int (a NumPy integer too), as torch.Generator.manual_seed takes; nan, "abc" or 1.5 would fail
    # only where a row's generator is seeded, on the last stage alone.
    return seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral))


def _bad_streamer(streamer) -> bool:
    # transformers' BaseStreamer protocol: the last stage calls put(ids) per step and end() once.
    return streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end"))


def _not_int(value) -> bool:
    return value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral))


def _not_real(value) -> bool:
    return value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real))


def _bad_chunk(chunk) -> bool:
    return chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1)


REFUSALS: tuple[Refusal, ...] = (
    # ---- the call as given (facts: skeleton, kwargs, input_ids)
    Refusal(
        "call", lambda f: not f.skeleton.can_generate(),
        "{f.model_name} has no generation head; load the checkpoint with AutoModelForCausalLM or "
        "AutoModelForSeq2SeqLM to generate (call the model for its other outputs)",
        InputTypeError,
    ),
    *(
        Refusal(
            "call", lambda f, key=key: f.kwargs.get(key) is not None,
            f"generate(..., {key}=...) is not supported by pipelined generation; pass input_ids (and attention_mask)",
            InputTypeError,
        )
        for key in UNSUPPORTED_INPUTS
    ),
    Refusal("call", lambda f: f.input_ids is None, "pass input_ids (B, T) to generate: the same tensor on every rank"),
    # ---- sampling and streaming arguments (facts: seed, streamer), checked like transformers checks its own
    Refusal(
        "call", lambda f: _bad_seed(f.seed),
        "seed must be an int (or None to sample from torch's global stream as transformers does), got {f.seed!r} of "
        "type {f.seed_type}; pass e.g. seed=0",
        InputTypeError,
    ),
    Refusal(
        "call", lambda f: _bad_streamer(f.streamer),
        "streamer must have put(ids) and end() methods (transformers' BaseStreamer, e.g. TextStreamer), got "
        "{f.streamer_type} without {f.streamer_missing}",
        InputTypeError,
    ),
    # ---- the prompt tensors, after their ids are checked against the vocabulary
    # (facts: input_ids, attention_mask, token_type_ids, skeleton, encoder_decoder)
    Refusal(
        "inputs", lambda f: f.attention_mask is not None and f.attention_mask.shape != f.input_ids.shape,
        "attention_mask shape {f.mask_shape} does not match input_ids {f.ids_shape}",
    ),
    Refusal(
        "inputs", lambda f: f.token_type_ids is not None and not f.takes_token_type_ids,
        "generate(..., token_type_ids=...): {f.model_name} takes no token_type_ids",
        InputTypeError,
    ),
    Refusal(
        "inputs", lambda f: f.token_type_ids is not None and f.token_type_ids.shape != f.input_ids.shape,
        "token_type_ids shape {f.types_shape} does not match input_ids {f.ids_shape}",
    ),
    # ---- the merged GenerationConfig (facts: config, extra, encoder_decoder)
    Refusal(
        "config", lambda f: bool(f.extra),
        "unexpected generate() argument(s) {f.extra_names}: not GenerationConfig fields nor supported inputs",
        InputTypeError,
    ),
    # Beam arguments transformers takes without a check and then fails on deep inside its loop
    # (num_beams=2.5: a TypeError from repeat_interleave, 0: ZeroDivisionError, -1: a negative dimension).
    Refusal(
        "config", lambda f: _not_int(f.config.num_beams),
        "num_beams must be an int >= 1, got {f.config.num_beams!r}; pass e.g. num_beams=4",
        InputTypeError,
    ),
    Refusal(
        "config", lambda f: f.config.num_beams is not None and f.config.num_beams < 1,
        "num_beams must be >= 1, got {f.config.num_beams}; pass num_beams=1 for greedy or sampling",
    ),
    Refusal(
        "config", lambda f: _not_real(f.config.length_penalty),
        "length_penalty must be a number, got {f.config.length_penalty!r}; pass e.g. length_penalty=1.0",
        InputTypeError,
    ),
    Refusal(
        "config", lambda f: f.mode not in SUPPORTED_MODES,
        "generation mode {f.mode.value!r} is not supported by pipelined generation; use greedy (do_sample=False), "
        "sampling (do_sample=True) with num_beams=1, or beam search (num_beams > 1, do_sample=False, one beam group, "
        "no constraints)",
    ),
    Refusal(  # transformers' own refusal (_beam_search), before the ring starts
        "config", lambda f: f.mode == GenerationMode.BEAM_SEARCH and bool(f.config.low_memory),
        "low_memory=True is not supported with beam search (transformers refuses it too); pass low_memory=None",
    ),
    Refusal(  # transformers' own refusal (_validate_generation_mode)
        "config", lambda f: f.mode == GenerationMode.BEAM_SEARCH and f.streamer is not None,
        "a streamer cannot be used with beam search (transformers refuses it too); pass num_beams=1 or no streamer",
    ),
    Refusal(
        "config",
        lambda f: bool(f.config.return_dict_in_generate)
        and bool(f.config.output_attentions or f.config.output_hidden_states),
        "output_attentions / output_hidden_states are not supported by pipelined generation (each stage holds "
        "only its own layers); return_dict_in_generate works with output_scores and output_logits",
    ),
    Refusal(
        "config",
        lambda f: f.streamer is not None and bool(f.config.return_dict_in_generate)
        and bool(f.config.output_scores or f.config.output_logits),
        "a streamer together with output_scores / output_logits is not supported by pipelined generation; "
        "pass one or the other",
    ),
    Refusal(
        "config", lambda f: f.config.guidance_scale not in (None, 1, 1.0),
        "guidance_scale (classifier-free guidance) is not supported by pipelined generation",
    ),
    # Fields that change what transformers computes outside the logits processors and stopping
    # criteria (those are transformers' own, built from the merged config on the last stage).
    Refusal(
        "config", lambda f: bool(f.config.token_healing),
        "token_healing is not supported by pipelined generation (it rewrites the prompt by generating with the "
        "model first)",
    ),
    Refusal(
        "config",
        lambda f: f.config.cache_implementation is not None and "quantized" in str(f.config.cache_implementation),
        "cache_implementation={f.config.cache_implementation!r} is not supported by pipelined generation: each "
        "stage keeps a DynamicCache (full precision); a quantized cache would change the results",
    ),
    Refusal(
        "config", lambda f: _bad_chunk(f.config.prefill_chunk_size),
        "prefill_chunk_size must be a positive number of positions or None, got {f.config.prefill_chunk_size!r}",
    ),
    # transformers' chunked prefill slices `attention_mask` to each chunk's length, which for an
    # encoder-decoder model is the encoder's mask: its tokens then differ from its own unchunked
    # generation on padded inputs. Neither matching that nor silently ignoring it is right.
    Refusal(
        "config", lambda f: f.config.prefill_chunk_size is not None and f.encoder_decoder,
        "prefill_chunk_size={f.config.prefill_chunk_size} is not supported for encoder-decoder models: the "
        "decoder's prompt is one start token, and transformers' chunked prefill cuts the encoder's attention "
        "mask to the chunk; pass prefill_chunk_size=None",
    ),
    # ---- the rows (facts: copies, beams, do_sample, batch (after the copies), dp_size, n_microbatches, return_dict,
    # criteria: whether the caller passed stopping criteria)
    Refusal(
        "rows", lambda f: f.copies > 1 and not f.do_sample and f.beams == 1,
        "num_return_sequences > 1 needs do_sample=True or num_beams > 1 (greedy would repeat the same sequence)",
    ),
    Refusal(
        "rows", lambda f: f.batch < f.dp_size,
        "batch of {f.batch} rows is smaller than the {f.dp_size} data-parallel replicas; pass more prompts",
    ),
    Refusal(
        "rows", lambda f: f.return_dict and f.dp_size > 1,
        "return_dict_in_generate=True is not supported with {f.dp_size} data-parallel replicas; generate returns "
        "the ids there",
    ),
    # transformers calls a caller's stopping criteria on the whole batch (chooser.py defers them to see
    # it); a replica's last stage has only its share of the rows, and a criterion with per-row state
    # sized to the batch (lm-eval's) would read the wrong rows or raise IndexError there alone.
    Refusal(
        "rows", lambda f: f.criteria and f.dp_size > 1,
        "stopping_criteria with {f.dp_size} data-parallel replicas: each replica would call them on its own "
        "share of the rows, where transformers calls them on the whole batch; load the model with one pipeline "
        "over all ranks (num_stages = world size) or pass no stopping_criteria",
    ),
    Refusal("rows", lambda f: f.n_microbatches < 1, "n_microbatches must be >= 1, got {f.n_microbatches}"),
    # ---- the special tokens, as transformers prepared them (facts: pad, vocab, can_finish)
    # A row that finishes early gets pad_token_id appended and fed back: transformers' embedding then
    # raises IndexError (only in calls where some row finishes first); the ring would carry it on.
    Refusal(
        "tokens", lambda f: f.can_finish and f.vocab is not None and not 0 <= f.pad < f.vocab,
        "pad_token_id={f.pad} is outside the model's vocabulary of {f.vocab} tokens (config.vocab_size): a row "
        "that finishes early is filled with it and fed back to the model, where transformers raises IndexError; "
        "pass a pad_token_id in [0, {f.vocab_top}] (the tokenizer's pad_token_id, or its eos_token_id)",
    ),
    # ---- the length (facts: max_length, prompt_length)
    Refusal(
        "length", lambda f: f.max_length - f.prompt_length < 1,
        "nothing to generate: max_length={f.max_length} <= input length {f.prompt_length}; raise max_new_tokens",
    ),
)

_STAGES = ("call", "inputs", "config", "rows", "tokens", "length")


class _Facts(SimpleNamespace):
    """The facts of one stage, with the derived values the rows read (each computed when first read)."""

    @property
    def model_name(self):
        return type(self.skeleton).__name__

    @property
    def takes_token_type_ids(self):
        # token_type_ids is a model input, not a GenerationConfig field: only a decoder-only model
        # whose forward takes it can carry it along (as transformers does).
        forward = inspect.signature(type(self.skeleton).forward)
        return not self.encoder_decoder and "token_type_ids" in forward.parameters

    @property
    def seed_type(self):
        return type(self.seed).__name__

    @property
    def streamer_type(self):
        return type(self.streamer).__name__

    @property
    def streamer_missing(self):
        return " and ".join(f"{m}()" for m in ("put", "end") if not callable(getattr(self.streamer, m, None)))

    @property
    def ids_shape(self):
        return _shape(self.input_ids)

    @property
    def mask_shape(self):
        return _shape(self.attention_mask)

    @property
    def types_shape(self):
        return _shape(self.token_type_ids)

    @property
    def vocab_top(self):
        return self.vocab - 1

    @property
    def extra_names(self):
        return sorted(self.extra)

    @functools.cached_property  # read by the row and by its message: asked of transformers once
    def mode(self):
        return self.config.get_generation_mode()


def refuse(stage: str, **facts: Any) -> None:
    """Raise the first refusal of ``stage`` (in table order) that applies to ``facts``.

    Args:
        stage: one of the table's stages (see :class:`Refusal`).
        **facts: what that stage's rows read, by name.
    Raises:
        the row's error class, with its message filled from the facts.
    """
    if stage not in _STAGES:
        raise InternalError(f"unknown refusal stage {stage!r}; one of {_STAGES}")
    found = _Facts(**facts)
    for rule in REFUSALS:
        if rule.stage == stage and rule.applies(found):
            raise rule.error(rule.message.format(f=found))
