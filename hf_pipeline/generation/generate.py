"""Pipelined generation: a decode ring over the stages, per-stage KV caches, microbatches in flight.

``model.generate(input_ids, attention_mask, max_new_tokens=64)`` is collective (every rank passes the
same inputs) and returns the same ``(B, prompt + new)`` tensor on every rank, token for token what
``transformers`` ``generate(do_sample=False)`` returns on one process.

How it runs:
  * Each rank keeps the KV cache of its own layers only: one transformers ``DynamicCache`` (T5:
    ``EncoderDecoderCache``) per (local stage, microbatch), built from the config so layer indices
    are the model's global ones. Cache memory per rank is about 1/p of the whole.
  * The batch is split into ``m`` microbatches (default ``max(model.n_microbatches, num_stages)``,
    at most the batch size). The prompt's hidden states cross each stage boundary once (prefill);
    every later step sends only the new token's hidden state. The last stage turns logits into the
    next token (transformers' own logits processors and stopping criteria, from the merged
    ``GenerationConfig``) and sends the token ids with a row-alive flag back to the first stage: a
    ring. With ``m >= S`` microbatches, stage k works on microbatch i while stage k+1 works on
    microbatch i-1; the pipe is never drained between tokens.
  * Finished rows (EOS, stop strings) are dropped from their microbatch's caches and inputs
    (``Cache.batch_select_indices``) on every stage, so they stop costing compute; a microbatch whose
    rows are all done leaves the ring. The output is padded with ``pad_token_id`` as transformers does.
  * Encoder-decoder models (T5): the encoder runs once, pipelined over the encoder stages; its
    output is sent once per request to every rank holding decoder stages, which keep it (and the
    cross-attention keys/values in their ``EncoderDecoderCache``) for all decoding steps.

Note (why not torch's schedules): ``torch.distributed.pipelining`` schedules are training-step
schedules: every ``step()`` fills and drains the pipe over a fixed set of microbatches with shapes
fixed at construction. Decoding needs a loop whose input (the next token) comes from the last
stage, shapes that change after the prefill and rows that finish at different times; running a
schedule per token would pay the fill/drain bubble (p-1)/(m+p-1) on every token. So the ring below
talks ``dist.isend`` / ``dist.irecv`` itself.

Note (protocol): the ring's timetable, messages and shapes are described in :mod:`hf_pipeline.generation.ring`.

Note (seeded sampling): each row samples from its own generator seeded from ``seed`` and its row
index (``sampling.row_seed``), so a seed gives the same tokens whatever the number of stages,
microbatches or replicas; the stream differs from transformers' single global one.

Note (streamer): ``streamer.put`` / ``.end()`` are called on the last stage's rank (where tokens
are chosen): first the prompt, then one ``(B,)`` tensor per step once every microbatch has its
token for that step. Other ranks never touch the streamer.

Example (``torchrun --nproc_per_node 2 script.py``):
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True)
    >>> enc = tok(prompts, return_tensors="pt", padding=True)          # tok.padding_side = "left"
    >>> ids = model.generate(**enc, max_new_tokens=64)
    >>> ids, stats = model.generate(**enc, do_sample=True, top_p=0.9, seed=0, return_stats=True)
"""

from __future__ import annotations

import inspect
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from ..compat import decoder_start_token_tensor, generation_helper, pad_token_tensor
from ..distributed.agreement import check_same_on_all_ranks
from ..errors import InputError
from ..log import get_logger
from ..runtime.checks import check_generate_inputs, check_sequence_length, check_token_ids, vocab_size
from .ring import Request, Ring
from .sampling import left_padded_position_ids, microbatch_bounds

__all__ = ["GenerationStats", "generate", "generation_config", "prepare_generation_config"]

logger = get_logger(__name__)

_SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


@dataclass(kw_only=True)
class GenerationStats:
    """What one ``generate`` call did, as seen from this rank.

    Attributes:
        new_tokens: tokens generated over all rows, each row up to and including its stop token.
        steps: decoding steps (new tokens of the longest row).
        seconds: wall time of the call on this rank (prefill, decoding, final broadcast).
        n_microbatches: microbatches in flight.
        peak_cache_bytes: largest total size of this rank's KV cache tensors during the call.
        prefill_steps: the ring's steps that fed the prompt: its chunks with ``prefill_chunk_size``
            (transformers' chunked prefill; each microbatch's chunks follow each other down the
            pipeline, so its prefill idles less), else 1.
    """

    new_tokens: int
    steps: int
    seconds: float
    n_microbatches: int
    peak_cache_bytes: int
    prefill_steps: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


