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

Note (protocol): every rank computes the same timetable, so no shapes or metadata are exchanged.
Decode stage k (0 = first decode stage) runs microbatch i of step t at tick ``t*M + i + k`` with
``M = max(m, number of decode stages)``; ranks run their ops in tick order (ties: stage order) and,
at each tick, first post the receives for the messages sent at that tick, in sender-stage order,
which is the order the senders send them (so the pairing also holds on backends without tags).
A message's shape follows from the microbatch size, the step (prompt length at step 0 of a
decoder-only model, else 1) and the hidden size:
  stage -> next stage   float ``(rows, q, hidden + 1)``: hidden states, last column 1 for rows still
                        generating; all zeros once the microbatch is done (sent once, then nothing)
  last -> first stage   int64 ``(rows, 2)``: next token, still-generating flag
Sends never block (``isend``) and every receive waits only for a message sent at an earlier tick,
so the ring cannot deadlock.

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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import DynamicCache, EncoderDecoderCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from .compat import decoder_start_token_tensor, generation_helper, pad_token_tensor
from .dist import check_same_on_all_ranks
from .errors import InputError
from .log import get_logger
from .validate import check_generate_inputs, check_sequence_length, check_token_ids, vocab_size
from .sampling import left_padded_position_ids, microbatch_bounds, row_generators, select_tokens

