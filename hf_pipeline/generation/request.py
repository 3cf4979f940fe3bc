"""One ``generate`` call made into a :class:`Request`: checked, merged with the generation config, cut into rows.

Every rank builds the same request from the same (agreed) arguments, in named steps:
:func:`build_request` checks the call (:mod:`.refusals`), moves the prompt to the device, merges the
``GenerationConfig`` as transformers does, completes the attention mask, repeats rows for
``num_return_sequences``, takes this data-parallel replica's share, cuts it into microbatches, and
sizes the generation. Transformers' own argument checks run here too (on every rank), so no stage
alone raises while its peers wait in the ring.

Example (inside ``generate``):
    >>> request = build_request(model, call)
    >>> Ring(model, request).decode_loop()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..compat import decoder_start_token_tensor, generation_helper, pad_token_tensor
from ..core import PipelineCore
from ..errors import InputError, InputTypeError
from ..log import get_logger
from ..runtime.checks import check_index_inputs, check_sequence_length, check_token_ids, vocab_size
from .config import generation_config, prepare_generation_config
from .microbatches import replica_share
from .refusals import refuse
from .sampling import left_padded_position_ids

__all__ = ["GenerateCall", "Request", "build_request"]

logger = get_logger(__name__)


@dataclass(kw_only=True)
class GenerateCall:
    """The arguments of one ``generate`` call, as given (``kwargs``: the rest, GenerationConfig fields)."""

    input_ids: Any
    attention_mask: Any
    config: GenerationConfig | None
    kwargs: dict[str, Any]
    n_microbatches: int | None
    seed: int | None
    streamer: Any
    logits_processor: Any
    stopping_criteria: Any
    tokenizer: Any

    @property
    def generation_kwargs(self) -> dict[str, Any]:
        """``kwargs`` less ``token_type_ids`` (a model input carried like the mask, not a GenerationConfig field)."""
        return {k: v for k, v in self.kwargs.items() if k != "token_type_ids"}


@dataclass(kw_only=True)
class Request:
    """Everything every rank knows about one ``generate`` call, derived identically on each of them."""

    config: GenerationConfig
    encoder_decoder: bool
    prompt: torch.Tensor  # (B, T) decoder-only prompt, or (B, 1) decoder start ids
    prefill_chunk: int | None = None  # decoder-only: feed the prompt in chunks of this many positions
    mask: torch.Tensor | None  # decoder-only: prompt mask (None when all ones, as transformers drops it)
    positions: torch.Tensor | None  # decoder-only: (B, T) position ids
    types: torch.Tensor | None  # decoder-only: (B, T) token_type_ids of the prompt (GPT-2), if given
    enc_ids: torch.Tensor | None  # encoder-decoder: (B, T_enc) encoder input
    enc_mask: torch.Tensor | None
    bounds: list[tuple[int, int]]  # microbatch row ranges
    row_offset: int  # global index of this replica's first row (seeds)
    total_rows: int  # rows of the whole batch, every replica's (sampling's draws cover them all)
    max_new: int
    do_sample: bool
    num_beams: int  # > 1: beam search; each microbatch holds whole groups of num_beams rows
    keep_rows: bool  # per-step scores / logits asked for: finished rows stay in the ring (see Ring)
    lock_step: bool  # experts over data-parallel ranks: every replica's ring runs the same ops (see Ring)
    seed: int | None
    stream: bool  # sampling without a seed: transformers' draws from the global stream (sampling.step_noise)
    pad: int
    streamer: Any
    logits_processor: Any
    stopping_criteria: Any
    tokenizer: Any


@dataclass(kw_only=True)
class _Rows:
    """This replica's rows of the prompt, on the model's device: ids, mask and token types, each ``(B, T)``."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    types: torch.Tensor | None

    def select(self, fn) -> _Rows:
        """Each tensor through ``fn`` (a slice of rows, rows repeated, a move to the device)."""
        return _Rows(ids=fn(self.ids), mask=_maybe(fn, self.mask), types=_maybe(fn, self.types))


def _maybe(fn, tensor):
    return None if tensor is None else fn(tensor)