def generation_config(model) -> GenerationConfig:
    """The model's default ``GenerationConfig``: the checkpoint's ``generation_config.json`` if it has one.

    As transformers' ``from_pretrained``: the file wins, else it is derived from the model config.
    Loaded once and kept on ``model.skeleton`` (whose transformers helpers read it).
    """
    skel = model.skeleton
    if not getattr(skel, "_hf_pipeline_generation_config_loaded", False):
        path = getattr(model, "checkpoint_dir", None)
        if path is not None and (pathlib.Path(path) / "generation_config.json").is_file():
            skel.generation_config = GenerationConfig.from_pretrained(path)
        skel._hf_pipeline_generation_config_loaded = True
    return skel.generation_config


def prepare_generation_config(model, config: GenerationConfig | None = None, **kwargs: Any) -> tuple[GenerationConfig, dict[str, Any]]:
    """Merge ``config`` / ``kwargs`` over the model's generation config exactly as transformers does.

    Returns:
        (the merged ``GenerationConfig``, the kwargs that are not generation parameters).
    """
    generation_config(model)
    return generation_helper(model.skeleton, "_prepare_generation_config")(config, **kwargs)


# --------------------------------------------------------------------------- request preparation
def _prepare(model, input_ids, attention_mask, config, kwargs, n_microbatches, seed, streamer, logits_processor, stopping_criteria, tokenizer) -> Request:
    skel = model.skeleton
    if not skel.can_generate():
        raise TypeError(
            f"{type(skel).__name__} has no generation head; load the checkpoint with AutoModelForCausalLM or "
            f"AutoModelForSeq2SeqLM to generate (call the model for its other outputs)"
        )
    for key in ("inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds", "cache", "past_key_values", "assistant_model"):
        if kwargs.get(key) is not None:
            raise TypeError(f"generate(..., {key}=...) is not supported by pipelined generation; pass input_ids (and attention_mask)")
    if input_ids is None:
        raise ValueError("pass input_ids (B, T) to generate: the same tensor on every rank")
    # Dtype, shape and every id inside the vocabulary (one min/max pass): the first stage's embedding
    # would raise torch's IndexError alone, with its peers waiting.
    check_token_ids(input_ids, vocab=vocab_size(model.config), what="input_ids")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    device = model.device
    input_ids = input_ids.to(device, torch.long)
    attention_mask = None if attention_mask is None else attention_mask.to(device, torch.long)
    # token_type_ids is a model input, not a GenerationConfig field: carried like the mask, each new
    # token taking the prompt's last type, as transformers' _update_model_kwargs_for_generation does.
    kwargs = dict(kwargs)
    types = kwargs.pop("token_type_ids", None)
    if types is not None:
        if model.config.is_encoder_decoder or "token_type_ids" not in inspect.signature(type(skel).forward).parameters:
            raise TypeError(f"generate(..., token_type_ids=...): {type(skel).__name__} takes no token_type_ids")
        if types.shape != input_ids.shape:
            raise ValueError(f"token_type_ids shape {tuple(types.shape)} does not match input_ids {tuple(input_ids.shape)}")
        types = types.to(device, torch.long)

    user_gc = config
    has_default_max_length = kwargs.get("max_length") is None and (user_gc is None or user_gc.max_length is None) and generation_config(model).max_length is None
    has_default_min_length = kwargs.get("min_length") is None and (user_gc is None or user_gc.min_length is None) and generation_config(model).min_length is None
    gc, extra = _as_transformers_raises(kwargs, user_gc, lambda: prepare_generation_config(model, user_gc, **kwargs))
    extra = {k: v for k, v in extra.items() if v is not None and k not in ("output_attentions", "output_hidden_states")}
    if extra:
        raise TypeError(f"unexpected generate() argument(s) {sorted(extra)}: not GenerationConfig fields nor supported inputs")
    mode = gc.get_generation_mode()
    if mode not in _SUPPORTED_MODES:
        raise ValueError(
            f"generation mode {mode.value!r} is not supported by pipelined generation; use greedy (do_sample=False) "
            f"or sampling (do_sample=True) with num_beams=1"
        )
    if gc.return_dict_in_generate or gc.output_scores or gc.output_logits:
        raise ValueError("return_dict_in_generate / output_scores / output_logits are not supported; generate returns the ids")
    if gc.guidance_scale not in (None, 1, 1.0):
        raise ValueError("guidance_scale (classifier-free guidance) is not supported by pipelined generation")
    # Fields that change what transformers computes outside the logits processors and stopping
    # criteria (those are transformers' own, built from the merged config on the last stage).
    if gc.token_healing:
        raise ValueError("token_healing is not supported by pipelined generation (it rewrites the prompt by generating with the model first)")
    if gc.cache_implementation is not None and "quantized" in str(gc.cache_implementation):
        raise ValueError(
            f"cache_implementation={gc.cache_implementation!r} is not supported by pipelined generation: each stage keeps a "
            f"DynamicCache (full precision); a quantized cache would change the results"
        )
    chunk = gc.prefill_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"prefill_chunk_size must be a positive number of positions or None, got {chunk!r}")
    if chunk is not None and model.config.is_encoder_decoder:
        # transformers' chunked prefill slices `attention_mask` to each chunk's length, which for an
        # encoder-decoder model is the encoder's mask: its tokens then differ from its own unchunked
        # generation on padded inputs. Neither matching that nor silently ignoring it is right.
        raise ValueError(
            f"prefill_chunk_size={chunk} is not supported for encoder-decoder models: the decoder's prompt is one start "
            f"token, and transformers' chunked prefill cuts the encoder's attention mask to the chunk; pass prefill_chunk_size=None"
        )

    batch = input_ids.shape[0]
    generation_helper(skel, "_prepare_special_tokens")(gc, attention_mask is not None, device=device, batch_size=batch)
    encoder_decoder = bool(model.config.is_encoder_decoder)
    if not encoder_decoder and attention_mask is None:
        attention_mask = generation_helper(skel, "_prepare_attention_mask_for_generation")(input_ids, gc, {})
    if not encoder_decoder and attention_mask is not None and batch > 1 and bool((attention_mask[:, -1] == 0).any()):
        logger.warning("right padding detected in a decoder-only batch; set tokenizer.padding_side = 'left' for correct results")
    expand = gc.num_return_sequences or 1
    if expand > 1:
        if not gc.do_sample:
            raise ValueError("num_return_sequences > 1 needs do_sample=True (greedy would repeat the same sequence)")
        input_ids = input_ids.repeat_interleave(expand, dim=0)
        attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(expand, dim=0)
        types = None if types is None else types.repeat_interleave(expand, dim=0)
        batch *= expand

    # As transformers: a mask of all ones is dropped (same kernels, same numbers), decided for the whole batch.
    all_ones = attention_mask is None or bool((attention_mask == 1).all())
    # Data-parallel replicas each generate a contiguous share of the rows (gathered at the end).
    if batch < model.dims.dp_size:
        raise ValueError(f"batch of {batch} rows is smaller than the {model.dims.dp_size} data-parallel replicas; pass more prompts")
    lo, hi = microbatch_bounds(batch, model.dims.dp_size)[model.dims.dp_rank]
    input_ids = input_ids[lo:hi]
    attention_mask = None if attention_mask is None else attention_mask[lo:hi]
    types = None if types is None else types[lo:hi]
    rows = hi - lo

    m = n_microbatches if n_microbatches is not None else max(model.n_microbatches, model.plan.num_stages)
    if m < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {m}")
    bounds = microbatch_bounds(rows, min(m, rows))

    if encoder_decoder:
        start = decoder_start_token_tensor(gc).reshape(-1)[:1]
        prompt = start.expand(rows, 1).to(device, torch.long).clone()  # (B, 1)
        positions, mask, enc_ids, enc_mask = None, None, input_ids, attention_mask
    else:
        prompt, enc_ids, enc_mask = input_ids, None, None
        positions = left_padded_position_ids(attention_mask, input_ids.shape[1], batch=rows).to(device)
        mask = None if all_ones else attention_mask
    cur_len = prompt.shape[1]
    gc = generation_helper(skel, "_prepare_generated_length")(
        generation_config=gc, has_default_max_length=has_default_max_length, has_default_min_length=has_default_min_length,
        model_input_name="input_ids", input_ids_length=cur_len, inputs_tensor=input_ids,
    )
    max_new = gc.max_length - cur_len
    if max_new < 1:
        raise ValueError(f"nothing to generate: max_length={gc.max_length} <= input length {cur_len}; raise max_new_tokens")
    if gc.do_sample and seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())  # from torch's global stream: torch.manual_seed reproduces it
    pad = pad_token_tensor(gc)
    pad = int(pad.reshape(-1)[0].item()) if pad is not None else 0  # no pad and no EOS: no row finishes early
    _as_transformers_raises(kwargs, user_gc, lambda: _check_processors(
        model, gc, prompt=prompt, enc_ids=enc_ids, mask=mask, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, tokenizer=tokenizer,
    ))
    return Request(
        config=gc, encoder_decoder=encoder_decoder, prompt=prompt, prefill_chunk=chunk,
        mask=mask, positions=positions, types=types, enc_ids=enc_ids,
        enc_mask=enc_mask, bounds=bounds, row_offset=lo, max_new=max_new, do_sample=bool(gc.do_sample), seed=seed,
        pad=pad, streamer=streamer, logits_processor=logits_processor, stopping_criteria=stopping_criteria, tokenizer=tokenizer,
    )


