"""The decode ring of pipelined generation, in four parts and the loop that joins them.

``generate.py`` prepares a :class:`Request` (the same on every rank); :class:`Ring` runs it:

  * :class:`Timetable` — pure arithmetic, identical on every rank: which (step, microbatch) a decode
    stage runs at a tick, the encoder's ticks, message shapes. No rank ever sends metadata.
  * :class:`Mailbox` — the point-to-point messages: non-blocking sends kept alive until done,
    receives posted ahead and waited for when taken, same-rank deliveries without copies.
  * :class:`TokenChooser` — the last stage's part: transformers' logits processors, greedy or
    seeded sampling, stopping criteria, the sequences so far and where each row finished.
  * :class:`StepStreamer` — feeds a transformers streamer one ``(B,)`` tensor per step, in order,
    once every microbatch has its token for that step.
  * :class:`Ring` — per (local stage, microbatch) caches and row state; the encoder pass (once per
    request) and the decode loop over ticks.

Note (protocol): decode stage k (0 = first decode stage) runs microbatch i of step t at tick
``t*M + i + k`` with ``M = max(m, number of decode stages)``; ranks run their ops in tick order
(ties: stage order) and, at each tick, first post the receives for the messages sent at that
tick, in sender-stage order, which is the order the senders send them (so the pairing also holds
on backends without tags). A decoder-only prompt may be fed in chunks (``prefill_chunk_size`` of
the generation config, as transformers' chunked prefill): its C chunks are steps 0..C-1, the last
of which chooses the first new token, so the ring fills with C x m units of work instead of m (a
pipeline's prefill idles (p - 1) / (units + p - 1) of its time). Message shapes follow from the
microbatch size, the step (a prompt chunk's length at a prefill step, else 1) and the hidden size:
  stage -> next stage   float ``(rows, q, hidden + 1)``: hidden states, last column 1 for rows still
                        generating; all zeros once the microbatch is done (sent once, then nothing)
  last -> first stage   int64 ``(rows, 2)``: next token, still-generating flag
Sends never block (``isend``) and every receive waits only for a message sent at an earlier tick,
so the ring cannot deadlock.

Example (inside ``generate``):
    >>> ring = Ring(model, request)
    >>> ring.decode_loop()
    >>> ids, lengths = ring.result()          # on the last stage's rank; None elsewhere
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from transformers import DynamicCache, EncoderDecoderCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..compat import generation_helper
from .sampling import row_generators, select_tokens

__all__ = ["Mailbox", "Request", "Ring", "Timetable", "cache_nbytes"]


def cache_nbytes(cache: Any) -> int:
    """Bytes allocated for the key/value tensors of a transformers ``Cache`` (EncoderDecoderCache: both parts).

    Storage bytes, each storage once, not ``numel``: a sliding-window layer keeps a view of the last
    ``window - 1`` positions into the ``window``-position tensor its update made, and the memory
    held is the whole tensor's.
    """
    if cache is None:
        return 0
    parts = (cache.self_attention_cache, cache.cross_attention_cache) if isinstance(cache, EncoderDecoderCache) else (cache,)
    seen: dict[int, int] = {}
    for part in parts:
        for layer in getattr(part, "layers", ()):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor) and t.numel():
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


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
    max_new: int
    do_sample: bool
    seed: int | None
    pad: int
    streamer: Any
    logits_processor: Any
    stopping_criteria: Any
    tokenizer: Any


# --------------------------------------------------------------------------- timetable
@dataclass(frozen=True, kw_only=True)
class Timetable:
    """When each stage runs what, the same on every rank.

    Attributes:
        first_decode: index of the first decode stage (0 for decoder-only models).
        n_decode: number of decode stages (they are the last ones).
        bounds: microbatch row ranges.
        prompt_len: decoder prompt length.
        max_new: most new tokens any row may get.
        prefill_chunk: the prompt's positions per prefill step (None: the whole prompt at step 0).
            Prefill steps send their chunk's positions, later steps 1.
    """

    first_decode: int
    n_decode: int
    bounds: tuple[tuple[int, int], ...]
    prompt_len: int
    max_new: int
    prefill_chunk: int | None = None

    def __post_init__(self):
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 positions, got {self.prefill_chunk}")

    @functools.cached_property  # read at every op of the ring: computed once per request
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """The prompt's (start, end) positions fed at each prefill step, in order."""
        size = self.prefill_chunk or self.prompt_len
        return tuple((a, min(a + size, self.prompt_len)) for a in range(0, self.prompt_len, size))

    @property
    def first_token_step(self) -> int:
        """The step that chooses the first new token: the last prefill step."""
        return len(self.chunks) - 1

    @property
    def m(self) -> int:
        return len(self.bounds)

    @property
    def period(self) -> int:
        """Ticks per decoding step, ``M = max(m, decode stages)``: with fewer microbatches than
        stages the ring waits for a token to come round before the next step."""
        return max(self.m, self.n_decode)

    @property
    def tick_limit(self) -> int:
        """A tick by which every microbatch has finished (past it, the protocol is broken)."""
        return (self.first_token_step + self.max_new + 2) * self.period + self.n_decode

    def decode_at(self, stage: int, tick: int) -> tuple[int, int] | None:
        """(step, microbatch) that decode stage ``stage`` runs at ``tick``, or None."""
        k = tick - (stage - self.first_decode)
        if k < 0:
            return None
        t, i = divmod(k, self.period)
        return (t, i) if i < self.m else None

    def encode_at(self, stage: int, tick: int) -> int | None:
        """Microbatch that encoder stage ``stage`` runs at encoder tick ``tick`` (tick = i + stage), or None."""
        i = tick - stage
        return i if 0 <= i < self.m else None

    def rows(self, i: int) -> int:
        lo, hi = self.bounds[i]
        return hi - lo

    def q(self, t: int) -> int:
        """Positions a stage's message carries at step ``t``: a prompt chunk's at a prefill step, then one token."""
        chunks = self.chunks
        if t < len(chunks):
            a, b = chunks[t]
            return b - a
        return 1


