"""The continuous decode ring: rows join free slots between steps as others finish.

A long-lived ring over the pipeline's stages (one stage per rank). Its ``groups`` microbatches are
each a group of ``group_size`` slots; stage 0 runs group ``i`` of step ``t`` after group ``i - 1``,
and every other stage follows it one op behind, as in :mod:`hf_pipeline.generation.timetable`
(``groups`` equal to the number of stages fills the pipe). Before each of its ops, stage 0 (whose
rank holds the request queue, through a :class:`~.feeder.Feeder`) hands the tokens that came back to
the feeder, which says which rows finished (stop ids, stop strings, ``max_new_tokens``, a cancelled
request), and lets queued rows into the group's free slots. It sends that decision down the pipe
with the activations, so every stage knows which rows of its group cache stay, which leave and
which join:

  * rows that stay run one decode step on the group's cache;
  * rows that leave are dropped from it (``Cache.batch_select_indices``), and cache columns that
    no remaining row uses any more are cut from the left, so memory follows what is live;
  * rows that join run their whole prompt through the stage with a fresh cache (left padded
    among themselves, with an attention mask), whose keys and values are then put next to the
    group's, right aligned: the shorter side is left padded with zero columns that the mask hides.
    Positions are per row (``cumsum(mask) - 1`` as transformers makes them), so padding never
    changes a row's tokens: greedy rows equal transformers' ``generate`` of each request alone.
    Sliding-window layers keep only their window's last columns through all of this
    (:mod:`.group_cache`, which also names the cache layers the ring does not merge).

The last stage chooses each row's token from its own logits processors (transformers', built from
the row's merged ``GenerationConfig``) and, when sampling, its own generator seeded from
``(seed, choice index)`` (``generation.sampling.row_seed``): a row's tokens never depend on its neighbours.

Note (protocol): between consecutive stages, per op: the packed :class:`~.wire.OpHeader` (int64
``(4 + group_size,)``: run or stop, the kept and joining rows' slots, the joining rows' JSON size;
its layout is in :mod:`.wire`) and the kept rows' hidden states ``(group_size, 1, hidden)`` (zeros
past the kept rows; sent for a stop too), both as bytes in one uint8 message; then, when rows join,
their JSON (:func:`~.wire.pack_rows`: prompt and sampling parameters) and hidden states ``(joining,
longest prompt, hidden)``. The fixed-size message is received ahead (posted once the previous op's
messages are), the others when the header gives their size.
Last stage -> stage 0, per run op: the float64 :class:`~.wire.Reply`, the chosen token of each row in
header order with the log-probabilities the row asked for (its size follows from the op's rows),
received ahead from the moment stage 0 sends the op. Each directed pair of ranks carries one
kind of message stream, in order, so the receives pair up on any backend. Stage 0 stops the ring
when a whole step had no rows and its feeder has nothing queued: a stop header for every group of
that step, which each stage passes on before leaving.

Example (every rank; stage 0 passes the feeder):
    >>> ring = ContinuousRing(model, groups=2, group_size=4, feeder=feeder if model.ctx.rank == 0 else None)
    >>> ring.run()                  # until the feeder has been idle for a whole step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import DynamicCache, MinNewTokensLengthLogitsProcessor

from ..compat import generation_helper
from ..core import PipelineCore
from ..errors import InternalError
from ..generation.config import prepare_generation_config
from ..generation.grammar import GrammarProcessor, GrammarTokenizer
from ..generation.kv_cache import cache_nbytes, new_cache
from ..generation.logprobs import entries
from ..generation.mailbox import Mailbox
from ..generation.penalties import penalty_processors
from ..generation.sampling import left_padded_position_ids, row_generators, select_tokens
from .feeder import Feeder
from .group_cache import cut_columns, merge, merge_refusal
from .wire import NewRow, OpHeader, Reply, pack_rows, unpack_rows

__all__ = ["ContinuousRing", "continuous_refusal"]


def continuous_refusal(model: PipelineCore) -> str | None:
    """Why ``model`` cannot run the continuous ring (the engine then serves static rounds), or None."""
    if model.config.is_encoder_decoder:
        return "encoder-decoder models decode against a per-request encoder output"
    if model.dims.dp_size > 1 or model.dims.tp_size > 1:
        return "data-parallel replicas and tensor parallelism are served in static rounds"
    if any(len(model.plan.stages_for_rank(r)) != 1 for r in range(model.plan.pp_size)):
        return "the continuous ring runs one stage per rank"
    if model.plan.stages[0].rank != 0:
        return "stage 0 must be on rank 0, where the queue is"
    return merge_refusal(model.config)


@dataclass
class _Group:
    """One group (microbatch) on this stage: its slots in row order, their cache, mask and next positions."""

    slots: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # (rows, cache length) long
    next_pos: torch.Tensor | None = None  # (rows,) position of each row's next token


@dataclass
class _Row:
    """Last stage: one row's sequence so far, its logits processors and, when sampling, its generator."""

    ids: torch.Tensor  # (1, L)
    processors: Any
    generator: torch.Generator | None
    logprobs: int | None = None  # alternatives sent back with each chosen token's log-probability