def _given(kwargs: dict[str, Any], config: GenerationConfig | None) -> str:
    """The generation arguments the caller set, for messages: ``top_k=-1, max_new_tokens=2``."""
    parts = [f"{k}={v!r}" for k, v in kwargs.items() if v is not None]
    if config is not None:
        parts.append(f"generation_config={config.to_diff_dict()}")
    text = ", ".join(parts) or "none besides the model's generation config"
    return text if len(text) <= 300 else text[:297] + "..."


def _as_transformers_raises(kwargs: dict[str, Any], config: GenerationConfig | None, check):
    """Run a transformers check of the generation arguments; its ValueError becomes an InputError (a
    ValueError) and its TypeError stays a TypeError, both naming the arguments given."""
    try:
        return check()
    except (InputError, RuntimeError):
        raise
    except TypeError as e:
        raise TypeError(f"{e} (generate arguments: {_given(kwargs, config)})") from e
    except ValueError as e:
        raise InputError(f"{e} (generate arguments: {_given(kwargs, config)})") from e


def _check_processors(model, gc: GenerationConfig, *, prompt, enc_ids, mask, logits_processor, stopping_criteria, tokenizer) -> None:
    """Build what the last stage will build (logits processors, stopping criteria) and run the
    processors transformers makes once on one row, on every rank: transformers checks their
    arguments there (``temperature=0`` with sampling, ``top_k < 0``, ``repetition_penalty < 0``,
    ``stop_strings`` without a tokenizer, token ids outside the vocabulary), and the last stage
    alone would otherwise raise with its peers waiting in the ring."""
    skel = model.skeleton
    mask_key = "decoder_attention_mask" if model.config.is_encoder_decoder else "attention_mask"
    user = list(logits_processor or [])
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
        generation_config=gc, stopping_criteria=StoppingCriteriaList(stopping_criteria or []), tokenizer=tokenizer,
    )