# --------------------------------------------------------------------------- messages
class Mailbox:
    """Point-to-point messages of one rank's ring, keyed by what they carry (``("h", stage, mb)``...).

    A message for a stage on this rank is kept as is (no copy, no send). Receives are posted before
    they are needed and waited for only when :meth:`take` asks for the key.
    """

    def __init__(self, *, me: int, rank_of: Callable[[int], int], dims: Any, device: torch.device):
        self.me, self.rank_of, self.dims, self.device = me, rank_of, dims, device
        self.inbox: dict[tuple, Any] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []

    def deliver(self, key: tuple, stage: int, tensor: torch.Tensor) -> None:
        rank = self.rank_of(stage)
        if rank == self.me:
            self.inbox[key] = tensor
            return
        self.send(tensor, rank)

    def send(self, tensor: torch.Tensor, rank: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.dims.global_rank(rank), group=self.dims.pp_group)
        self.sends.append((work, tensor))  # the buffer must live until the send completes

    def post(self, key: tuple, src_stage: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buf, src=self.dims.global_rank(self.rank_of(src_stage)), group=self.dims.pp_group)
        self.inbox[key] = (work, buf)

    def take(self, key: tuple) -> torch.Tensor:
        item = self.inbox.pop(key)
        if isinstance(item, tuple):
            work, buf = item
            work.wait()
            return buf
        return item

    def prune(self) -> None:
        # Completed sends release their buffers now and then; checking every time would cost more.
        if len(self.sends) > 32:
            self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    def close(self) -> None:
        """Wait for every send; a message left unread means the ranks disagreed on the timetable."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        if self.inbox:
            raise RuntimeError(f"pipelined generation ended with unconsumed messages {sorted(self.inbox)} (protocol error)")


# --------------------------------------------------------------------------- last stage: tokens
@dataclass
class _Sequences:
    """Last stage, one microbatch: the sequences so far and what decides the next token."""

    ids: torch.Tensor  # (n, L) every row of the microbatch, finished rows padded
    unfinished: torch.Tensor  # (n,) bool
    finished_at: torch.Tensor  # (n,) step that finished the row, -1 while generating
    processors: Any
    generators: list[torch.Generator] = field(default_factory=list)
    steps: int = 0


class TokenChooser:
    """The last stage's token choice: transformers' logits processors (built per microbatch from the
    merged ``GenerationConfig``, as its ``generate`` builds them), greedy or per-row seeded sampling,
    and its stopping criteria, in transformers' order."""

    def __init__(self, skeleton: Any, req: Request, device: torch.device):
        self.req, self.device = req, device
        cur_len = req.prompt.shape[1]
        mask_key = "decoder_attention_mask" if req.encoder_decoder else "attention_mask"
        self.seqs: dict[int, _Sequences] = {}
        for i, (lo, hi) in enumerate(req.bounds):
            processors = generation_helper(skeleton, "_get_logits_processor")(
                generation_config=req.config, input_ids_seq_length=cur_len,
                encoder_input_ids=req.enc_ids[lo:hi] if req.enc_ids is not None else req.prompt[lo:hi],
                logits_processor=LogitsProcessorList(req.logits_processor or []),
                device=device, model_kwargs={mask_key: req.mask[lo:hi] if req.mask is not None else None},
            )
            n = hi - lo
            gens = row_generators(req.seed, range(req.row_offset + lo, req.row_offset + hi), device) if req.do_sample else []
            self.seqs[i] = _Sequences(
                ids=req.prompt[lo:hi].clone(), unfinished=torch.ones(n, dtype=torch.bool, device=device),
                finished_at=torch.full((n,), -1, dtype=torch.long, device=device), processors=processors, generators=gens,
            )
        self.stopping = generation_helper(skeleton, "_get_stopping_criteria")(
            generation_config=req.config, stopping_criteria=StoppingCriteriaList(req.stopping_criteria or []), tokenizer=req.tokenizer
        )

    def choose(self, i: int, t: int, live: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Step ``t`` of microbatch ``i``: ``logits`` (live rows, vocab) -> ``(n,)`` tokens, pad for finished rows."""
        st, req = self.seqs[i], self.req
        n = st.ids.shape[0]
        # Processors see the microbatch in transformers' shape (finished rows included, as there).
        # While every row generates (most steps), the logits are that shape already and are used
        # as they are (in float32; nothing else reads them, so processors may change them in place),
        # without the scatter into and gather out of a zero (n, vocab) block. This runs between the
        # last stage's forward and the token's send, on the ring's critical path: the scatter and
        # gather took a third of it (0.5 ms per call at 8 rows x 8192 vocab).
        every = live.numel() == n
        if every:
            scores = logits.float()
        else:
            scores = torch.zeros(n, logits.shape[-1], dtype=torch.float32, device=self.device)
            scores[live] = logits.float()
        scores = st.processors(st.ids, scores)
        gens = [st.generators[j] for j in live.tolist()] if req.do_sample else None
        chosen = select_tokens(scores if every else scores[live], do_sample=req.do_sample, generators=gens)
        if every:
            tokens = chosen
        else:
            tokens = torch.full((n,), req.pad, dtype=torch.long, device=self.device)
            tokens[live] = chosen
        st.ids = torch.cat([st.ids, tokens[:, None]], dim=1)
        stop = self.stopping(st.ids, None).to(self.device)
        st.finished_at[st.unfinished & stop] = t
        st.unfinished &= ~stop
        st.steps = t + 1
        return tokens

    def unfinished(self, i: int) -> torch.Tensor:
        return self.seqs[i].unfinished

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (B, L + steps) padded with ``pad``, generated lengths (B,))."""
        steps = max(st.steps for st in self.seqs.values())
        width = self.req.prompt.shape[1] + steps
        ids, lengths = [], []
        for st in self.seqs.values():
            pad = width - st.ids.shape[1]
            ids.append(torch.nn.functional.pad(st.ids, (0, pad), value=self.req.pad) if pad else st.ids)
            lengths.append(torch.where(st.finished_at >= 0, st.finished_at + 1, torch.full_like(st.finished_at, st.steps)))
        return torch.cat(ids), torch.cat(lengths)


class StepStreamer:
    """Feeds a transformers streamer (``put`` / ``end``) on the last stage's rank: the prompt first,
    then one ``(B,)`` tensor per step, once every microbatch has its token for that step (rows
    finished earlier carry the pad id, as transformers' own streaming does)."""

    def __init__(self, streamer: Any, batch: int, pad: int):
        self.streamer, self.batch, self.pad = streamer, batch, pad
        self.pending: dict[int, torch.Tensor] = {}  # step -> (B,) tokens so far

    def start(self, prompt: torch.Tensor) -> None:
        self.streamer.put(prompt.cpu())

    def record(self, t: int, lo: int, hi: int, tokens: torch.Tensor) -> None:
        step = self.pending.setdefault(t, torch.full((self.batch,), self.pad, dtype=torch.long))
        step[lo:hi] = tokens.cpu()

    def flush(self, t: int) -> None:
        if t in self.pending:
            self.streamer.put(self.pending.pop(t))

    def end(self) -> None:
        self.streamer.end()


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


class Ring:
    """One ``generate`` request on this rank: its stages' caches, the encoder pass, the decode loop."""

    def __init__(self, model: Any, req: Request):
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
        self.times = Timetable(
            first_decode=self.d0, n_decode=len(self.decode), bounds=tuple(req.bounds), prompt_len=req.prompt.shape[1], max_new=req.max_new,
            prefill_chunk=req.prefill_chunk,
        )
        self.me = model.dims.pp_rank
        self.local = {st.spec.index: st for st in model.stages}
        self.local_decode = [s for s in self.decode if s in self.local]
        self.H = int(model.config.get_text_config(decoder=True).hidden_size)
        self.dtype, self.device = model.dtype, model.device
        self.box = Mailbox(me=self.me, rank_of=self._rank, dims=model.dims, device=self.device)
        self.enc_out: dict[int, torch.Tensor] = {}
        self.peak = 0
        self.slots = {
            (s, i): _Slot(stage=self.local[s], index=s, mb=i, rows=torch.arange(hi - lo, device=self.device), cache=self._new_cache())
            for s in self.local_decode
            for i, (lo, hi) in enumerate(req.bounds)
        }
        self.is_last = (self.S - 1) in self.local
        self.chooser = TokenChooser(model.skeleton, req, self.device) if self.is_last else None
        self.streamer = StepStreamer(req.streamer, req.prompt.shape[0], req.pad) if self.is_last and req.streamer is not None else None

    def _rank(self, stage: int) -> int:
        return self.plan.stages[stage].rank

    def _new_cache(self):
        # As transformers' generate: a DynamicCache built from the (decoder) config, so layer indices are the
        # model's own and each layer has its kind's cache (sliding-window layers keep only the window, as
        # DynamicSlidingWindowLayer); a stage only ever fills the layers it owns, and the glue sizes each
        # layer's mask against the cache layer of its kind.
        cfg = self.model.config.get_text_config(decoder=True)
        if self.req.encoder_decoder:
            return EncoderDecoderCache(DynamicCache(config=cfg), DynamicCache(config=cfg))
        return DynamicCache(config=cfg)

    # ------------------------------------------------------------ memory
    def _observe(self) -> None:
        # Called before every release and compaction, and at the end: between those events the
        # caches only grow, so their peak is the largest of these totals (measuring after every op,
        # as before, cost ~2% of decoding and saw nothing more).
        total = sum(cache_nbytes(s.cache) for s in self.slots.values() if s.cache is not None)
        self.peak = max(self.peak, total)

    def _release(self, slot: _Slot) -> None:
        self._observe()
        slot.cache = slot.mask = slot.pos = slot.enc = slot.enc_mask = None
        slot.done = True

    def _check(self, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(t.shape) != shape:
            raise RuntimeError(
                f"{what} produced shape {tuple(t.shape)} but the ring protocol expects {shape} (hidden size "
                f"{self.H} from the config); this model's stage outputs do not fit pipelined generation"
            )

    # ------------------------------------------------------------ encoder (once per request)
    def encode(self) -> None:
        """Run the context stages (T5's encoder) once, pipelined over the microbatches; tick of (s, i) = i + s."""
        req, times, box = self.req, self.times, self.box
        e = self.context[-1]
        t_enc = req.enc_ids.shape[1]
        # Ranks with decode stages other than the encoder's last stage get its output, once per microbatch.
        receivers = sorted({self._rank(s) for s in self.decode} - {self._rank(e)})
        mine = [s for s in self.context if s in self.local]
        for tick in range(times.m + e):
            for s in mine:  # receives first, in sender-stage order
                i = times.encode_at(s - 1, tick)
                if s > 0 and i is not None and self._rank(s - 1) != self.me:
                    box.post(("enc", s, i), s - 1, (times.rows(i), t_enc, self.H), self.dtype)
            i = times.encode_at(e, tick)
            if self.me in receivers and i is not None:
                box.post(("encout", i), e, (times.rows(i), t_enc, self.H), self.dtype)
            for s in mine:
                i = times.encode_at(s, tick)
                if i is None:
                    continue
                lo, hi = req.bounds[i]
                inputs = {"input_ids": req.enc_ids[lo:hi]}
                if req.enc_mask is not None:
                    inputs["attention_mask"] = req.enc_mask[lo:hi]
                received = () if s == 0 else (box.take(("enc", s, i)),)
                out = self.local[s](*received, **inputs)
                out = (out[0] if isinstance(out, tuple) else out).to(self.dtype)
                self._check(out, (hi - lo, t_enc, self.H), f"encoder stage {s}")
                if s < e:
                    box.deliver(("enc", s + 1, i), s + 1, out)
                else:
                    self.enc_out[i] = out
                    for r in receivers:
                        box.send(out, r)
            box.prune()
        for i in range(times.m):
            if ("encout", i) in box.inbox:
                self.enc_out[i] = box.take(("encout", i))
        for (s, i), slot in self.slots.items():
            lo, hi = req.bounds[i]
            slot.enc = self.enc_out[i]
            slot.enc_mask = req.enc_mask[lo:hi] if req.enc_mask is not None else None
        self.enc_out.clear()

    # ------------------------------------------------------------ decoding
    def decode_loop(self) -> None:
        if self.req.encoder_decoder:
            self.encode()
        if self.streamer is not None:
            self.streamer.start(self.req.prompt)
        tick = 0
        while any(not slot.done for slot in self.slots.values()):
            if tick > self.times.tick_limit:
                raise RuntimeError("pipelined generation did not finish in the expected number of ticks (protocol error)")
            self._post_decode(tick)
            for s in self.local_decode:
                at = self.times.decode_at(s, tick)
                if at is not None and not self.slots[(s, at[1])].done:
                    self._op(self.slots[(s, at[1])], at[0])
            self.box.prune()
            tick += 1
        self._observe()
        self.box.close()
        if self.streamer is not None:
            self.streamer.end()

    def _post_decode(self, tick: int) -> None:
        # Receives for the messages sent at this tick, in sender-stage order (the order they are sent in).
        times = self.times
        for s in self.local_decode:
            if s == self.d0 or self._rank(s - 1) == self.me:
                continue
            at = times.decode_at(s - 1, tick)
            if at is not None and not self.slots[(s, at[1])].done:
                t, i = at
                self.box.post(("h", s, i), s - 1, (times.rows(i), times.q(t), self.H + 1), self.dtype)
        if self.d0 in self.local and self._rank(self.S - 1) != self.me:
            at = times.decode_at(self.S - 1, tick)
            # Prefill steps before the last chunk choose no token: nothing comes back from them.
            if at is not None and at[0] >= times.first_token_step and not self.slots[(self.d0, at[1])].done:
                self.box.post(("tok", at[1]), self.S - 1, (times.rows(at[1]), 2), torch.long)

    def _op(self, slot: _Slot, t: int) -> None:
        req, box, s, i = self.req, self.box, slot.index, slot.mb
        lo, hi = req.bounds[i]
        n = hi - lo
        q = self.times.q(t)
        first, last = s == self.d0, s == self.S - 1
        chunks = self.times.chunks
        # The prompt's (start, end) positions this step feeds (step 0 unchunked: all of them), or None.
        span = chunks[t] if t < len(chunks) else None
        prefill = span is not None
        # The step's new token: step t chooses token t - first_token_step (prefill steps before it, none).
        token_step = t - self.times.first_token_step
        if first:
            if prefill:
                msg, alive = None, torch.ones(n, dtype=torch.bool, device=self.device)
            else:
                msg = box.take(("tok", i))  # (n, 2): token, still generating
                alive = msg[:, 1].bool()
        else:
            msg = box.take(("h", s, i))  # (n, q, H + 1)
            alive = msg[:, 0, -1] > 0.5
        if not bool(alive.any()):
            # The microbatch is done: pass the news down the ring once, free the cache.
            self._release(slot)
            if not last:
                box.deliver(("h", s + 1, i), s + 1, torch.zeros(n, q, self.H + 1, dtype=self.dtype, device=self.device))
            else:
                self._stream(i, token_step)
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
            if prefill:
                # As transformers' chunked prefill: the mask up to the chunk's end, the chunk's positions.
                a, b = span
                slot.mask = req.mask[lo:hi, :b] if req.mask is not None else None
                slot.pos = req.positions[lo:hi, a:b]
                slot.types = req.types[lo:hi, a:b] if req.types is not None else None
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
            inputs[ids_key] = req.prompt[lo:hi, span[0]: span[1]] if prefill else msg[live, 0].unsqueeze(1)
            received: tuple = ()
        else:
            received = (msg[live, :, : self.H],)
        if last:
            inputs["logits_to_keep"] = 1
        out = slot.stage(*received, **inputs)
        out = out[0] if isinstance(out, tuple) else out  # in decoding only the hidden state flows on
        if last:
            if token_step < 0:
                return  # a prompt chunk before the last: its cache is filled, no token yet
            tokens = self.chooser.choose(i, token_step, live, out[:, -1, :])
            if self.streamer is not None:
                self.streamer.record(token_step, lo, hi, tokens)
            box.deliver(("tok", i), self.d0, torch.stack([tokens, self.chooser.unfinished(i).long()], dim=1))  # (n, 2)
            self._stream(i, token_step)
            return
        self._check(out, (live.numel(), q, self.H), f"stage {s}")
        nxt = torch.zeros(n, q, self.H + 1, dtype=self.dtype, device=self.device)
        nxt[live, :, : self.H] = out.to(self.dtype)
        nxt[live, :, self.H] = 1
        box.deliver(("h", s + 1, i), s + 1, nxt)

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

    def _stream(self, i: int, t: int) -> None:
        # Flush step t once no microbatch after i can still add a token to it.
        if self.streamer is None:
            return
        if any(not self.slots[(self.S - 1, j)].done for j in range(i + 1, self.times.m)):
            return
        self.streamer.flush(t)

    # ------------------------------------------------------------ result
    def result(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Last stage's rank: (ids (B, L + steps), generated lengths (B,)); None elsewhere."""
        return self.chooser.result() if self.is_last else None