__all__ = ["GenerationStats", "cache_nbytes", "generate", "generation_config", "prepare_generation_config"]

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
    """

    new_tokens: int
    steps: int
    seconds: float
    n_microbatches: int
    peak_cache_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


def cache_nbytes(cache: Any) -> int:
    """Bytes held by the key/value tensors of a transformers ``Cache`` (EncoderDecoderCache: both parts)."""
    if cache is None:
        return 0
    parts = (cache.self_attention_cache, cache.cross_attention_cache) if isinstance(cache, EncoderDecoderCache) else (cache,)
    total = 0
    for part in parts:
        for layer in getattr(part, "layers", ()):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


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
@dataclass(kw_only=True)
class _Request:
    """Everything every rank knows about one call, derived identically on each of them."""

    config: GenerationConfig
    encoder_decoder: bool
    prompt: torch.Tensor  # (B, T) decoder-only prompt, or (B, 1) decoder start ids
    mask: torch.Tensor | None  # decoder-only: prompt mask (None when all ones, as transformers drops it)
    positions: torch.Tensor | None  # decoder-only: (B, T) position ids
    types: torch.Tensor | None  # decoder-only: (B, T) token_type_ids of the prompt (GPT-2), if given
    enc_ids: torch.Tensor | None  # encoder-decoder: (B, T_enc) encoder input
    enc_mask: torch.Tensor | None
    bounds: list[tuple[int, int]]  # microbatch row ranges
    row_offset: int  # global index of this replica's first row (seeds)
    max_new: int
    do_sample: bool
    seed: int | None
    pad: int
    streamer: Any
    logits_processor: Any
    stopping_criteria: Any
    tokenizer: Any


def _prepare(model, input_ids, attention_mask, config, kwargs, n_microbatches, seed, streamer, logits_processor, stopping_criteria, tokenizer) -> _Request:
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
    return _Request(
        config=gc, encoder_decoder=encoder_decoder, prompt=prompt, mask=mask, positions=positions, types=types, enc_ids=enc_ids,
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


# --------------------------------------------------------------------------- the ring
@dataclass
class _Slot:
    """One (local stage, microbatch): its cache and the per-row state of the rows still generating."""

    stage: Any
    index: int
    mb: int
    rows: torch.Tensor  # microbatch-local indices of the rows in the cache, ascending
    cache: Any
    mask: torch.Tensor | None = None  # (n, L) attention mask so far (decoder-only)
    pos: torch.Tensor | None = None  # (n, q) position ids of the last step (decoder-only)
    types: torch.Tensor | None = None  # (n, q) token_type_ids of the last step (decoder-only, if given)
    enc: torch.Tensor | None = None  # (n, T_enc, H) encoder output (encoder-decoder)
    enc_mask: torch.Tensor | None = None
    done: bool = False


@dataclass
class _Sampler:
    """Last stage, one microbatch: the sequences so far and what decides the next token."""

    ids: torch.Tensor  # (n, L) every row of the microbatch, finished rows padded
    unfinished: torch.Tensor  # (n,) bool
    finished_at: torch.Tensor  # (n,) step that finished the row, -1 while generating
    processors: Any
    generators: list[torch.Generator] = field(default_factory=list)
    steps: int = 0


class _Ring:
    def __init__(self, model, req: _Request):
        self.model, self.req = model, req
        plan = model.plan
        self.plan = plan
        self.S = plan.num_stages
        gen_stack = model.resolved.stacks[-1].name
        # Decode stages hold blocks of the generating stack (all stages of a decoder-only model);
        # context stages hold blocks of earlier stacks (T5's encoder). One stage may be both.
        self.decode = [s.index for s in plan.stages if gen_stack in s.stacks]
        self.context = [s.index for s in plan.stages if any(n != gen_stack for n in s.stacks)]
        if self.decode != list(range(self.decode[0], self.S)):
            raise RuntimeError(f"the generating stack {gen_stack!r} must occupy the last stages, got stages {self.decode}")
        if bool(self.context) != req.encoder_decoder:
            raise RuntimeError("pipelined generation supports decoder-only models and encoder-decoder models with two stacks")
        self.d0 = self.decode[0]
        self.nD = len(self.decode)
        self.m = len(req.bounds)
        self.M = max(self.m, self.nD)
        self.me = model.dims.pp_rank
        self.local = {st.spec.index: st for st in model.stages}
        self.local_decode = [s for s in self.decode if s in self.local]
        text = model.config.get_text_config(decoder=True)
        self.H = int(text.hidden_size)
        self.dtype, self.device = model.dtype, model.device
        self.inbox: dict[tuple, Any] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.enc_out: dict[int, torch.Tensor] = {}
        self.peak = 0
        self.slots = {
            (s, i): _Slot(stage=self.local[s], index=s, mb=i, rows=torch.arange(hi - lo, device=self.device), cache=self._new_cache())
            for s in self.local_decode
            for i, (lo, hi) in enumerate(req.bounds)
        }
        self.is_last = (self.S - 1) in self.local
        self.samplers: dict[int, _Sampler] = {}
        if self.is_last:
            self._init_samplers()
        self.pending_step: dict[int, torch.Tensor] = {}  # streamer: step -> (B,) tokens

    # ------------------------------------------------------------ setup
    def _new_cache(self):
        # As transformers' generate: a DynamicCache built from the (decoder) config, so layer indices are the
        # model's own and each layer has its kind's cache (sliding-window layers keep only the window, as
        # DynamicSlidingWindowLayer); a stage only ever fills the layers it owns, and the glue sizes each
        # layer's mask against the cache layer of its kind.
        cfg = self.model.config.get_text_config(decoder=True)
        if self.req.encoder_decoder:
            return EncoderDecoderCache(DynamicCache(config=cfg), DynamicCache(config=cfg))
        return DynamicCache(config=cfg)

    def _init_samplers(self) -> None:
        req, skel = self.req, self.model.skeleton
        cur_len = req.prompt.shape[1]
        for i, (lo, hi) in enumerate(req.bounds):
            mask_key = "decoder_attention_mask" if req.encoder_decoder else "attention_mask"
            processors = generation_helper(skel, "_get_logits_processor")(
                generation_config=req.config, input_ids_seq_length=cur_len,
                encoder_input_ids=req.enc_ids[lo:hi] if req.enc_ids is not None else req.prompt[lo:hi],
                logits_processor=LogitsProcessorList(req.logits_processor or []),
                device=self.device, model_kwargs={mask_key: req.mask[lo:hi] if req.mask is not None else None},
            )
            n = hi - lo
            gens = row_generators(req.seed, range(req.row_offset + lo, req.row_offset + hi), self.device) if req.do_sample else []
            self.samplers[i] = _Sampler(
                ids=req.prompt[lo:hi].clone(), unfinished=torch.ones(n, dtype=torch.bool, device=self.device),
                finished_at=torch.full((n,), -1, dtype=torch.long, device=self.device), processors=processors, generators=gens,
            )
        self.stopping = generation_helper(skel, "_get_stopping_criteria")(
            generation_config=req.config, stopping_criteria=StoppingCriteriaList(req.stopping_criteria or []), tokenizer=req.tokenizer
        )

    # ------------------------------------------------------------ messages
    def _rank(self, stage: int) -> int:
        return self.plan.stages[stage].rank

    def _q(self, t: int) -> int:
        return self.req.prompt.shape[1] if t == 0 else 1

    def _rows(self, i: int) -> int:
        lo, hi = self.req.bounds[i]
        return hi - lo

    def _deliver(self, key: tuple, stage: int, tensor: torch.Tensor) -> None:
        rank = self._rank(stage)
        if rank == self.me:
            self.inbox[key] = tensor
            return
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.model.dims.global_rank(rank), group=self.model.dims.pp_group)
        self.sends.append((work, tensor))  # the buffer must live until the send completes

    def _post(self, key: tuple, src_stage: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buf, src=self.model.dims.global_rank(self._rank(src_stage)), group=self.model.dims.pp_group)
        self.inbox[key] = (work, buf)

    def _take(self, key: tuple) -> torch.Tensor:
        item = self.inbox.pop(key)
        if isinstance(item, tuple):
            work, buf = item
            work.wait()
            return buf
        return item

    def _prune_sends(self) -> None:
        if len(self.sends) > 32:
            self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    # ------------------------------------------------------------ memory
    def _observe(self) -> None:
        total = sum(cache_nbytes(s.cache) for s in self.slots.values() if s.cache is not None)
        self.peak = max(self.peak, total)

    def _release(self, slot: _Slot) -> None:
        self._observe()
        slot.cache = slot.mask = slot.pos = slot.enc = slot.enc_mask = None
        slot.done = True

    # ------------------------------------------------------------ encoder (once per request)
    def encode(self) -> None:
        """Run the context stages (T5's encoder) once, pipelined over the microbatches; tick of (s, i) = i + s."""
        req = self.req
        e = self.context[-1]
        t_enc = req.enc_ids.shape[1]
        # Ranks with decode stages other than the encoder's last stage get its output, once per microbatch.
        receivers = sorted({self._rank(s) for s in self.decode} - {self._rank(e)})
        mine = [s for s in self.context if s in self.local]
        for tick in range(self.m + e):
            for s in mine:  # receives first, in sender-stage order
                i = tick - (s - 1)
                if s > 0 and 0 <= i < self.m and self._rank(s - 1) != self.me:
                    self._post(("enc", s, i), s - 1, (self._rows(i), t_enc, self.H), self.dtype)
            i = tick - e
            if self.me in receivers and 0 <= i < self.m:
                self._post(("encout", i), e, (self._rows(i), t_enc, self.H), self.dtype)
            for s in mine:
                i = tick - s
                if not 0 <= i < self.m:
                    continue
                lo, hi = req.bounds[i]
                inputs = {"input_ids": req.enc_ids[lo:hi]}
                if req.enc_mask is not None:
                    inputs["attention_mask"] = req.enc_mask[lo:hi]
                received = () if s == 0 else (self._take(("enc", s, i)),)
                out = self.local[s](*received, **inputs)
                out = (out[0] if isinstance(out, tuple) else out).to(self.dtype)
                self._check(out, (hi - lo, t_enc, self.H), f"encoder stage {s}")
                if s < e:
                    self._deliver(("enc", s + 1, i), s + 1, out)
                else:
                    self.enc_out[i] = out
                    out = out.contiguous()
                    for r in receivers:
                        work = dist.isend(out, dst=self.model.dims.global_rank(r), group=self.model.dims.pp_group)
                        self.sends.append((work, out))
            self._prune_sends()
        for i in range(self.m):
            if ("encout", i) in self.inbox:
                self.enc_out[i] = self._take(("encout", i))
        for (s, i), slot in self.slots.items():
            lo, hi = req.bounds[i]
            slot.enc = self.enc_out[i]
            slot.enc_mask = req.enc_mask[lo:hi] if req.enc_mask is not None else None
        self.enc_out.clear()

    def _check(self, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(t.shape) != shape:
            raise RuntimeError(
                f"{what} produced shape {tuple(t.shape)} but the ring protocol expects {shape} (hidden size "
                f"{self.H} from the config); this model's stage outputs do not fit pipelined generation"
            )

    # ------------------------------------------------------------ decoding
    def decode_loop(self) -> None:
        if self.req.encoder_decoder:
            self.encode()
        if self.is_last and self.req.streamer is not None:
            self.req.streamer.put(self.req.prompt.cpu())
        limit = (self.req.max_new + 2) * self.M + self.nD  # every microbatch is done by then
        tick = 0
        while any(not slot.done for slot in self.slots.values()):
            if tick > limit:
                raise RuntimeError("pipelined generation did not finish in the expected number of ticks (protocol error)")
            self._post_decode(tick)
            for s in self.local_decode:
                t, i = divmod(tick - (s - self.d0), self.M)
                if tick - (s - self.d0) >= 0 and i < self.m and not self.slots[(s, i)].done:
                    self._op(self.slots[(s, i)], t)
            self._prune_sends()
            tick += 1
        self._observe()
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        if self.inbox:
            raise RuntimeError(f"pipelined generation ended with unconsumed messages {sorted(self.inbox)} (protocol error)")
        if self.is_last and self.req.streamer is not None:
            self.req.streamer.end()

    def _post_decode(self, tick: int) -> None:
        # Receives for the messages sent at this tick, in sender-stage order (the order they are sent in).
        for s in self.local_decode:
            k = s - self.d0
            if k == 0 or self._rank(s - 1) == self.me:
                continue
            t, i = divmod(tick - (k - 1), self.M)
            if tick - (k - 1) >= 0 and i < self.m and not self.slots[(s, i)].done:
                self._post(("h", s, i), s - 1, (self._rows(i), self._q(t), self.H + 1), self.dtype)
        if self.d0 in self.local and self._rank(self.S - 1) != self.me:
            t, i = divmod(tick - (self.nD - 1), self.M)
            if tick - (self.nD - 1) >= 0 and i < self.m and not self.slots[(self.d0, i)].done:
                self._post(("tok", i), self.S - 1, (self._rows(i), 2), torch.long)

    def _op(self, slot: _Slot, t: int) -> None:
        req, s, i = self.req, slot.index, slot.mb
        lo, hi = req.bounds[i]
        n = hi - lo
        first, last = s == self.d0, s == self.S - 1
        if first:
            if t == 0:
                msg, alive = None, torch.ones(n, dtype=torch.bool, device=self.device)
            else:
                msg = self._take(("tok", i))  # (n, 2): token, still generating
                alive = msg[:, 1].bool()
        else:
            msg = self._take(("h", s, i))  # (n, q, H + 1)
            alive = msg[:, 0, -1] > 0.5
        if not bool(alive.any()):
            # The microbatch is done: pass the news down the ring once, free the cache.
            self._release(slot)
            if not last:
                self._deliver(("h", s + 1, i), s + 1, torch.zeros(n, self._q(t), self.H + 1, dtype=self.dtype, device=self.device))
            else:
                self._stream(i, t)
            return
        live = alive.nonzero()[:, 0]
        if live.numel() < slot.rows.numel():
            self._compact(slot, live)

        inputs: dict[str, Any] = {"cache": slot.cache}
        if req.encoder_decoder:
            ids_key = "decoder_input_ids"
            inputs["encoder_outputs"] = slot.enc
            if slot.enc_mask is not None:
                inputs["attention_mask"] = slot.enc_mask
        else:
            ids_key = "input_ids"
            if t == 0:
                slot.mask = req.mask[lo:hi] if req.mask is not None else None
                slot.pos = req.positions[lo:hi]
                slot.types = req.types[lo:hi] if req.types is not None else None
            else:
                if slot.mask is not None:
                    slot.mask = torch.cat([slot.mask, slot.mask.new_ones(slot.mask.shape[0], 1)], dim=1)
                slot.pos = slot.pos[:, -1:] + 1
                slot.types = slot.types[:, -1:] if slot.types is not None else None
            inputs["attention_mask"] = slot.mask
            inputs["position_ids"] = slot.pos
            if slot.types is not None:
                inputs["token_type_ids"] = slot.types
        if first:
            inputs[ids_key] = req.prompt[lo:hi] if t == 0 else msg[live, 0].unsqueeze(1)
            received: tuple = ()
        else:
            received = (msg[live, :, : self.H],)
        if last:
            inputs["logits_to_keep"] = 1
        out = slot.stage(*received, **inputs)
        # After every step: the rank's caches peak when its slowest stage has appended a step's
        # keys and values while its other stages have not yet released theirs.
        self._observe()
        out = out[0] if isinstance(out, tuple) else out  # in decoding only the hidden state flows on
        if last:
            self._deliver(("tok", i), self.d0, self._choose(i, t, live, out[:, -1, :]))
            self._stream(i, t)
            return
        q = self._q(t)
        self._check(out, (live.numel(), q, self.H), f"stage {s}")
        nxt = torch.zeros(n, q, self.H + 1, dtype=self.dtype, device=self.device)
        nxt[live, :, : self.H] = out.to(self.dtype)
        nxt[live, :, self.H] = 1
        self._deliver(("h", s + 1, i), s + 1, nxt)

    def _compact(self, slot: _Slot, live: torch.Tensor) -> None:
        """Drop finished rows from this stage's cache and per-row inputs."""
        self._observe()
        keep = torch.searchsorted(slot.rows, live)
        slot.cache.batch_select_indices(keep)
        for name in ("mask", "pos", "types", "enc", "enc_mask"):
            value = getattr(slot, name)
            if value is not None:
                setattr(slot, name, value[keep])
        slot.rows = live

    def _choose(self, i: int, t: int, live: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Last stage: processors + greedy/sampling + stopping criteria, in transformers' order."""
        st, req = self.samplers[i], self.req
        n = st.ids.shape[0]
        # Processors see the microbatch in transformers' shape (finished rows included, as there).
        scores = torch.zeros(n, logits.shape[-1], dtype=torch.float32, device=self.device)
        scores[live] = logits.float()
        scores = st.processors(st.ids, scores)
        gens = [st.generators[j] for j in live.tolist()] if req.do_sample else None
        chosen = select_tokens(scores[live], do_sample=req.do_sample, generators=gens)
        tokens = torch.full((n,), req.pad, dtype=torch.long, device=self.device)
        tokens[live] = chosen
        st.ids = torch.cat([st.ids, tokens[:, None]], dim=1)
        stop = self.stopping(st.ids, None).to(self.device)
        st.finished_at[st.unfinished & stop] = t
        st.unfinished &= ~stop
        st.steps = t + 1
        if req.streamer is not None:
            lo, hi = req.bounds[i]
            step = self.pending_step.setdefault(t, torch.full((req.prompt.shape[0],), req.pad, dtype=torch.long))
            step[lo:hi] = tokens.cpu()
        return torch.stack([tokens, st.unfinished.long()], dim=1)  # (n, 2)

    def _stream(self, i: int, t: int) -> None:
        # Flush step t once no microbatch after i can still add a token to it.
        if self.req.streamer is None or t not in self.pending_step:
            return
        if any(not self.slots[(self.S - 1, j)].done for j in range(i + 1, self.m)):
            return
        self.req.streamer.put(self.pending_step.pop(t))

    # ------------------------------------------------------------ result
    def result(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Last stage's rank: (ids (B, L + steps), generated lengths (B,)); None elsewhere."""
        if not self.is_last:
            return None
        steps = max(st.steps for st in self.samplers.values())
        width = self.req.prompt.shape[1] + steps
        ids, lengths = [], []
        for st in self.samplers.values():
            pad = width - st.ids.shape[1]
            ids.append(torch.nn.functional.pad(st.ids, (0, pad), value=self.req.pad) if pad else st.ids)
            lengths.append(torch.where(st.finished_at >= 0, st.finished_at + 1, torch.full_like(st.finished_at, st.steps)))
        return torch.cat(ids), torch.cat(lengths)


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
    ring = _Ring(model, req)
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
        n_microbatches=len(req.bounds), peak_cache_bytes=ring.peak,
    )
    return ids, stats


def _gather_replicas(model, ids: torch.Tensor, lengths: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the data-parallel replicas' rows in order, padding to the longest."""
    parts: list[Any] = [None] * model.dims.dp_size
    dist.all_gather_object(parts, (ids.cpu(), lengths.cpu()), group=model.dims.dp_group)
    width = max(p[0].shape[1] for p in parts)
    ids = torch.cat([torch.nn.functional.pad(p[0], (0, width - p[0].shape[1]), value=pad) for p in parts])
    return ids.to(model.device), torch.cat([p[1] for p in parts]).to(model.device)