def _agreed_arguments(input_ids, attention_mask, generation_config, kwargs, seed, n_microbatches, logits_processor, stopping_criteria, tokenizer) -> dict[str, Any]:
    """What must be the same on every rank, for one small digest: tensors by checksum, a
    GenerationConfig by its fields, a tokenizer by its class and size, processors by their classes."""
    def plain(value):
        return value.to_dict() if isinstance(value, GenerationConfig) else value

    return {
        "input_ids": input_ids, "attention_mask": attention_mask, "seed": seed, "n_microbatches": n_microbatches,
        "generation_config": plain(generation_config), "kwargs": {k: plain(v) for k, v in kwargs.items()},
        "tokenizer": None if tokenizer is None else f"{type(tokenizer).__name__}({len(tokenizer)} tokens)",
        "logits_processor": [type(x).__name__ for x in logits_processor or []],
        "stopping_criteria": [type(x).__name__ for x in stopping_criteria or []],
    }


# --------------------------------------------------------------------------- entry point
@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    generation_config: GenerationConfig | None = None,
    streamer: Any = None,
    n_microbatches: int | None = None,
    seed: int | None = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    tokenizer: Any = None,
    return_stats: bool = False,
    **kwargs: Any,
):
    """Pipelined ``generate`` of a :class:`~hf_pipeline.model.PipelinedModel`. Collective.

    Args:
        model: the pipelined model (every rank calls this with the same arguments).
        input_ids: ``(B, T)`` prompts, left-padded for decoder-only models.
        attention_mask: ``(B, T)``; derived from ``pad_token_id`` as in transformers when omitted.
        generation_config: a ``GenerationConfig``; ``kwargs`` that are its fields override it, and the
            checkpoint's ``generation_config.json`` fills what neither sets (transformers' merging).
        streamer: ``.put(ids)`` / ``.end()`` object (e.g. ``TextStreamer``), fed on the last stage's rank.
        n_microbatches: microbatches in flight (default ``max(model.n_microbatches, num_stages)``,
            capped by the batch size); 1 is the naive pipeline without overlap.
        seed: sampling seed; each row samples from its own generator seeded from (seed, row), so the
            tokens do not depend on the number of stages or microbatches. Default: drawn from torch's
            global generator (``torch.manual_seed`` on every rank makes it reproducible).
        logits_processor / stopping_criteria / tokenizer: as transformers' ``generate``
            (``tokenizer`` is needed for ``stop_strings``).
        return_stats: also return a :class:`GenerationStats`.
        **kwargs: ``GenerationConfig`` fields: max_new_tokens, do_sample, temperature, top_k, top_p,
            repetition_penalty, eos_token_id (int or list), pad_token_id, stop_strings, ...
    Returns:
        ``(B, T + N)`` long tensor of prompt + generated ids on every rank (encoder-decoder models:
        decoder start token + generated ids), rows padded with ``pad_token_id`` after they finish;
        with ``return_stats`` a tuple ``(ids, stats)``.
    Example:
        >>> ids = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=32)
    """
    start = time.perf_counter()
    if model.check_inputs:
        # One small digest of every argument (the generation config too) before anything else: the
        # checks below then raise the same error on every rank, and no rank starts a different ring.
        check_same_on_all_ranks(
            model.ctx, "generate inputs",
            _agreed_arguments(input_ids, attention_mask, generation_config, kwargs, seed, n_microbatches, logits_processor, stopping_criteria, tokenizer),
            describe=model.rank_label,
        )
    check_generate_inputs(input_ids)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not model.config.is_encoder_decoder:
        new = kwargs.get("max_new_tokens")
        check_sequence_length(model.config, input_ids.shape[1], what="the prompt", new_tokens=new if isinstance(new, int) and not isinstance(new, bool) else 0)
    req = _prepare(model, input_ids, attention_mask, generation_config, kwargs, n_microbatches, seed, streamer, logits_processor, stopping_criteria, tokenizer)
    ring = Ring(model, req)
    ring.decode_loop()
    out = ring.result()
    if model.plan.pp_size > 1:
        out = model.runtime.broadcast_from_last(out)
    ids, lengths = out
    if model.dims.dp_size > 1:
        ids, lengths = _gather_replicas(model, ids, lengths, req.pad)
    if not return_stats:
        return ids
    stats = GenerationStats(
        new_tokens=int(lengths.sum().item()), steps=ids.shape[1] - req.prompt.shape[1], seconds=time.perf_counter() - start,
        n_microbatches=len(req.bounds), peak_cache_bytes=ring.peak, prefill_steps=len(ring.times.chunks),
    )
    return ids, stats


def _gather_replicas(model, ids: torch.Tensor, lengths: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the data-parallel replicas' rows in order, padding to the longest."""
    parts: list[Any] = [None] * model.dims.dp_size
    dist.all_gather_object(parts, (ids.cpu(), lengths.cpu()), group=model.dims.dp_group)
    width = max(p[0].shape[1] for p in parts)
    ids = torch.cat([torch.nn.functional.pad(p[0], (0, width - p[0].shape[1]), value=pad) for p in parts])
    return ids.to(model.device), torch.cat([p[1] for p in parts]).to(model.device)
