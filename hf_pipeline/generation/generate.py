"""Pipelined generation: a decode ring over the stages, per-stage KV caches, microbatches in flight.

``model.generate(input_ids, attention_mask, max_new_tokens=64)`` is collective (every rank passes the
same inputs) and returns the same ``(B, prompt + new)`` tensor on every rank, token for token what
``transformers`` ``generate(do_sample=False)`` returns on one process.

How it runs:
  * Each rank keeps the KV cache of its own layers only: one transformers ``DynamicCache`` (T5:
    ``EncoderDecoderCache``) per (local stage, microbatch), built from the config so layer indices
    are the model's global ones. Cache memory per rank is about 1/p of the whole.
  * The batch is split into ``m`` microbatches (default one per stage, ``num_stages``, at most the
    batch size; the load's ``n_microbatches`` plans training steps, not this). The prompt's hidden
    states cross each stage boundary once (prefill); every later step sends only the new token's
    hidden state. The last stage turns logits into the next token (transformers' own logits
    processors and stopping criteria, from the merged ``GenerationConfig``) and sends the token ids
    with a row-alive flag back to the first stage: a ring. With ``m >= S`` microbatches, stage k
    works on microbatch i while stage k+1 works on microbatch i-1; the pipe is never drained between tokens.
  * Finished rows (EOS, stop strings) are dropped from their microbatch's caches and inputs
    (``Cache.batch_select_indices``) on every stage, so they stop costing compute; a microbatch whose
    rows are all done leaves the ring. The output is padded with ``pad_token_id`` as transformers does.
    With experts over data-parallel ranks (``ep_over="data"``) the replicas step in lock step instead:
    finished rows stay, padded, until every replica's rows are done (``ring.py``, Note "lock step").
  * Encoder-decoder models (T5): the encoder runs once, pipelined over the encoder stages; its
    output is sent once per request to every rank holding decoder stages, which keep it (and the
    cross-attention keys/values in their ``EncoderDecoderCache``) for all decoding steps.

Note (why not torch's schedules): ``torch.distributed.pipelining`` schedules are training-step
schedules: every ``step()`` fills and drains the pipe over a fixed set of microbatches with shapes
fixed at construction. Decoding needs a loop whose input (the next token) comes from the last
stage, shapes that change after the prefill and rows that finish at different times; running a
schedule per token would pay the fill/drain bubble (p-1)/(m+p-1) on every token. So the ring below
talks ``dist.isend`` / ``dist.irecv`` itself.

Note (protocol): the ring's ticks, messages and shapes are described in :mod:`hf_pipeline.generation.timetable`,
its parts in :mod:`hf_pipeline.generation.ring`; what a call may not ask for is the table of
:mod:`hf_pipeline.generation.refusals`, checked as :mod:`hf_pipeline.generation.request` builds the request.

Note (sampling): without a ``seed``, the last stage draws every step's random numbers for the whole batch from
torch's global stream as transformers' ``generate`` draws them (``sampling.step_noise``), so sampled tokens are
transformers' on one process with the same stream, and every rank's stream ends where that process's would
(``adopt_random_state``). With ``seed``, each row samples from its own generator seeded from ``seed`` and its row
index (``sampling.row_seed``), so a seed gives the same tokens whatever the number of stages, microbatches or
replicas, and whatever the global stream.

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

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import GenerationConfig

from ..core import PipelineCore
from ..distributed.agreement import check_same_on_all_ranks
from ..distributed.exchange import adopt_random_state
from ..runtime.checks import check_sequence_length
from ..runtime.prompt_checks import check_generate_inputs
from .beam import beam_fill
from .config import generation_config, prepare_generation_config
from .outputs import build_output, pack, unpack
from .request import GenerateCall, build_request
from .ring import Ring

__all__ = ["GenerationStats", "generate", "generation_config", "prepare_generation_config"]


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
        time_split: where ``seconds`` went on this rank, in seconds: ``compute`` (its stages'
            forwards, the encoder's too), ``fill`` (blocked on messages while the pipe fills: the
            encoder, the prompt's steps and the first token's trip round the ring), ``wait``
            (blocked on messages after that: hops and stage imbalance), ``drain`` (the result's
            broadcast from the last stage, which the other ranks wait in while it finishes) and
            ``other`` (the rest: the checks, the ring's Python, choosing tokens, the caches' bookkeeping).
    """

    new_tokens: int
    steps: int
    seconds: float
    n_microbatches: int
    peak_cache_bytes: int
    prefill_steps: int = 1
    time_split: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


def _agreed_arguments(call: GenerateCall) -> dict[str, Any]:
    """What must be the same on every rank, for one small digest: tensors by checksum, a
    GenerationConfig by its fields, a tokenizer by its class and size, processors by their classes."""
    def plain(value):
        return value.to_dict() if isinstance(value, GenerationConfig) else value

    tokenizer = call.tokenizer
    return {
        "input_ids": call.input_ids, "attention_mask": call.attention_mask, "seed": call.seed,
        "n_microbatches": call.n_microbatches, "generation_config": plain(call.config),
        "kwargs": {k: plain(v) for k, v in call.kwargs.items()},
        "tokenizer": None if tokenizer is None else f"{type(tokenizer).__name__}({len(tokenizer)} tokens)",
        "logits_processor": [type(x).__name__ for x in call.logits_processor or []],
        "stopping_criteria": [type(x).__name__ for x in call.stopping_criteria or []],
    }