def build_request(model: PipelineCore, call: GenerateCall) -> Request:
    """Check one ``generate`` call and derive its :class:`Request` (the same on every rank).

    Args:
        model: the :class:`~hf_pipeline.model.PipelinedModel`.
        call: the call's arguments.
    Returns:
        the request the decode ring runs.
    Raises:
        InputError / InputTypeError: a refused call (see :mod:`.refusals`), or transformers' own
            checks of the generation arguments, naming the arguments given.
    """
    encoder_decoder = bool(model.config.is_encoder_decoder)
    rows = _checked_inputs(model, call)
    merged = _merged_config(model, call)
    rows = _with_attention_mask(model, merged.config, rows, encoder_decoder)
    share = _replica_share(model, merged.config, rows, call.n_microbatches, criteria=bool(call.stopping_criteria))
    tensors = _prompt_tensors(
        model, merged.config, share.rows, encoder_decoder=encoder_decoder, all_ones=share.all_ones
    )
    prompt_length = tensors["prompt"].shape[1]
    gc = _with_generated_length(model, merged, share.rows, prompt_length)
    # Sampling without a seed draws what transformers draws from the global stream; beam sampling is refused.
    stream = bool(gc.do_sample) and call.seed is None
    pad = pad_token_tensor(gc)
    pad = int(pad.reshape(-1)[0].item()) if pad is not None else 0  # no pad and no EOS: no row finishes early
    can_finish = gc.eos_token_id is not None or bool(gc.stop_strings) or bool(call.stopping_criteria)
    refuse("tokens", pad=pad, vocab=vocab_size(model.config), can_finish=can_finish)
    _as_transformers_raises(
        call.generation_kwargs, call.config, lambda: _check_processors(model, gc, call, **tensors)
    )
    return Request(
        config=gc, encoder_decoder=encoder_decoder, prefill_chunk=merged.prefill_chunk, **tensors,
        bounds=share.bounds, row_offset=share.row_offset, total_rows=share.total_rows,
        max_new=gc.max_length - prompt_length, do_sample=bool(gc.do_sample), seed=call.seed, stream=stream, pad=pad,
        streamer=call.streamer, num_beams=int(gc.num_beams or 1),
        keep_rows=bool(gc.return_dict_in_generate and (gc.output_scores or gc.output_logits)),
        lock_step=model.dims.ep_data > 1,
        logits_processor=call.logits_processor, stopping_criteria=call.stopping_criteria, tokenizer=call.tokenizer,
    )


def _checked_inputs(model: PipelineCore, call: GenerateCall) -> _Rows:
    """Refuse what the call cannot do, check the prompt's ids and shapes; the prompt on the model's device."""
    skel = model.skeleton
    refuse("call", skeleton=skel, kwargs=call.kwargs, input_ids=call.input_ids, seed=call.seed, streamer=call.streamer)
    # Dtype, shape and every id inside the vocabulary (one min/max pass): the first stage's embedding
    # would raise torch's IndexError alone, with its peers waiting.
    check_token_ids(call.input_ids, vocab=vocab_size(model.config), what="input_ids")
    # token_type_ids is a model input, not a GenerationConfig field: carried like the mask, each new
    # token taking the prompt's last type, as transformers' _update_model_kwargs_for_generation does.
    types = call.kwargs.get("token_type_ids")
    refuse(
        "inputs", input_ids=call.input_ids, attention_mask=call.attention_mask, token_type_ids=types,
        skeleton=skel, encoder_decoder=bool(model.config.is_encoder_decoder),
    )
    # dtype, inside the table it indexes; and neither it nor the mask on the meta device (no values)
    check_index_inputs(model.config, {"token_type_ids": types, "attention_mask": call.attention_mask})
    rows = _Rows(ids=call.input_ids, mask=call.attention_mask, types=types)
    return rows.select(lambda t: t.to(model.device, torch.long))


@dataclass(frozen=True)
class _Merged:
    """The call's merged ``GenerationConfig``, and what transformers sizes the generation by."""

    config: GenerationConfig
    has_default_max_length: bool  # neither the call nor the model's config set max_length
    has_default_min_length: bool
    prefill_chunk: int | None  # as merged, before transformers' length preparation


def _merged_config(model: PipelineCore, call: GenerateCall) -> _Merged:
    """The call's ``GenerationConfig`` merged as transformers merges it, refused where the ring cannot run it."""
    kwargs = call.generation_kwargs
    user_gc = call.config
    defaults = generation_config(model)
    has_default_max_length = (
        kwargs.get("max_length") is None and (user_gc is None or user_gc.max_length is None)
        and defaults.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None and (user_gc is None or user_gc.min_length is None)
        and defaults.min_length is None
    )
    gc, extra = _as_transformers_raises(kwargs, user_gc, lambda: prepare_generation_config(model, user_gc, **kwargs))
    extra = {k: v for k, v in extra.items() if v is not None and k not in ("output_attentions", "output_hidden_states")}
    refuse(
        "config", config=gc, extra=extra, encoder_decoder=bool(model.config.is_encoder_decoder), streamer=call.streamer
    )
    return _Merged(
        config=gc, has_default_max_length=has_default_max_length, has_default_min_length=has_default_min_length,
        prefill_chunk=gc.prefill_chunk_size,
    )


