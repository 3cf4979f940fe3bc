"""The decode ring of pipelined generation: the loop that joins its parts, one module each.

``request.py`` prepares a :class:`Request` (the same on every rank); :class:`Ring` runs it:

  * :class:`Timetable` (``timetable.py``) — pure arithmetic, identical on every rank: which (step,
    microbatch) a decode stage runs at a tick, the encoder's ticks, message shapes. No rank ever
    sends metadata.
  * :class:`Mailbox` (``mailbox.py``) — the point-to-point messages: non-blocking sends kept alive
    until done, receives posted ahead and waited for when taken, same-rank deliveries without copies.
  * :class:`TokenChooser` (``chooser.py``) — the last stage's part: transformers' logits processors,
    greedy or seeded sampling, stopping criteria (the caller's own once per step on the whole batch,
    when the ring says the step is over), the sequences so far and where each row finished;
    or, for beam search, :class:`BeamChooser` (``beam.py``), whose chosen beams' source rows travel
    with the tokens and every stage's hidden states so each stage reorders its cache.
  * :class:`StepStreamer` (``streaming.py``) — feeds a transformers streamer one ``(B,)`` tensor per
    step, in order, once every microbatch has its token for that step.
  * :class:`Ring` (here) — per (local stage, microbatch) caches (``kv_cache.py``) and row state; the
    encoder pass (once per request) and the decode loop over ticks.

Note (protocol): the ticks, messages and shapes are described in :mod:`.timetable`.

Note (lock step): with experts over data-parallel ranks (``ep_over="data"``) every rank of an expert group
calls transformers' all-to-all at every MoE layer, so every replica's ring must run the same (stage, step,
microbatch) forwards although their rows differ, as transformers' ``generate(synced_gpus=True)`` keeps every
rank stepping until all are done. The timetable is already the same (equal microbatch counts:
``microbatches.replica_share``; the prompt's length and ``max_new`` are the whole batch's); what differs is
when rows leave. So every row stays in the ring, finished rows fed ``pad_token_id`` as transformers pads them,
until the replicas agree that all rows are done: at each token choice, one MIN all-reduce of "all my rows
finished" over the expert group, on the last stage, whose answer travels down the ring in the existing
still-generating flags. Beam search takes the same rule: a microbatch whose beam search is done (``beam.py``)
stays too, stepped by transformers' beam steps, its caches reordered by the chosen beams, as transformers' batch
goes on computing its finished prompts' beams, which its own rules keep from changing the finished ones.
Running ``max_new_tokens`` steps always would need no agreement but can cost many times the work (EOS long
before the limit); one 4-byte all-reduce per microbatch and step is what transformers pays per step, and it
keeps the exit rule the ring already has for per-step scores.

Example (inside ``generate``):
    >>> ring = Ring(model, request)
    >>> ring.decode_loop()
    >>> ids, lengths = ring.result()          # on the last stage's rank; None elsewhere
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core import PipelineCore
from ..errors import InternalError
from .beam import BeamChooser
from .chooser import TokenChooser
from .kv_cache import cache_nbytes, new_cache
from .mailbox import Mailbox
from .request import Request
from .streaming import StepStreamer
from .timetable import Timetable

__all__ = ["Ring"]


@dataclass
class _Slot:
    """One (local stage, microbatch): its cache and the per-row state of the rows still generating."""

    stage: Any  # the local stage module
    stage_index: int
    microbatch: int
    rows: torch.Tensor  # microbatch-local indices of the rows in the cache, ascending
    cache: Any
    mask: torch.Tensor | None = None  # (n, L) attention mask so far (decoder-only)
    positions: torch.Tensor | None = None  # (n, q) position ids of the last step (decoder-only)
    types: torch.Tensor | None = None  # (n, q) token_type_ids of the last step (decoder-only, if given)
    encoder_out: torch.Tensor | None = None  # (n, T_enc, H) encoder output (encoder-decoder)
    encoder_mask: torch.Tensor | None = None
    done: bool = False


@dataclass
class _Received:
    """What one op of a decode stage starts from: the message taken, and which of its rows still generate."""

    message: torch.Tensor | None  # first stage: (n, 2) token, still generating; others (n, q, H + 1); prefill: None
    alive: torch.Tensor  # (n,) bool
    sources: torch.Tensor | None = None  # beam search: (n,) the row each row's beam continues (beam_idx)


class Ring:
    """One ``generate`` request on this rank: its stages' caches, the encoder pass, the decode loop."""

    def __init__(self, model: PipelineCore, req: Request):
        self.model, self.req = model, req
        self.plan = plan = model.plan
        self.n_stages = plan.num_stages
        gen_stack = model.resolved.stacks[-1].name
        # Decode stages hold blocks of the generating stack (all stages of a decoder-only model);
        # context stages hold blocks of earlier stacks (T5's encoder). One stage may be both.
        self.decode_stages = [s.index for s in plan.stages if gen_stack in s.stacks]
        self.context_stages = [s.index for s in plan.stages if any(n != gen_stack for n in s.stacks)]
        if self.decode_stages != list(range(self.decode_stages[0], self.n_stages)):
            raise InternalError(
                f"the generating stack {gen_stack!r} must occupy the last stages, got stages {self.decode_stages}"
            )
        if bool(self.context_stages) != req.encoder_decoder:
            raise InternalError(
                "pipelined generation supports decoder-only models and encoder-decoder models with two stacks"
            )
        self.first_decode = self.decode_stages[0]
        self.last_stage = self.n_stages - 1
        self.timetable = Timetable(
            first_decode=self.first_decode, n_decode=len(self.decode_stages), bounds=tuple(req.bounds),
            prompt_len=req.prompt.shape[1], max_new=req.max_new, prefill_chunk=req.prefill_chunk,
        )
        self.pp_rank = model.dims.pp_rank
        self.local_stages = {st.spec.index: st for st in model.stages}
        self.local_decode = [s for s in self.decode_stages if s in self.local_stages]
        self.hidden_size = int(model.config.get_text_config(decoder=True).hidden_size)
        self.dtype, self.device = model.dtype, model.device
        # Sends kept in flight at most: a rank runs at most the prompt's steps plus one step of every local stage and
        # microbatch ahead of the ranks it sends to (the first stage waits for each token; stages after it for the
        # previous stage's message), so the oldest send past this many was received long ago (Mailbox's Note).
        window = 4 * len(req.bounds) * self.n_stages * (len(self.timetable.chunks) + 2)
        self.mailbox = Mailbox(pp_rank=self.pp_rank, rank_of=self._rank_of, dims=model.dims, device=self.device,
                               window=window)
        self.peak_cache_bytes = 0
        # Seconds this rank spent in its stages' forwards ("compute", the encoder's too) and blocked on
        # messages while the pipe fills ("fill": the encoder, the prompt's steps and the first token's trip
        # round the ring) or after it ("wait": hops and stage imbalance), for GenerationStats.time_split.
        self.seconds = {"compute": 0.0, "fill": 0.0, "wait": 0.0}
        self.slots = {
            (s, i): _Slot(
                stage=self.local_stages[s], stage_index=s, microbatch=i, rows=torch.arange(hi - lo, device=self.device),
                cache=new_cache(model.config, encoder_decoder=req.encoder_decoder, stage=self.local_stages[s]),
            )
            for s in self.local_decode
            for i, (lo, hi) in enumerate(req.bounds)
        }
        self.is_last = self.last_stage in self.local_stages
        self.beam = req.num_beams > 1
        self.token_width = 3 if self.beam else 2  # token, still generating[, beam source row]
        chooser = BeamChooser if self.beam else TokenChooser
        self.chooser = chooser(model.skeleton, req, self.device) if self.is_last else None
        # Lock step (experts over data-parallel ranks, see the Note): the replicas agreeing when to stop.
        self.lock_group = model.dims.ep_mesh.get_group() if req.lock_step else None
        streams = self.is_last and req.streamer is not None
        self.streamer = StepStreamer(req.streamer, req.prompt.shape[0], req.pad) if streams else None

    def _rank_of(self, stage: int) -> int:
        return self.plan.stages[stage].rank

    # ------------------------------------------------------------ memory
    def _observe(self) -> None:
        # Called before every release and compaction, and at the end: between those events the
        # caches only grow, so their peak is the largest of these totals (measuring after every op,
        # as before, cost ~2% of decoding and saw nothing more).
        total = sum(cache_nbytes(s.cache) for s in self.slots.values() if s.cache is not None)
        self.peak_cache_bytes = max(self.peak_cache_bytes, total)

    def _release(self, slot: _Slot) -> None:
        self._observe()
        slot.cache = slot.mask = slot.positions = slot.encoder_out = slot.encoder_mask = None
        slot.done = True

    def _check(self, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(t.shape) != shape:
            raise InternalError(
                f"{what} produced shape {tuple(t.shape)} but the ring protocol expects {shape} (hidden size "
                f"{self.hidden_size} from the config); this model's stage outputs do not fit pipelined generation"
            )

    # ------------------------------------------------------------ encoder (once per request)
    def encode(self) -> None:
        """Run the context stages (T5's encoder) once, pipelined over the microbatches; tick of (s, i) = i + s."""
        req, timetable, box, hidden = self.req, self.timetable, self.mailbox, self.hidden_size
        last_encoder = self.context_stages[-1]
        t_enc = req.enc_ids.shape[1]
        # Ranks with decode stages other than the encoder's last stage get its output, once per microbatch.
        receivers = sorted({self._rank_of(s) for s in self.decode_stages} - {self._rank_of(last_encoder)})
        local_context = [s for s in self.context_stages if s in self.local_stages]
        encoder_out: dict[int, torch.Tensor] = {}
        for tick in range(timetable.n_microbatches + last_encoder):
            for s in local_context:  # receives first, in sender-stage order
                i = timetable.encode_at(s - 1, tick)
                if s > 0 and i is not None and self._rank_of(s - 1) != self.pp_rank:
                    box.post(("enc", s, i), s - 1, (timetable.rows(i), t_enc, hidden), self.dtype)
            i = timetable.encode_at(last_encoder, tick)
            if self.pp_rank in receivers and i is not None:
                box.post(("encout", i), last_encoder, (timetable.rows(i), t_enc, hidden), self.dtype)
            for s in local_context:
                i = timetable.encode_at(s, tick)
                if i is None:
                    continue
                lo, hi = req.bounds[i]
                inputs = {"input_ids": req.enc_ids[lo:hi]}
                if req.enc_mask is not None:
                    inputs["attention_mask"] = req.enc_mask[lo:hi]
                started = time.perf_counter()
                received = () if s == 0 else (box.take(("enc", s, i)),)
                taken = time.perf_counter()
                out = self.local_stages[s](*received, **inputs)
                self.seconds["fill"] += taken - started
                self.seconds["compute"] += time.perf_counter() - taken
                out = (out[0] if isinstance(out, tuple) else out).to(self.dtype)
                self._check(out, (hi - lo, t_enc, hidden), f"encoder stage {s}")
                if s < last_encoder:
                    box.deliver(("enc", s + 1, i), s + 1, out)
                else:
                    encoder_out[i] = out
                    for r in receivers:
                        box.send(out, r)
            box.prune()
        started = time.perf_counter()
        for i in range(timetable.n_microbatches):
            if ("encout", i) in box.inbox:
                encoder_out[i] = box.take(("encout", i))
        self.seconds["fill"] += time.perf_counter() - started
        for (_, i), slot in self.slots.items():
            lo, hi = req.bounds[i]
            slot.encoder_out = encoder_out[i]
            slot.encoder_mask = req.enc_mask[lo:hi] if req.enc_mask is not None else None

    # ------------------------------------------------------------ decoding
    def decode_loop(self) -> None:
        """Run the request to its end: the encoder pass if any, then every decode stage's ops, tick by tick."""
        if self.req.encoder_decoder:
            self.encode()
        if self.streamer is not None:
            self.streamer.start(self.req.prompt)
        tick = 0
        while any(not slot.done for slot in self.slots.values()):
            if tick > self.timetable.tick_limit:
                raise InternalError(
                    "pipelined generation did not finish in the expected number of ticks (protocol error)"
                )
            self._post_receives(tick)
            for s, t, i in self.timetable.ops_at(self.local_decode, tick):
                if not self.slots[(s, i)].done:
                    self._op(self.slots[(s, i)], t)
            if self.is_last:
                self._end_step(tick)
            self.mailbox.prune()
            tick += 1
        self._observe()
        self.mailbox.close()
        if self.streamer is not None:
            self.streamer.end()

    def _post_receives(self, tick: int) -> None:
        # Receives for the messages sent at this tick, in the order their senders run the ops that send
        # them (microbatch, then stage: Timetable.ops_at); an op's own messages in the order it sends them.
        timetable, last = self.timetable, self.last_stage
        posts = []  # ((microbatch, sender stage, n-th message of the op), key, sender stage, shape, dtype)
        for s in self.local_decode:
            if s == self.first_decode or self._rank_of(s - 1) == self.pp_rank:
                continue
            at = timetable.decode_at(s - 1, tick)
            if at is not None and not self.slots[(s, at[1])].done:
                t, i = at
                shape = (timetable.rows(i), timetable.message_positions(t), self.hidden_size + 1)
                posts.append(((i, s - 1, 0), ("h", s, i), s - 1, shape, self.dtype))
                if self.beam:  # sent right after the hidden states, so received in that order
                    posts.append(((i, s - 1, 1), ("src", s, i), s - 1, (timetable.rows(i),), torch.long))
        if self.first_decode in self.local_stages and self._rank_of(last) != self.pp_rank:
            at = timetable.decode_at(last, tick)
            # Prefill steps before the last chunk choose no token: nothing comes back from them.
            if (
                at is not None and at[0] >= timetable.first_token_step
                and not self.slots[(self.first_decode, at[1])].done
            ):
                i = at[1]
                posts.append(((i, last, 0), ("tok", i), last, (timetable.rows(i), self.token_width), torch.long))
        for _, key, sender, shape, dtype in sorted(posts, key=lambda p: p[0]):
            self.mailbox.post(key, sender, shape, dtype)

    def _op(self, slot: _Slot, t: int) -> None:
        """Decode stage ``slot.stage_index`` runs step ``t`` of microbatch ``slot.microbatch``."""
        s, i = slot.stage_index, slot.microbatch
        lo, hi = self.req.bounds[i]
        chunks = self.timetable.chunks
        # The prompt's (start, end) positions this step feeds (step 0 unchunked: all of them), or None.
        span = chunks[t] if t < len(chunks) else None
        # The step's new token: step t chooses token t - first_token_step (prefill steps before it, none).
        token_step = t - self.timetable.first_token_step
        started = time.perf_counter()
        received = self._receive(s, i, hi - lo, prefill=span is not None)
        self.seconds["fill" if t <= self.timetable.first_token_step + 1 else "wait"] += time.perf_counter() - started
        alive = received.alive
        # Most ops have every row alive: then the live rows are the cache's (nothing was ever dropped), taken
        # without nonzero's copy, and the message is built without indexing (below).
        every = bool(alive.all())
        if not every and not bool(alive.any()):
            self._pass_end(slot, t, token_step)
            return
        live = slot.rows if every else alive.nonzero()[:, 0]
        if live.numel() < slot.rows.numel():
            self._compact(slot, live)
        if received.sources is not None and span is None:
            self._reorder(slot, received.sources)
        started = time.perf_counter()
        out = self._forward(slot, received, live, span)
        self.seconds["compute"] += time.perf_counter() - started
        if s == self.last_stage:
            if token_step >= 0:  # a prompt chunk before the last fills its cache and chooses no token
                self._choose_and_return(i, token_step, live, out)
            return
        n, q, hidden = hi - lo, self.timetable.message_positions(t), self.hidden_size
        self._check(out, (live.numel(), q, hidden), f"stage {s}")
        if every:  # one op instead of a zero block and two scatters: this sits on the ring's critical path
            nxt = torch.cat([out.to(self.dtype), out.new_ones(n, q, 1, dtype=self.dtype)], dim=2)
        else:
            nxt = torch.zeros(n, q, hidden + 1, dtype=self.dtype, device=self.device)
            nxt[live, :, :hidden] = out.to(self.dtype)
            nxt[live, :, hidden] = 1
        self.mailbox.deliver(("h", s + 1, i), s + 1, nxt)
        if self.beam:  # the next stage reorders its cache as this one did
            sources = received.sources if received.sources is not None else torch.arange(n, device=self.device)
            self.mailbox.deliver(("src", s + 1, i), s + 1, sources)

    def _receive(self, s: int, i: int, n: int, *, prefill: bool) -> _Received:
        """The message stage ``s`` starts microbatch ``i`` from, and the rows it says still generate."""
        if s != self.first_decode:
            message = self.mailbox.take(("h", s, i))  # (n, q, H + 1)
            sources = self.mailbox.take(("src", s, i)) if self.beam else None
            return _Received(message=message, alive=message[:, 0, -1] > 0.5, sources=sources)
        if prefill:
            return _Received(message=None, alive=torch.ones(n, dtype=torch.bool, device=self.device))
        message = self.mailbox.take(("tok", i))  # (n, 2 or 3): token, still generating[, beam source row]
        sources = message[:, 2] if self.beam else None
        return _Received(message=message, alive=message[:, 1].bool(), sources=sources)

    def _pass_end(self, slot: _Slot, t: int, token_step: int) -> None:
        """The microbatch is done: pass the news down the ring once, free the cache."""
        s, i = slot.stage_index, slot.microbatch
        self._release(slot)
        if s != self.last_stage:
            n, q = self.timetable.rows(i), self.timetable.message_positions(t)
            zeros = torch.zeros(n, q, self.hidden_size + 1, dtype=self.dtype, device=self.device)
            self.mailbox.deliver(("h", s + 1, i), s + 1, zeros)
            if self.beam:
                self.mailbox.deliver(("src", s + 1, i), s + 1, torch.zeros(n, dtype=torch.long, device=self.device))
        else:
            self._stream(i, token_step)

    def _forward(self, slot: _Slot, received: _Received, live: torch.Tensor, span: tuple[int, int] | None):
        """The stage's forward on the live rows; its hidden state (last stage: logits) ``(live, q, ...)``."""
        req = self.req
        lo, hi = req.bounds[slot.microbatch]
        inputs: dict[str, Any] = {"cache": slot.cache}
        if req.encoder_decoder:
            ids_key = "decoder_input_ids"
            inputs["encoder_outputs"] = slot.encoder_out
            if slot.encoder_mask is not None:
                inputs["attention_mask"] = slot.encoder_mask
        else:
            ids_key = "input_ids"
            self._advance_positions(slot, span)
            inputs["attention_mask"] = slot.mask
            inputs["position_ids"] = slot.positions
            if slot.types is not None:
                inputs["token_type_ids"] = slot.types
        if slot.stage_index == self.first_decode:
            if span is not None:
                inputs[ids_key] = req.prompt[lo:hi, span[0]: span[1]]
            else:
                inputs[ids_key] = received.message[live, 0].unsqueeze(1)
            hidden: tuple = ()
        else:
            hidden = (received.message[live, :, : self.hidden_size],)
        if slot.stage_index == self.last_stage:
            inputs["logits_to_keep"] = 1
        out = slot.stage(*hidden, **inputs)
        return out[0] if isinstance(out, tuple) else out  # in decoding only the hidden state flows on

    def _advance_positions(self, slot: _Slot, span: tuple[int, int] | None) -> None:
        """A decoder-only slot's mask, positions and token types for this step."""
        req = self.req
        lo, hi = req.bounds[slot.microbatch]
        if span is not None:
            # As transformers' chunked prefill: the mask up to the chunk's end, the chunk's positions.
            start, end = span
            slot.mask = req.mask[lo:hi, :end] if req.mask is not None else None
            slot.positions = req.positions[lo:hi, start:end]
            slot.types = req.types[lo:hi, start:end] if req.types is not None else None
            return
        if slot.mask is not None:
            slot.mask = torch.cat([slot.mask, slot.mask.new_ones(slot.mask.shape[0], 1)], dim=1)
        slot.positions = slot.positions[:, -1:] + 1
        slot.types = slot.types[:, -1:] if slot.types is not None else None

    def _choose_and_return(self, i: int, token_step: int, live: torch.Tensor, logits: torch.Tensor) -> None:
        """Last stage: choose microbatch ``i``'s tokens and send them back round to the first decode stage."""
        lo, hi = self.req.bounds[i]
        tokens = self.chooser.choose(i, token_step, live, logits[:, -1, :])
        if self.streamer is not None:
            self.streamer.record(token_step, lo, hi, tokens)
        flags = self.chooser.unfinished(i)
        # With per-step scores or logits asked for, every row stays in the ring, finished or not, while
        # any microbatch still generates, as transformers computes the whole batch every step (a
        # microbatch does not yet know the later ones' last step: it may run one step more, cut at the end,
        # though never past the last step any row may take). In lock step, while any replica's does.
        keep = (self.req.keep_rows or self.req.lock_step) and token_step + 1 < self.req.max_new
        if keep and not self._all_finished():
            flags = torch.ones_like(flags)
        columns = [tokens, flags.long()] + ([self.chooser.sources(i)] if self.beam else [])
        message = torch.stack(columns, dim=1)  # (n, token_width)
        self.mailbox.deliver(("tok", i), self.first_decode, message)
        self._stream(i, token_step)

    def _all_finished(self) -> bool:
        """Whether every row of this request has finished: this replica's, and in lock step every replica's of
        the expert group (one MIN all-reduce, which every replica's last stage makes at the same op)."""
        done = all(self.chooser.finished(j) for j in range(self.timetable.n_microbatches))
        if self.lock_group is None:
            return done
        flag = torch.tensor([int(done)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.lock_group)
        return bool(flag.item())

    def _end_step(self, tick: int) -> None:
        """Last stage: at the tick of a step's last microbatch (run, or skipped since it left the ring),
        every microbatch has chosen that step's token, and no microbatch chooses the next step's before
        a later tick: the chooser calls the caller's stopping criteria on the whole batch now."""
        at = self.timetable.decode_at(self.last_stage, tick)
        if at is None or at[1] != self.timetable.n_microbatches - 1:
            return
        step = at[0] - self.timetable.first_token_step
        if step >= 0:
            self.chooser.end_step(step)

    def _reorder(self, slot: _Slot, sources: torch.Tensor) -> None:
        """Beam search: this stage's cache and per-row inputs follow the chosen beams (transformers' ``beam_idx``)."""
        slot.cache.reorder_cache(sources)
        for name in ("mask", "positions", "types", "encoder_out", "encoder_mask"):
            value = getattr(slot, name)
            if value is not None:
                setattr(slot, name, value.index_select(0, sources))

    def _compact(self, slot: _Slot, live: torch.Tensor) -> None:
        """Drop finished rows from this stage's cache and per-row inputs."""
        self._observe()
        keep = torch.searchsorted(slot.rows, live)
        slot.cache.batch_select_indices(keep)
        for name in ("mask", "positions", "types", "encoder_out", "encoder_mask"):
            value = getattr(slot, name)
            if value is not None:
                setattr(slot, name, value[keep])
        slot.rows = live

    def _stream(self, i: int, t: int) -> None:
        # Flush step t once no microbatch after i can still add a token to it.
        if self.streamer is None:
            return
        if any(not self.slots[(self.last_stage, j)].done for j in range(i + 1, self.timetable.n_microbatches)):
            return
        if self.chooser.generated(t):
            self.streamer.flush(t)
        else:  # the caller's criteria had stopped every row: transformers' loop ended before this step
            self.streamer.discard(t)

    # ------------------------------------------------------------ result
    def result(self) -> dict[str, Any] | None:
        """Last stage's rank: the chooser's result (``sequences``, ``lengths``, records); None elsewhere."""
        return self.chooser.result() if self.is_last else None