class ContinuousRing:
    """One rank's part of the continuous decode ring (see the module docstring). Collective: every rank
    of the pipeline runs :meth:`run` at the same time.

    Args:
        model: the pipelined model (one stage per rank: :func:`continuous_refusal` says None).
        groups: microbatches in flight (the number of stages fills the pipe).
        group_size: slots per group.
        feeder: stage 0's queue (rank 0); None on the other ranks.
        grammars: the tokenizer compiled for rows that follow a grammar (``response_format``); the last stage's.
    """

    def __init__(self, model: PipelineCore, *, groups: int, group_size: int, feeder: Feeder | None = None,
                 grammars: GrammarTokenizer | None = None):
        self.model, self.groups, self.group_size, self.feeder = model, groups, group_size, feeder
        self.grammars = grammars
        (self.stage,) = model.stages
        self.index = self.stage.spec.index
        self.n_stages = model.plan.num_stages
        self.first, self.last = self.index == 0, self.index == self.n_stages - 1
        if self.first and feeder is None:
            raise InternalError("stage 0 of the continuous ring needs the feeder (the request queue)")
        self.hidden = int(model.config.get_text_config(decoder=True).hidden_size)
        self.dtype, self.device = model.dtype, model.device
        self.state = [_Group() for _ in range(groups)]
        self.rows: dict[int, _Row] = {}  # last stage
        self.sent: list[list[int]] = [[] for _ in range(groups)]  # stage 0: the rows each group ran last
        self.last_token: dict[int, int] = {}  # stage 0: each row's token to feed next
        self.local_tokens: dict[int, torch.Tensor] = {}  # one stage: the chosen tokens, without a send
        self.replies: list[tuple[Reply, list]] = [(Reply(()), []) for _ in range(groups)]  # stage 0: per group
        self.asked: dict[int, int | None] = {}  # stage 0: each live row's logprobs (its reply's layout)
        # Sends are kept alive until done by the ring's own mailbox (receives are posted here: they carry no key).
        self._mail = Mailbox(pp_rank=model.dims.pp_rank, rank_of=lambda stage: model.plan.stages[stage].rank,
                             dims=model.dims, device=self.device)
        self._configs: dict[tuple, Any] = {}
        self.steps = 0  # stage 0: steps in which some row ran
        self.forwards = 0  # stage forward calls on this rank
        self.peak_cache_bytes = 0
        self._stopping = False  # stage 0: this step stops the ring
        self._tokens_ahead: dict[int, tuple[Any, torch.Tensor]] = {}  # stage 0: token receives posted ahead
        self._ahead: tuple = ()  # other stages: the next op's header and kept-row receives
        self._busy = False  # stage 0: some row ran in this step

    # ------------------------------------------------------------ messages
    def _peer(self, stage: int) -> int:
        return self.model.dims.global_rank(self.model.plan.stages[stage].rank)

    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        self._mail.send(tensor, self.model.plan.stages[stage].rank)
        self._mail.prune()

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=self._peer(stage), group=self.model.dims.pp_group)
        return buf

    def _post(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> tuple[Any, torch.Tensor]:
        # Posted ahead, in the order the peer sends: the message lands while this rank computes.
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(buf, src=self._peer(stage), group=self.model.dims.pp_group), buf

    @property
    def _op_bytes(self) -> tuple[int, int]:
        """Bytes of an op's fixed message: the int64 header, then the kept rows' states."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return OpHeader.nbytes(self.group_size), self.group_size * self.hidden * itemsize

    def _post_next_op(self) -> None:
        """Non-first stage: receive the next op's fixed-size message (header and kept rows' states) ahead."""
        self._ahead = self._post((sum(self._op_bytes),), torch.uint8, self.index - 1)

    # ------------------------------------------------------------ the loop
    # No autograd: the group caches live across steps for as long as the ring has rows, so a graph recorded
    # on them would keep every step's activations alive while the server is busy (memory growing with load).
    @torch.no_grad()
    def run(self) -> None:
        """Serve until stage 0 finds a whole step without rows and nothing queued (collective)."""
        t = 0
        if not self.first:
            self._post_next_op()
        try:
            while True:
                stop = False
                for i in range(self.groups):
                    stop = not self._op(i, t) or stop
                if stop:
                    return
                t += 1
        finally:
            self._observe()
            self._mail.close()

    def _op(self, i: int, t: int) -> bool:
        """Group ``i`` of step ``t`` on this stage; False when it was a stop."""
        if self.first:
            header, new, payload = self._plan(i, t)
            kept = None
        else:
            header, kept, payload, new_in = self._take(i)
            new = unpack_rows(payload) if payload is not None else []
        if not header.run:
            self._pass_on(header, None, None, None)
            return False
        old_slots = list(header.kept)
        n_old = len(old_slots)
        self._keep(self.state[i], old_slots)
        if self.first:
            old_in = torch.tensor([[self.last_token[s]] for s in old_slots], dtype=torch.long, device=self.device)
        else:
            old_in = kept[:n_old]
        old_out = self._decode(self.state[i], old_in) if n_old else None
        new_out = self._prefill(self.state[i], new, None if self.first else new_in) if new else None
        self.state[i].slots = old_slots + [r.slot for r in new]
        if self.last:
            self._choose(i, header, new, old_out, new_out)
        else:
            self._pass_on(header, old_out, payload, new_out)
        return True

    def _take(self, i: int) -> tuple[OpHeader, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Non-first stage: this op's header, kept rows' hidden states and, when rows join, their JSON and
        hidden states (received now: their size is in the header); then the next op's receives go up."""
        work, buf = self._ahead
        work.wait()
        head = self._op_bytes[0]
        header = OpHeader.unpack(buf[:head].view(torch.long))
        kept = buf[head:].view(self.dtype).view(self.group_size, 1, self.hidden)
        payload = new_in = None
        if header.payload_bytes:
            payload = self._recv((header.payload_bytes,), torch.uint8, self.index - 1)
            rows = unpack_rows(payload)
            new_in = self._recv((len(rows), max(len(r.prompt) for r in rows), self.hidden), self.dtype,
                                self.index - 1)
        # After a stop only the other groups' stops follow; after the last group's, nothing.
        if header.run or i < self.groups - 1:
            self._post_next_op()
        return header, kept, payload, new_in

    def _pass_on(self, header: OpHeader, old_out, payload, new_out) -> None:
        """To the next stage, in the order it receives: header, kept rows (always ``group_size`` of them,
        zeros past the kept ones, so it can post the receive ahead), then the joining rows' JSON and states."""
        if self.last:
            return
        kept = torch.zeros(self.group_size, 1, self.hidden, dtype=self.dtype, device=self.device)
        if old_out is not None:
            kept[: old_out.shape[0]] = old_out.to(self.dtype)
        # One message for both (the header as bytes, then the states' bytes): one hand-over per op, not two.
        packed = header.pack(self.group_size, self.device)
        self._send(torch.cat([packed.view(torch.uint8), kept.view(-1).view(torch.uint8)]), self.index + 1)
        if payload is not None:
            self._send(payload, self.index + 1)
            self._send(new_out.to(self.dtype), self.index + 1)

    # ------------------------------------------------------------ stage 0: who runs
    def _plan(self, i: int, t: int) -> tuple[OpHeader, list[NewRow], torch.Tensor | None]:
        """Stage 0: take group ``i``'s tokens of the last step, let rows leave and join; the header, the
        joining rows and their JSON (None when none join)."""
        if t > 0:
            if self.n_stages > 1:
                work, message = self._tokens_ahead.pop(i)
                work.wait()
            else:
                message = self.local_tokens.pop(i)
            layout, prompts = self.replies[i]
            kept = []
            for slot, (token, chosen, prompt_lp) in zip(self.sent[i], layout.unpack(message, prompts)):
                if not self.feeder.deliver(slot, token, chosen, prompt_lp):
                    kept.append(slot)
                    self.last_token[slot] = token
                else:
                    self.last_token.pop(slot, None)
                    self.asked.pop(slot, None)
        else:
            kept = []
        if i == 0 and t > 0:
            self._stopping = not any(self.sent) and self.feeder.idle()
        if t > 0 and self._stopping:
            return OpHeader.stop(), [], None
        base = i * self.group_size
        free = [s for s in range(base, base + self.group_size) if s not in kept]
        new = self.feeder.admit(free) if free else []
        if any(r.slot not in free for r in new):
            raise InternalError("the feeder admitted a row into a slot that is not free")
        order = kept + [r.slot for r in new]
        self.sent[i] = order
        self.asked.update({r.slot: r.logprobs for r in new})
        joining: list[NewRow | None] = [None] * len(kept) + list(new)
        layout = Reply.of(joining, self.asked, order)
        self.replies[i] = (layout, [None if r is None else r.prompt for r in joining])
        if self.n_stages > 1:  # this run op's reply comes back: post the receive now (its exact size), in op order
            self._tokens_ahead[i] = self._post((layout.size,), torch.float64, self.n_stages - 1)
        payload = pack_rows(new, self.device) if new else None
        header = OpHeader(run=True, kept=tuple(kept), joining=tuple(r.slot for r in new),
                          payload_bytes=0 if payload is None else payload.numel())
        if i == 0:
            self._busy = False
        if order:
            if not self._busy:
                self.steps += 1
            self._busy = True
        return header, new, payload

    # ------------------------------------------------------------ every stage: caches
    def _observe(self) -> None:
        total = sum(cache_nbytes(g.cache) for g in self.state)
        self.peak_cache_bytes = max(self.peak_cache_bytes, total)

    def _keep(self, g: _Group, slots: list[int]) -> None:
        """Keep only ``slots`` (in their order) in group ``g``; cut cache columns no kept row uses."""
        if slots == g.slots:
            return
        self._observe()
        if not slots:
            g.slots, g.cache, g.mask, g.next_pos = [], None, None, None
            return
        try:
            keep = torch.tensor([g.slots.index(s) for s in slots], dtype=torch.long, device=self.device)
        except ValueError:
            raise InternalError(f"the ring kept slots {slots} that this stage does not hold ({g.slots})") from None
        g.cache.batch_select_indices(keep)
        g.mask, g.next_pos, g.slots = g.mask[keep], g.next_pos[keep], slots
        used = g.mask.any(dim=0).nonzero()
        cut = int(used[0, 0]) if used.numel() else g.mask.shape[1]
        if cut:
            g.mask = g.mask[:, cut:]
            cut_columns(g.cache, cut, g.mask.shape[1])

    def _forward(self, received: torch.Tensor, cache, mask, positions, every_logit: bool = False) -> torch.Tensor:
        inputs: dict[str, Any] = {"cache": cache, "attention_mask": mask, "position_ids": positions}
        if self.first:
            inputs["input_ids"] = received
            hidden: tuple = ()
        else:
            hidden = (received,)
        if self.last and not every_logit:  # every position's logits: a joining row asked for its prompt's logprobs
            inputs["logits_to_keep"] = 1
        self.forwards += 1
        out = self.stage(*hidden, **inputs)
        return out[0] if isinstance(out, tuple) else out

    def _decode(self, g: _Group, received: torch.Tensor) -> torch.Tensor:
        """The kept rows' next step on the group cache."""
        g.mask = torch.cat([g.mask, g.mask.new_ones(g.mask.shape[0], 1)], dim=1)
        out = self._forward(received, g.cache, g.mask, g.next_pos[:, None])
        g.next_pos = g.next_pos + 1
        return out

    def _prefill(self, g: _Group, new: list[NewRow], received: torch.Tensor | None) -> torch.Tensor:
        """The joining rows' prompts on a fresh cache, then put next to the group's (right aligned)."""
        width = max(len(r.prompt) for r in new)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in new],
                            dtype=torch.long, device=self.device)
        if self.first:
            # The padding positions' ids are masked out; 0 is any valid id.
            received = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in new],
                                    dtype=torch.long, device=self.device)
        cache = new_cache(self.model.config, encoder_decoder=False)
        every = self.last and any(r.prompt_logprobs is not None for r in new)
        out = self._forward(received, cache, mask, left_padded_position_ids(mask, width).to(self.device), every)
        lengths = mask.sum(dim=1)
        if g.cache is None:
            g.cache, g.mask, g.next_pos = cache, mask, lengths
            return out
        g.mask = merge(g.cache, g.mask, cache, mask)
        g.next_pos = torch.cat([g.next_pos, lengths])
        self._observe()
        return out

    # ------------------------------------------------------------ last stage: tokens
    def _row(self, r: NewRow) -> _Row:
        do_sample = r.temperature > 0
        key = (do_sample, r.temperature, r.top_p, r.max_new_tokens)
        if key not in self._configs:
            kw = {"do_sample": True, "temperature": r.temperature, "top_p": r.top_p} if do_sample else {
                "do_sample": False}
            self._configs[key] = prepare_generation_config(self.model, None, max_new_tokens=r.max_new_tokens, **kw)[0]
        prompt = torch.tensor([r.prompt], dtype=torch.long, device=self.device)
        custom = penalty_processors(prompt_length=len(r.prompt), presence=r.presence_penalty,
                                    frequency=r.frequency_penalty, repetition=r.repetition_penalty,
                                    bias={int(t): b for t, b in r.logit_bias})
        if r.min_tokens and r.stop_ids:
            # transformers' own processor, given the row's stop ids (EOS unless ignored, and its stop ids) as
            # vLLM's min_tokens suppresses both; a custom processor runs before the sampling warpers.
            custom.append(MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=len(r.prompt),
                                                            min_new_tokens=r.min_tokens, eos_token_id=r.stop_ids,
                                                            device=self.device))
        if r.grammar is not None:
            if self.grammars is None:
                raise InternalError("a row follows a grammar but the ring was given no tokenizer for it")
            custom.append(GrammarProcessor(self.grammars, r.grammar, prompt_length=len(r.prompt)))
        processors = generation_helper(self.model.skeleton, "_get_logits_processor")(
            generation_config=self._configs[key], input_ids_seq_length=prompt.shape[1], encoder_input_ids=prompt,
            logits_processor=custom, device=self.device,
            model_kwargs={"attention_mask": torch.ones_like(prompt)},
        )
        gen = row_generators(r.seed if r.seed is not None else 0, [r.index], self.device)[0] if do_sample else None
        return _Row(ids=prompt, processors=processors, generator=gen, logprobs=r.logprobs)

    def _choose(self, i: int, header: OpHeader, new: list[NewRow], old_out, new_out) -> None:
        """Last stage: each row's token from its own processors (and generator), back to stage 0 with the
        log-probabilities the row asked for (:class:`~.wire.Reply`)."""
        slots = self.state[i].slots
        group = range(i * self.group_size, (i + 1) * self.group_size)
        for s in [s for s in self.rows if s in group and s not in slots]:
            del self.rows[s]  # left the ring
        for r in new:
            self.rows[r.slot] = self._row(r)
        parts = [o[:, -1, :] for o in (old_out, new_out) if o is not None]
        logits = torch.cat(parts).float() if parts else None
        tokens, chosen = [], []
        for j, slot in enumerate(slots):
            row = self.rows[slot]
            scores = row.processors(row.ids, logits[j: j + 1])
            gens = [row.generator] if row.generator is not None else None
            token = select_tokens(scores, do_sample=row.generator is not None, generators=gens)
            row.ids = torch.cat([row.ids, token[:, None].to(row.ids.device)], dim=1)
            tokens.append(int(token[0]))
            chosen.append(None if row.logprobs is None else
                          entries(torch.log_softmax(scores.float(), dim=-1), token, row.logprobs)[0])
        n_old = len(slots) - len(new)
        prompts = [None] * n_old + [self._prompt_entries(r, new_out[k], new_out.shape[1]) for k, r in enumerate(new)]
        layout = Reply.of([None] * n_old + list(new), {s: self.rows[s].logprobs for s in slots}, slots)
        message = layout.pack(tokens, chosen, prompts, self.device)
        if self.first:
            self.local_tokens[i] = message
        else:
            self._send(message, 0)

    @staticmethod
    def _prompt_entries(r: NewRow, logits: torch.Tensor, width: int) -> torch.Tensor | None:
        """A joining row's prompt log-probabilities from its prefill logits ``(width, V)`` (left padded):
        position ``p``'s raw logits give token ``p + 1``; None when it did not ask."""
        if r.prompt_logprobs is None:
            return None
        start = width - len(r.prompt)
        logprobs = torch.log_softmax(logits[start: width - 1].float(), dim=-1)  # (len - 1, V)
        return entries(logprobs, torch.tensor(r.prompt[1:], dtype=torch.long), r.prompt_logprobs)