def _with_attention_mask(model: PipelineCore, gc: GenerationConfig, rows: _Rows, encoder_decoder: bool) -> _Rows:
    """Transformers' special tokens on ``gc``; a decoder-only prompt's mask derived from its padding if not given."""
    skel, batch = model.skeleton, rows.ids.shape[0]
    mask = rows.mask
    generation_helper(skel, "_prepare_special_tokens")(gc, mask is not None, device=model.device, batch_size=batch)
    if not encoder_decoder and mask is None:
        mask = generation_helper(skel, "_prepare_attention_mask_for_generation")(rows.ids, gc, {})
    if not encoder_decoder and mask is not None and batch > 1 and bool((mask[:, -1] == 0).any()):
        logger.warning(
            "right padding detected in a decoder-only batch; set tokenizer.padding_side = 'left' for correct results"
        )
    return _Rows(ids=rows.ids, mask=mask, types=rows.types)


@dataclass(frozen=True)
class _Share:
    """This data-parallel replica's rows, cut into the microbatches the ring keeps in flight."""

    rows: _Rows
    row_offset: int  # global index of the first row (seeds)
    total_rows: int  # the whole batch's (every replica's) rows
    bounds: list[tuple[int, int]]  # microbatch row ranges
    all_ones: bool  # the whole batch's mask is all ones (dropped, as transformers drops it)


def _replica_share(model: PipelineCore, gc: GenerationConfig, rows: _Rows, n_microbatches: int | None, *,
                   criteria: bool) -> _Share:
    """Rows repeated for ``num_return_sequences`` (beam search: ``num_beams``, as transformers expands them),
    this replica's contiguous share of them, its microbatches."""
    copies = gc.num_return_sequences or 1
    beams = gc.num_beams or 1
    if n_microbatches is None:
        # One microbatch per pipeline rank (capped by the rows below): the fewest that keep every rank busy
        # (a rank runs each of its stages once per microbatch, a microbatch's round trip every stage once).
        # The load's n_microbatches plans training steps, not this: each microbatch more makes every decode
        # forward smaller and reads every weight once more per token for no more overlap (3 instead of 2 on 2
        # ranks: ~20% fewer tokens/s on CPU; one per stage with 2 stages on each of 2 ranks: 0.6x).
        n_microbatches = model.plan.pp_size
    # Units the rows are cut in: a beam group (a prompt's num_beams rows) is never split, since its
    # beams are chosen together and reorder each other's caches; otherwise single rows.
    unit = beams if beams > 1 else 1
    repeats = beams if beams > 1 else copies
    units = rows.ids.shape[0] * (1 if beams > 1 else copies)
    refuse(
        "rows", copies=copies, beams=beams, do_sample=gc.do_sample, batch=units, dp_size=model.dims.dp_size,
        n_microbatches=n_microbatches, return_dict=bool(gc.return_dict_in_generate), criteria=criteria,
    )
    if repeats > 1:
        rows = rows.select(lambda t: t.repeat_interleave(repeats, dim=0))
    # As transformers: a mask of all ones is dropped (same kernels, same numbers), decided for the whole batch.
    all_ones = rows.mask is None or bool((rows.mask == 1).all())
    # Data-parallel replicas each generate a contiguous share of the units (gathered at the end); replicas
    # in lock step (experts over them) all cut theirs into the same number of microbatches.
    (lo, hi), bounds = replica_share(
        units, model.dims.dp_size, model.dims.dp_rank, n_microbatches, same_count=model.dims.ep_data > 1
    )
    return _Share(
        rows=rows.select(lambda t: t[lo * unit: hi * unit]), row_offset=lo * unit, total_rows=rows.ids.shape[0],
        bounds=[(a * unit, b * unit) for a, b in bounds], all_ones=all_ones,
    )