@torch.no_grad()
def generate(
    model: PipelineCore,
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
        n_microbatches: microbatches in flight (default: one per pipeline rank, capped by the batch size,
            whatever the load's ``n_microbatches``); 1 is the naive pipeline without overlap.
        seed: sampling seed; each row samples from its own generator seeded from (seed, row), so the
            tokens do not depend on the number of stages or microbatches. Default (None): sample from torch's
            global stream as transformers does (``torch.manual_seed`` on every rank makes it reproducible; the
            tokens are transformers' on one process after the same ``manual_seed``).
        logits_processor / stopping_criteria / tokenizer: as transformers' ``generate``
            (``tokenizer`` is needed for ``stop_strings``).
        return_stats: also return a :class:`GenerationStats`.
        **kwargs: ``GenerationConfig`` fields: max_new_tokens, do_sample, temperature, top_k, top_p,
            repetition_penalty, eos_token_id (int or list), pad_token_id, stop_strings, num_beams,
            num_return_sequences, length_penalty, early_stopping, return_dict_in_generate,
            output_scores, output_logits, ...
    Returns:
        ``(B, T + N)`` long tensor of prompt + generated ids on every rank (encoder-decoder models:
        decoder start token + generated ids), rows padded with ``pad_token_id`` after they finish
        (beam search: ``B * num_return_sequences`` rows, padded as transformers pads them); with
        ``return_dict_in_generate=True`` transformers' output object instead (see :mod:`.outputs`);
        with ``return_stats`` a tuple ``(output, stats)``.
    Example:
        >>> ids = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=32)
    """
    start = time.perf_counter()
    call = GenerateCall(
        input_ids=input_ids, attention_mask=attention_mask, config=generation_config, kwargs=kwargs,
        n_microbatches=n_microbatches, seed=seed, streamer=streamer, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, tokenizer=tokenizer,
    )
    _check_call(model, call)
    req = build_request(model, call)
    ring = Ring(model, req)
    ring.decode_loop()
    drain = time.perf_counter()
    output, ids, lengths = _collect(model, req, ring)
    if req.stream:  # the last stage drew what one process draws: every rank's stream goes on from there
        adopt_random_state(model.ctx, model.device, ring.chooser.draws if ring.chooser is not None else -1)
    if not return_stats:
        return output
    end = time.perf_counter()
    split = {**ring.seconds, "drain": end - drain}
    split["other"] = max(end - start - sum(split.values()), 0.0)
    stats = GenerationStats(
        new_tokens=int(lengths.sum().item()), steps=ids.shape[1] - req.prompt.shape[1],
        seconds=end - start, n_microbatches=len(req.bounds), peak_cache_bytes=ring.peak_cache_bytes,
        prefill_steps=len(ring.timetable.chunks), time_split=split,
    )
    return output, stats


def _check_call(model: PipelineCore, call: GenerateCall) -> None:
    """The checks before the request is built, raised alike on every rank."""
    if model.check_inputs:
        # One small digest of every argument (the generation config too) before anything else: the
        # checks below then raise the same error on every rank, and no rank starts a different ring.
        check_same_on_all_ranks(model.ctx, "generate inputs", _agreed_arguments(call), describe=model.rank_label)
    input_ids = call.input_ids
    check_generate_inputs(input_ids)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and model.config.is_encoder_decoder:
        check_sequence_length(model.config, input_ids.shape[1], what="the encoder input")  # BART: learned
    elif isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        # The max_new_tokens keyword, as given (its message names the keyword); the effective length,
        # however it is set, is checked again once the GenerationConfig is merged (request.py).
        new = call.kwargs.get("max_new_tokens")
        new = new if isinstance(new, int) and not isinstance(new, bool) else 0
        check_sequence_length(model.config, input_ids.shape[1], what="the prompt", new_tokens=new)


def _collect(model: PipelineCore, req, ring: Ring) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The last stage's result on every rank (replicas' rows gathered): (what generate returns, ids, lengths)."""
    out = ring.result()
    out = pack(out, req) if out is not None else None
    if model.plan.pp_size > 1:
        out = model.runtime.broadcast_from_last(out)
    result = unpack(out, req)
    ids, lengths = result["sequences"], result["lengths"]
    if model.dims.dp_size > 1:  # (return_dict_in_generate is refused with replicas)
        fill = req.pad if req.num_beams == 1 else beam_fill(req.config)
        ids, lengths = _gather_replicas(model, ids, lengths, fill)
        result["sequences"] = ids
    return build_output(model, req, result), ids, lengths


def _gather_replicas(model: PipelineCore, ids: torch.Tensor, lengths: torch.Tensor,
                     pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the data-parallel replicas' rows in order, padding to the longest."""
    parts: list[Any] = [None] * model.dims.dp_size
    dist.all_gather_object(parts, (ids.cpu(), lengths.cpu()), group=model.dims.dp_group)
    width = max(p[0].shape[1] for p in parts)
    ids = torch.cat([torch.nn.functional.pad(p[0], (0, width - p[0].shape[1]), value=pad) for p in parts])
    return ids.to(model.device), torch.cat([p[1] for p in parts]).to(model.device)
