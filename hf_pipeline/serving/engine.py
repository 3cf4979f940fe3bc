"""The serving engine: a request queue on rank 0, continuous batching in the decode ring or static rounds.

Every rank runs :meth:`Engine.serve_forever` (or :meth:`Engine.step` in a loop).

``batching="continuous"`` (the default): when requests wait, rank 0 broadcasts a ``ring`` plan and
every rank enters the long-lived decode ring of :mod:`hf_pipeline.continuous_batching.continuous_ring`; requests
join free slots between steps as others finish, each with its own prompt, ``max_new_tokens``, stop
criteria and sampling parameters, and the tokens reach each :class:`~hf_pipeline.serving.handles.Handle`
as they come (:mod:`hf_pipeline.continuous_batching.feeder` is rank 0's side, within the slot pool of
:mod:`hf_pipeline.continuous_batching.kv_budget`). The ring ends once a whole step ran no row and
nothing is queued. A prompt longer than ``prefill_chunk`` tokens (default 512) joins in chunks beside
the decoding rows, one chunk per step (:mod:`hf_pipeline.continuous_batching.prefill_plan`), and
prompt heads shared with earlier requests are copied from each stage's prefix cache instead of
computed (``prefix_cache``; :mod:`hf_pipeline.continuous_batching.prefix_cache`; not for sliding-window
caches: ``engine.prefix_reason``). Stages over several tensor- or expert-parallel ranks run the ring too (stage 0's
lead plans, its tp group gets the plan by broadcast), and so do several stages per rank (interleaved
and V layouts: a rank runs its stages in turn) and data-parallel replicas (each its own ring of
``max_batch`` rows, all planned by rank 0; FSDP-sharded stages too, gathered once per ring), and
encoder-decoder models (T5: each prompt runs whole through the encoder as its row joins;
:mod:`hf_pipeline.continuous_batching.encoder_decoder_stage`). Models the ring does not serve fall back
to static rounds (``engine.batching`` then says ``"static"`` and ``engine.static_reason`` why): cache
layers other than full and sliding-window attention (chunked attention:
:mod:`hf_pipeline.continuous_batching.group_cache`).

``batching="static"``: each round rank 0 takes a batch from its queue
(:class:`~hf_pipeline.serving.scheduler.StaticBatcher`), broadcasts its plan as JSON, and every rank
runs the model's collective ``generate`` on it; the tokens stream back to rank 0 step by step
(:class:`~hf_pipeline.serving.channel.TokenChannel`) into each request's handle; a round lasts as
long as its longest row. When idle, rank 0 still broadcasts an empty plan every
``idle_s`` seconds, so the other ranks never sit in one collective longer than the process group's
timeout. :meth:`Engine.drain` refuses new requests, serves the queued ones and then stops every rank.

Example (every rank; ``torchrun --nproc_per_node 2 script.py``):
    >>> engine = Engine(model, tok)
    >>> def client():                                  # rank 0, any thread
    ...     print(engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=16)).result())
    ...     engine.drain()                             # serve what is queued, then stop every rank
    >>> if model.ctx.rank == 0:
    ...     threading.Thread(target=client).start()
    >>> engine.serve_forever()
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
from collections import deque
from typing import Any

import torch

from ..continuous_batching.continuous_ring import ContinuousRing, continuous_refusal
from ..continuous_batching.feeder import RingFeeder
from ..continuous_batching.kv_budget import pool_rows, prefix_blocks
from ..continuous_batching.prefix_cache import RingPrefix, prefix_refusal
from ..continuous_batching.ring_times import RingTimes
from ..core import PipelineCore
from ..errors import InputError, PipelineError, ServerBusy, ServingRequestError, UsageError
from ..generation.config import generation_config
from ..generation.grammar import GrammarProcessor, GrammarTokenizer
from ..generation.logprobs import TokenLogprob
from ..log import get_logger
from .channel import TokenChannel, broadcast_json
from .handles import Choice, CompletionRequest, Handle
from .scheduler import RoundPlan, StaticBatcher

__all__ = ["Engine"]

log = get_logger(__name__)


def _eos_ids(model: PipelineCore) -> set[int]:
    eos = generation_config(model).eos_token_id
    return set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


# What only the continuous ring serves (static rounds share one generate call's settings and return no logprobs).
_RING_ONLY = {
    "ignore_eos": lambda r: r.ignore_eos,
    "min_tokens": lambda r: r.min_tokens > 0,
    "logprobs": lambda r: r.logprobs is not None,
    "echo": lambda r: r.echo,
    "presence_penalty": lambda r: r.presence_penalty != 0,
    "frequency_penalty": lambda r: r.frequency_penalty != 0,
    "repetition_penalty": lambda r: r.repetition_penalty != 1,
    "logit_bias": lambda r: bool(r.logit_bias),
}


class _ChoiceWriter:
    """Appends one row's tokens to one choice: ends it at a stop id (EOS or the request's), at a
    stop string (the text is cut before it) or at its own ``max_new_tokens``; until then it holds
    back a text tail that may still become a stop string, or an incomplete character."""

    def __init__(self, handle: Handle, index: int, tokenizer: Any, stop_ids: set[int]):
        self.handle, self.index, self.tokenizer, self.stop_ids = handle, index, tokenizer, stop_ids
        self.seen = 0  # tokens of the row consumed (the stop token included)

    def _text(self, ids: list[int]) -> tuple[str, bool]:
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        found = [i for i in (text.find(s) for s in self.handle.request.stop) if i >= 0]
        return (text[: min(found)], True) if found else (text, False)

    def add(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append ``tokens`` (and, when the request asked for them, their ``logprobs``, one each)."""
        def write(choices: list[Choice]) -> None:
            c = choices[self.index]
            limit = self.handle.request.max_new_tokens
            for k, t in enumerate(tokens):
                if c.finish_reason is not None:
                    return
                if limit == 0:  # echo alone: the ring's one token is not part of the answer
                    c.finish_reason = "length"
                    return
                self.seen += 1
                c.completion_tokens = self.seen  # the stop token counts, as in OpenAI's usage
                if logprobs is not None:
                    c.logprobs.append(logprobs[k])
                if t in self.stop_ids:
                    c.finish_reason = "stop"
                else:
                    c.token_ids.append(t)
                text, stopped = self._text(c.token_ids)
                if stopped:
                    c.finish_reason = "stop"
                elif c.finish_reason is None and len(c.token_ids) >= limit:
                    c.finish_reason = "length"
                c.text = text if c.finish_reason else text[: len(text) - self._held(text)]
        self.handle.update(write)

    def prompt(self, logprobs: list[TokenLogprob]) -> None:
        """The prompt's token log-probabilities (``echo``), before the first token."""
        def write(choices: list[Choice]) -> None:
            choices[self.index].prompt_logprobs = logprobs
        self.handle.update(write)

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` a reader must not see yet: an incomplete multi-byte character
        (U+FFFD until its next bytes come) and, before it, a tail that may still become a stop string.

        Note: only the tail is held. A reader's delta is the visible text past what it has seen (by length),
        so the visible text must only grow: holding the whole text back made the next delta resend it all."""
        body = text.rstrip("\ufffd")
        stop = max((k for s in self.handle.request.stop for k in range(1, len(s)) if body.endswith(s[:k])), default=0)
        return len(text) - len(body) + stop

    def finish(self, row: list[int]) -> None:
        """The round is over: take what the stream missed from the final ``row`` and end the choice."""
        self.add(row[self.seen:])

        def end(choices: list[Choice]) -> None:
            c = choices[self.index]
            if c.finish_reason is None:
                text, _ = self._text(c.token_ids)
                full = len(c.token_ids) >= self.handle.request.max_new_tokens
                c.text, c.finish_reason = text, "length" if full else "stop"
        self.handle.update(end)


class Engine:
    """Serves completion requests with a pipelined model; runs on every rank.

    Args:
        model: a pipelined causal LM (``hf_pipeline.AutoModelForCausalLM.from_pretrained(..., pipeline=True)``).
        tokenizer: its tokenizer (text, stop strings); needed on every rank when requests use ``stop``.
        max_batch: rows in flight (continuous: per data-parallel replica) or per round (static) at most.
        max_queue: queued rows at most (a request with ``n`` choices is ``n`` rows); :meth:`submit` raises
            :class:`ServerBusy` beyond it.
        max_n: choices per request at most (``n``); more is refused (:class:`ServingRequestError`).
        idle_s: how long rank 0 waits for a request before an empty round.
        batching: ``"continuous"`` (rows join the running ring as others leave) or ``"static"`` (rounds
            of one ``generate`` call each); models the ring does not serve run static rounds.
        kv_cache_bytes: continuous only: KV-cache memory per rank for the slot pool; rows that would
            not fit (a full-context row on the most loaded rank each) wait in the queue. None: ``max_batch``.
            What the pool leaves is the prefix cache's.
        prefill_chunk: continuous only: prompt tokens one op of a group runs at most beside its decoding rows
            (chunked prefill: a longer prompt joins over several steps); None or 0: whole prompts at once.
            An encoder-decoder's prompts always run whole (its encoder attends both ways).
        prefix_cache: continuous only: reuse cached prompt heads (blocks of ``prefix_block`` tokens, kept per
            stage within the KV budget, least recently used evicted); off for sliding-window and chunked
            attention caches and encoder-decoders (``prefix_reason`` says why).

    Attributes:
        batching: the batching in use; ``static_reason`` says why static when continuous was asked for.
        rounds: rounds run (static ``generate`` calls or continuous ring sessions), alike on every rank.
        decode_steps: ring steps run over all rounds (static: each round's longest row; continuous:
            steps in which some row ran), alike on every rank.
        prefill_chunks / prefix_hits / prefix_tokens: rank 0, continuous: row ops that ran part of a prompt
            split over several ops; rows that reused a cached prefix, and its tokens.
        reused_tokens: continuous: prompt tokens this rank's stages copied from their prefix caches.
        prefill_ops / prefill_forwards / peak_stacked: continuous, this rank's stages: ops with joining rows, the
            forwards they ran (one an op but on sliding-window caches), the most rows with a past one forward ran.
        ring_times: continuous: this rank's seconds in the rings' forwards (decode, prefill), waiting, in all.
    """

    @property
    def ctx(self):
        # Read from the model each time: after a failure inside a stage the model's groups are made afresh.
        return self.model.ctx

    def __init__(self, model: PipelineCore, tokenizer: Any = None, *, max_batch: int = 8, max_queue: int = 64,
                 max_n: int = 16, idle_s: float = 0.5,
                 batching: str = "continuous", kv_cache_bytes: int | None = None, prefill_chunk: int | None = 512,
                 prefix_cache: bool = True, prefix_block: int = 16):
        self.model, self.tokenizer = model, tokenizer
        for name, value in (("max_queue", max_queue), ("max_n", max_n), ("prefix_block", prefix_block)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a whole number >= 1, got {value!r}")
        context = getattr(model.config, "max_position_embeddings", None)
        self.batcher = StaticBatcher(max_rows=max_batch, context=context)
        if batching not in ("continuous", "static"):
            raise InputError(f"batching must be 'continuous' or 'static', got {batching!r}")
        self.static_reason = continuous_refusal(model) if batching == "continuous" else None
        self.batching = "static" if batching == "static" or self.static_reason else "continuous"
        if self.static_reason:
            log.info("serving in static rounds: %s", self.static_reason)
        self.pool = pool_rows(model, max_batch=max_batch, kv_cache_bytes=kv_cache_bytes, context=context)
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 0):
            raise InputError(f"prefill_chunk must be a whole number of tokens >= 0 (0 or None: whole prompts), "
                             f"got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk or None
        self.prefix_reason = ("turned off" if not prefix_cache else "static rounds" if self.batching == "static"
                              else prefix_refusal(model.config))
        blocks = prefix_blocks(model, block=prefix_block, pool=self.pool, kv_cache_bytes=kv_cache_bytes,
                               context=context)
        if not self.prefix_reason and not blocks:
            self.prefix_reason = "kv_cache_bytes leaves no room beside the pool's full-context rows"
        self.prefix = None if self.prefix_reason else RingPrefix(block=prefix_block, capacity=blocks)
        self.prefill_chunks = self.prefix_hits = self.prefix_tokens = self.reused_tokens = 0
        self.prefill_ops = self.prefill_forwards = self.peak_stacked = 0
        self.decode_steps = self.forwards = 0  # forwards: continuous, this rank's stage forward calls
        self.ring_times = RingTimes()  # continuous: where this rank's time in the rings went
        self.peak_cache_bytes = 0  # continuous: the largest KV cache this rank held (the pool bounds it)
        self.peak_rows = 0  # continuous, rank 0: the most rows in flight at once
        self.context, self.max_queue, self.max_n, self.idle_s = context, max_queue, max_n, idle_s
        self.eos = _eos_ids(model)
        # response_format: the tokenizer compiled for llguidance once per engine (first use: it walks the vocabulary).
        vocab = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
        self.grammars = None if tokenizer is None else GrammarTokenizer(tokenizer, sorted(self.eos), vocab_size=vocab)
        pad = generation_config(model).pad_token_id
        self.pad = int(pad) if pad is not None else (min(self.eos) if self.eos else 0)
        self._queue: deque[Handle] = deque()
        self._lock = threading.Lock()
        self._wake: queue.Queue[None] = queue.Queue()
        self._ids = itertools.count()
        self.rounds = 0  # rounds run (generate calls), counted alike on every rank
        self._rng = random.Random()
        self.draining = False
        self.stopped = False
        self.running: list[Handle] = []

    # -------------------------------------------------------------- rank 0: requests in
    @property
    def queued(self) -> int:
        with self._lock:
            return sum(not h.done for h in self._queue)

    def next_request(self) -> tuple[Handle, int | None] | None:
        """Rank 0, for the continuous ring's feeder: the oldest queued request not cancelled, now running, with
        the seed of its sampled rows (None when greedy; drawn here when the request names none). None when
        nothing waits."""
        with self._lock:
            while self._queue:
                handle = self._queue.popleft()
                if handle.done:
                    continue
                req = handle.request
                seed = None if req.greedy else (req.seed if req.seed is not None else self._rng.randrange(2**31))
                self.running.append(handle)
                return handle, seed
        return None

    def check(self, req: CompletionRequest) -> None:
        """Refuse what no round could serve: more choices than ``max_n`` (or than the queue holds), a prompt
        too long for the context, a token outside the vocabulary."""
        if req.n > self.max_n:
            raise ServingRequestError(f"n={req.n} is more choices than this server makes per request "
                                      f"({self.max_n}, --max-n); ask for fewer", param="n")
        if req.n > self.max_queue:
            raise ServingRequestError(f"n={req.n} is more rows than the queue holds ({self.max_queue}, --max-queue); "
                                      "ask for fewer choices", param="n")
        vocab = getattr(self.model.config, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in req.prompt_ids):
            raise ServingRequestError(f"the prompt holds token ids outside the vocabulary (0..{vocab - 1})",
                                      param="prompt")
        if vocab is not None and any(not 0 <= t < vocab for t in req.logit_bias):
            raise ServingRequestError(f"logit_bias names token ids outside the vocabulary (0..{vocab - 1})",
                                      param="logit_bias")
        if self.context is not None and len(req.prompt_ids) + req.max_new_tokens > self.context:
            raise ServingRequestError(
                f"the prompt ({len(req.prompt_ids)} tokens) plus max_tokens ({req.max_new_tokens}) exceeds the "
                f"model's context of {self.context} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens" if len(req.prompt_ids) < self.context else "prompt",
            )
        if req.stop and self.tokenizer is None:
            raise ServingRequestError("stop strings need the engine's tokenizer", param="stop")
        if req.grammar is not None:
            self._check_grammar(req.grammar)
        if req.echo and self.model.config.is_encoder_decoder:
            raise ServingRequestError("echo answers the prompt's log-probabilities, which an encoder-decoder model "
                                      "does not compute (its prompt is the encoder's input); leave echo out",
                                      param="echo")
        if self.batching == "static":
            for param, asks in _RING_ONLY.items():
                if asks(req):
                    raise ServingRequestError(
                        f"{param} needs continuous batching (each row's own logits processors and "
                        "log-probabilities); this server runs static rounds "
                        f"({self.static_reason or '--batching static'}); leave {param} out", param=param)

    def _check_grammar(self, grammar: str) -> None:
        """A grammar this engine's tokenizer compiles (here, before the request is queued, not on the last stage)."""
        if self.grammars is None:
            raise ServingRequestError("response_format needs the engine's tokenizer", param="response_format")
        try:
            self.grammars.matcher(grammar)
        except (InputError, ValueError) as e:
            raise ServingRequestError(str(e), param="response_format") from None

    def submit(self, req: CompletionRequest) -> Handle:
        """Queue ``req`` (rank 0 only; thread-safe).

        Returns:
            Its :class:`Handle`.
        Raises:
            ServingRequestError: the request cannot be served (its ``param`` names the field).
            ServerBusy: the queue is full, or the engine is draining (``draining``).
        """
        self.check(req)
        with self._lock:
            if self.draining or self.stopped:
                raise ServerBusy("the server is shutting down; retry on another replica", draining=True)
            # Rows, not requests: a request with n choices takes n rows of the rounds it waits for.
            if sum(h.request.n for h in self._queue if not h.done) + req.n > self.max_queue:
                raise ServerBusy(f"the request queue is full ({self.max_queue} rows waiting at most, a request "
                                 "with n choices taking n); retry later")
            handle = Handle(req, f"cmpl-{next(self._ids)}")
            self._queue.append(handle)
        self._wake.put(None)
        return handle

    def stop_ids(self, req: CompletionRequest) -> set[int]:
        """The token ids that end a choice of ``req``: EOS (unless ``ignore_eos``) and its ``stop_token_ids``."""
        return (set() if req.ignore_eos else set(self.eos)) | set(req.stop_token_ids)

    def drain(self) -> None:
        """Refuse new requests, serve the queued ones, then stop every rank (safe from a signal handler)."""
        self.draining = True
        self._wake.put(None)

    # -------------------------------------------------------------- every rank: rounds
    def _next_plan(self) -> dict[str, Any]:
        """Rank 0: the next round's plan (waits up to ``idle_s`` for a request)."""
        if self.batching == "continuous":
            with self._lock:
                while self._queue and self._queue[0].done:
                    self._queue.popleft()
                batch = list(self._queue)[:1]
            if batch:
                return {"op": "ring"}
        with self._lock:
            batch = self.batcher.take(self._queue) if self.batching == "static" else []
        if not batch:
            if self.draining:
                return {"op": "stop"}
            try:
                self._wake.get(timeout=self.idle_s)
            except queue.Empty:
                pass
            return {"op": "idle"}
        self.running = batch
        return {"op": "round", "plan": RoundPlan.of(self.rounds, batch, self._rng).to_json()}

    def step(self) -> bool:
        """One round on every rank (collective). Returns False once the engine has stopped."""
        msg = broadcast_json(self.ctx, self._next_plan() if self.ctx.rank == 0 else None)
        if msg["op"] == "stop":
            self.stopped = True
            return False
        if msg["op"] == "error":
            self.stopped = True
            raise UsageError(msg["message"])
        if msg["op"] == "ring":
            self.rounds += 1
            self._run_ring()
        if msg["op"] == "round":
            self.rounds += 1
            start = time.perf_counter()
            plan = RoundPlan(**msg["plan"])
            self._run_round(plan)
            log.debug("round %d: %d rows, %d new tokens at most, %.3f s", plan.round_id, len(plan.rows),
                      plan.max_new_tokens, time.perf_counter() - start)
        return True

    def serve_forever(self) -> None:
        """Run rounds until :meth:`drain` (on rank 0) has served the queue. Collective."""
        while self.step():
            pass

    def stop_with_error(self, message: str) -> None:
        """Rank 0, before the first round: make every rank raise ``message`` (say, the port is taken)."""
        broadcast_json(self.ctx, {"op": "error", "message": message})
        self.stopped = True

    def _writers(self, plan: RoundPlan) -> list[_ChoiceWriter]:
        stop_ids = self.eos | set(plan.stop_token_ids)
        return [_ChoiceWriter(h, i, self.tokenizer, stop_ids) for h in self.running for i in range(h.request.n)]

    def _generate_kwargs(self, plan: RoundPlan) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_new_tokens": plan.max_new_tokens, "pad_token_id": self.pad, "seed": plan.seed}
        if plan.temperature > 0:
            kw.update(do_sample=True, temperature=plan.temperature, top_p=plan.top_p)
        else:
            kw.update(do_sample=False)
        if plan.stop_token_ids:
            kw["eos_token_id"] = sorted(self.eos | set(plan.stop_token_ids))
        if plan.stop:
            kw.update(stop_strings=list(plan.stop), tokenizer=self.tokenizer)
        if plan.grammar is not None:  # every row is left padded to the longest prompt: the grammar starts after it
            width = max(len(r) for r in plan.rows)
            kw["logits_processor"] = [GrammarProcessor(self.grammars, plan.grammar, prompt_length=width)]
        return kw

    def _run_round(self, plan: RoundPlan) -> None:
        """Every rank: left-pad the rows, run ``generate``, and on rank 0 hand each choice its tokens."""
        width = max(len(r) for r in plan.rows)
        ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in plan.rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in plan.rows], dtype=torch.long)
        writers = self._writers(plan) if self.ctx.rank == 0 else []

        def deliver(step: int, tokens: list[int]) -> None:
            for w, t in zip(writers, tokens):
                if w.seen == step:  # each choice takes each step once, in order
                    w.add([t])

        # Replicas (dp > 1) each choose their own rows' tokens: no per-step stream, the final ids only.
        streams = plan.stream and self.model.dims.dp_size == 1
        writes = self.model.dims.tp_rank == 0  # one of a stage's tensor- / expert-parallel ranks
        channel = TokenChannel(self.ctx, plan.round_id, deliver, writes=writes) if streams else None
        if channel is not None:
            channel.start_reader()
        try:
            out, stats = self.model.generate(input_ids=ids, attention_mask=mask, streamer=channel,
                                             return_stats=True, **self._generate_kwargs(plan))
            self.decode_steps += stats.steps
        except PipelineError as e:
            # Every rank raised the same error (generate agrees on its inputs first): fail the batch, serve on.
            out = None
            for h in self.running:
                h.fail(str(e))
        finally:
            if channel is not None:
                channel.close()
            self.running = []
        if out is not None:
            for w, row in zip(writers, out[:, width:].tolist()):
                w.finish(row)

    def _ring_shape(self) -> tuple[int, int]:
        """(groups, slots per group): one group per pipeline rank fills the pipe (one per stage would read every
        weight of a rank holding several stages twice per token); the pool's rows shared out."""
        groups = self.model.plan.pp_size
        return groups, -(-self.pool // groups)

    def _run_ring(self) -> None:
        """Every rank: the continuous ring until it runs dry; a failure inside it fails the requests it held."""
        groups, size = self._ring_shape()
        # Each data-parallel replica runs a ring of its own pool's rows (rank 0 plans them all).
        feeder = RingFeeder(self, self.pool * self.model.dims.dp_size, _ChoiceWriter) if self.ctx.rank == 0 else None
        ring = ContinuousRing(self.model, groups=groups, group_size=size, feeder=feeder, grammars=self.grammars,
                              prefill_chunk=self.prefill_chunk, prefix=self.prefix)
        try:
            with self.model.spreading_failures("serving (continuous batching)"):
                ring.run()
        except PipelineError as e:
            log.warning("the continuous ring failed: %s", e)
            if feeder is not None:
                feeder.fail_all(str(e))
            if self.prefix is not None:
                self.prefix.clear()  # the stages' caches and rank 0's index may no longer agree
        finally:
            self.running = []
        self.decode_steps += broadcast_json(self.ctx, ring.steps if self.ctx.rank == 0 else None)
        self.forwards += ring.forwards
        self.ring_times += ring.times
        self.reused_tokens += ring.reused_tokens
        ops, forwards, stacked = ring.prefill
        self.prefill_ops, self.prefill_forwards = self.prefill_ops + ops, self.prefill_forwards + forwards
        self.peak_stacked = max(self.peak_stacked, stacked)
        p = ring.planner
        self.prefill_chunks, self.prefix_hits, self.prefix_tokens = (
            self.prefill_chunks + p.chunks, self.prefix_hits + p.prefix_hits, self.prefix_tokens + p.reused_tokens)
        self.peak_cache_bytes = max(self.peak_cache_bytes, ring.peak_cache_bytes)
        if feeder is not None:
            self.peak_rows = max(self.peak_rows, feeder.peak_rows)