def _prompt_tensors(model: PipelineCore, gc: GenerationConfig, rows: _Rows, *, encoder_decoder: bool,
                    all_ones: bool) -> dict:
    """The request's prompt tensors (fields of :class:`Request`): a decoder-only prompt with its
    positions, or an encoder-decoder model's decoder start tokens with the encoder's input."""
    batch = rows.ids.shape[0]
    if encoder_decoder:
        start = decoder_start_token_tensor(gc).reshape(-1)[:1]
        return dict(
            prompt=start.expand(batch, 1).to(model.device, torch.long).clone(),  # (B, 1)
            positions=None, mask=None, types=rows.types, enc_ids=rows.ids, enc_mask=rows.mask,
        )
    positions = left_padded_position_ids(rows.mask, rows.ids.shape[1], batch=batch).to(model.device)
    return dict(
        prompt=rows.ids, positions=positions, mask=None if all_ones else rows.mask, types=rows.types,
        enc_ids=None, enc_mask=None,
    )


def _with_generated_length(model: PipelineCore, merged: _Merged, rows: _Rows, prompt_length: int) -> GenerationConfig:
    """The config with ``max_length`` / ``min_length`` as transformers sets them for this prompt; refused if
    nothing is left to generate."""
    gc = generation_helper(model.skeleton, "_prepare_generated_length")(
        generation_config=merged.config, has_default_max_length=merged.has_default_max_length,
        has_default_min_length=merged.has_default_min_length, model_input_name="input_ids",
        input_ids_length=prompt_length, inputs_tensor=rows.ids,
    )
    refuse("length", max_length=gc.max_length, prompt_length=prompt_length)
    # The effective length, however it was set (max_new_tokens=, max_length=, a GenerationConfig, the
    # checkpoint's generation_config.json): a learned position table must cover all of it, or the
    # first stage's embedding raises alone mid-generation.
    what = "the decoder input" if model.config.is_encoder_decoder else "the prompt"
    check_sequence_length(model.config, prompt_length, what=what, new_tokens=gc.max_length - prompt_length)
    return gc


def _given(kwargs: dict[str, Any], config: GenerationConfig | None) -> str:
    """The generation arguments the caller set, for messages: ``top_k=-1, max_new_tokens=2``."""
    parts = [f"{k}={v!r}" for k, v in kwargs.items() if v is not None]
    if config is not None:
        parts.append(f"generation_config={config.to_diff_dict()}")
    text = ", ".join(parts) or "none besides the model's generation config"
    return text if len(text) <= 300 else text[:297] + "..."


def _as_transformers_raises(kwargs: dict[str, Any], config: GenerationConfig | None, check):
    """Run a transformers check of the generation arguments; its ValueError becomes an InputError and
    its TypeError an InputTypeError (a TypeError still), both naming the arguments given."""
    try:
        return check()
    except (InputError, RuntimeError):
        raise
    except TypeError as e:
        raise InputTypeError(f"{e} (generate arguments: {_given(kwargs, config)})") from e
    except ValueError as e:
        raise InputError(f"{e} (generate arguments: {_given(kwargs, config)})") from e


def _check_processors(model: PipelineCore, gc: GenerationConfig, call: GenerateCall, *, prompt, enc_ids, mask,
                      **_unused) -> None:
    """Build what the last stage will build (logits processors, stopping criteria) and run the
    processors transformers makes once on one row, on every rank: transformers checks their
    arguments there (``temperature=0`` with sampling, ``top_k < 0``, ``repetition_penalty < 0``,
    ``stop_strings`` without a tokenizer, token ids outside the vocabulary), and the last stage
    alone would otherwise raise with its peers waiting in the ring."""
    skel = model.skeleton
    mask_key = "decoder_attention_mask" if model.config.is_encoder_decoder else "attention_mask"
    user = list(call.logits_processor or [])
    processors = generation_helper(skel, "_get_logits_processor")(
        generation_config=gc, input_ids_seq_length=prompt.shape[1],
        encoder_input_ids=(enc_ids if enc_ids is not None else prompt)[:1], logits_processor=LogitsProcessorList(user),
        device=prompt.device, model_kwargs={mask_key: mask[:1] if mask is not None else None},
    )
    # The caller's own processors are not run here (they may keep state); transformers' are fresh copies.
    own = LogitsProcessorList([p for p in processors if not any(p is u for u in user)])
    width = int(model.config.get_text_config(decoder=True).vocab_size)
    own(prompt[:1], torch.zeros(1, width, dtype=torch.float32, device=prompt.device))
    generation_helper(skel, "_get_stopping_criteria")(
        generation_config=gc, stopping_criteria=StoppingCriteriaList(call.stopping_criteria or []),
        tokenizer=call.tokenizer,
    )
