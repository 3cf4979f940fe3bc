"""The continuous decode ring: rows join free slots between steps as others finish.

A long-lived ring over the pipeline's stages. Its ``groups`` microbatches are each a group of
``group_size`` slots; stage 0 runs group ``i`` of step ``t`` after group ``i - 1``, and every other
stage follows it one op behind, as in :mod:`hf_pipeline.generation.timetable`: stage ``k`` runs
group ``i`` of step ``t`` at tick ``t * M + i + k`` with ``M = max(groups, stages)`` (one group per
pipeline rank fills the pipe: a rank runs each of its stages once per group), and a rank that holds
several stages (interleaved and V layouts) runs its stages' ops in tick order, group first within a
tick (then stage), so a group goes depth first through the rank's stages: the static ring's rule
(:func:`~hf_pipeline.generation.timetable.ops_at_tick`). Before each of its ops, stage 0 (whose rank holds the
request queue, through a :class:`~.feeder.Feeder`) hands the tokens that came back to the feeder,
which says which rows finished (stop ids, stop strings, ``max_new_tokens``, a cancelled request),
and lets queued rows into the group's free slots. It sends that decision down the pipe with the
activations, so every stage knows which rows of its group cache stay, which leave and which join;
what a stage then does with them is :mod:`.ring_stage` (decode the kept rows, drop the leaving ones,
prefill the joining ones and merge their cache, and on the last stage choose each row's token).
Which part of a joining row's prompt an op runs is :mod:`.prefill_plan`'s: at most ``prefill_chunk``
prompt tokens an op (a longer prompt joins over the group's next ops, holding its slot, and gets
its first token once it is all in), less the head its prefix cache holds (:mod:`.prefix_cache`).
An encoder-decoder's stages are :mod:`.encoder_decoder_stage`'s: a joining row's prompt runs whole through
the encoder stages and its encoder output travels down with its states; stages before the first decoder
stage pass the kept rows' tokens on (in the bytes of the kept rows' states, :func:`_token_view`).

Tensor and expert parallelism (a stage over ``tp_size`` ranks; expert-parallel ranks are the stage's tp
ranks): every tp rank of a stage runs the same forward on the same rows in the same order. Each tp
slot has its own pipeline group, so the activations below flow slot by slot, as in static
``generate``; only stage 0's lead (tp rank 0, which holds the queue) plans, and broadcasts each op's
header, the kept rows' tokens and the joining rows' JSON to the stage's other tp ranks (tp group).
The last stage's lead alone chooses tokens and replies (its tp ranks hold the same logits).

Data-parallel replicas each run their own ring over their own slots (replica
``d``'s group ``i`` is slot group ``d * groups + i``); the coordinator, replica 0's stage 0 lead, which
holds the queue, plans them all. At each op of group ``i`` it takes every replica's reply of the last
step (each other replica's stage 0 lead forwards its own, unread, over the data-parallel group), lets
rows leave and join every replica's group ``i``, and sends each other replica's lead its plan: the
header, the kept rows' tokens and the size of the reply to come, then the joining rows' JSON. The
replicas so advance op by op together, each on its own rows. With experts over the replicas
(``ep_over="data"``) each op's forwards also match in number across an expert group, as its all-to-all needs
(:meth:`~.ring_stage.RingStage.run`: the short ranks add a throwaway row's forward). FSDP-sharded stages
(whose fsdp ranks are such replicas, each running its own number of forwards) gather every FSDP unit once as
the ring starts, on every rank together (:func:`~hf_pipeline.loading.fsdp.gathered`), and reshard as it ends:
loaded with ``reshard_after_forward=False``, they then run no collective inside the ring.

Note (protocol): between consecutive stages, per op: the packed :class:`~.wire.OpHeader` (int64
``(4 + group_size,)``: run or stop, the kept and joining rows' slots, the joining rows' JSON size;
its layout is in :mod:`.wire`) and the kept rows' hidden states ``(group_size, 1, hidden)`` (zeros
past the kept rows; sent for a stop too; up to an encoder-decoder's first decoder stage, their tokens
as int64 in those bytes), both as bytes in one uint8 message; then, when rows join, their JSON
(:func:`~.wire.pack_rows`: prompt, the part of it this op runs and sampling parameters) and hidden
states ``(joining, widest part, hidden)``, each row's right aligned (an encoder-decoder's: the encoder's
``(joining, widest prompt, hidden)``, after a decoder stage with the decoder's state as one more column).
Last stage -> stage 0, per run op: the float64 :class:`~.wire.Reply`, the chosen token of each row in
header order (the kept rows, then the joining rows whose prompt is now in) with the log-probabilities
the row asked for (its size follows from the op's rows). Every message an op needs was sent by an op of the tick before.
Between stages of one rank, nothing is sent: the message waits in the ring's inbox.
With one stage per rank each directed pair of ranks carries one kind of message stream, in order,
so the fixed-size message is received ahead (posted once the previous op's messages are) and the
reply from the moment stage 0 sends the op; the others when the header gives their size. With
several stages per rank, two streams may share a pair (interleaved at 2 ranks: stage 1 -> 2 and the
reply 3 -> 0 both run rank 1 -> 0), so each tick starts by taking every message its ops need, in the
order their senders sent them (the senders' ops' order: group, then stage): the receives pair up on
any backend, tags or not, and wait only for messages of the tick before (with several stages per rank
there are at most as many groups as stages, so ``M`` is the number of stages and a reply, too, comes
from the tick before).
Stage 0 stops the ring when a whole step had no rows, no row is part-way into its prompt and its feeder
has nothing queued: a stop
header for every group of that step, which each stage passes on before leaving.

Example (every rank; stage 0 passes the feeder):
    >>> ring = ContinuousRing(model, groups=2, group_size=4, feeder=feeder if model.ctx.rank == 0 else None)
    >>> ring.run()                  # until the feeder has been idle for a whole step
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ..core import PipelineCore
from ..errors import InternalError
from ..generation.grammar import GrammarTokenizer
from ..generation.mailbox import Mailbox
from ..generation.timetable import ops_at_tick
from ..loading.fsdp import gathered
from .encoder_decoder_stage import EncoderDecoderStage
from .feeder import Feeder
from .group_cache import merge_refusal
from .prefill_plan import PrefillPlanner
from .prefix_cache import RingPrefix
from .ring_stage import RingStage
from .ring_times import RingTimes
from .wire import NewRow, OpHeader, Reply, pack_rows, unpack_rows

__all__ = ["ContinuousRing", "continuous_refusal"]


def continuous_refusal(model: PipelineCore) -> str | None:
    """Why ``model`` cannot run the continuous ring (the engine then serves static rounds), or None."""
    if model.plan.stages[0].rank != 0:
        return "stage 0 must be on rank 0, where the queue is"
    if model.config.is_encoder_decoder and model.dims.ep_data > 1:  # no expert lock step in its stages
        return "an encoder-decoder's experts over data-parallel replicas"
    return merge_refusal(model.config)


class ContinuousRing:
    """One rank's part of the continuous decode ring (see the module docstring). Collective: every rank
    of the pipeline runs :meth:`run` at the same time.

    Args:
        model: the pipelined model (:func:`continuous_refusal` says None: any number of stages per rank,
            any tp / ep size).
        groups: microbatches in flight (one per pipeline rank fills the pipe; with several stages per rank,
            at most one per stage).
        group_size: slots per group.
        feeder: stage 0's queue (rank 0: stage 0's tp lead); None on the other ranks.
        grammars: the tokenizer compiled for rows that follow a grammar (``response_format``); the last stage's.
        prefill_chunk: prompt tokens an op runs at most (None: whole prompts).
        prefix: this rank's prefix caches, kept across rings (None: no prefix reuse; the same on every rank).
    """

    def __init__(self, model: PipelineCore, *, groups: int, group_size: int, feeder: Feeder | None = None,
                 grammars: GrammarTokenizer | None = None, prefill_chunk: int | None = None,
                 prefix: RingPrefix | None = None):
        self.model, self.groups, self.group_size, self.feeder = model, groups, group_size, feeder
        self.n_stages = model.plan.num_stages
        # Data-parallel replicas: each runs its own ring on its own slots (replica d: groups d * groups ...),
        # all planned by the coordinator, replica 0's stage 0 lead, which holds the queue (module Note).
        self.replicas, self.replica, self.dp_group = model.dims.dp_size, model.dims.dp_rank, model.dims.dp_group
        # An encoder-decoder's rows run their whole prompt through the encoder as they join (no chunks, no prefixes).
        encdec = bool(model.config.is_encoder_decoder)
        if encdec:
            prefill_chunk, prefix = None, None
        lane = EncoderDecoderStage if encdec else RingStage
        self.lanes = [lane(model, s, groups=groups, group_size=group_size,
                           slot_base=self.replica * groups * group_size, grammars=grammars,
                           prefix=None if prefix is None else prefix.stage(s.spec.index))
                      for s in sorted(model.stages, key=lambda s: s.spec.index)]
        self.first = self.lanes[0].first  # this rank holds stage 0
        # Tensor / expert parallelism: each of a stage's tp ranks is in the pipeline of its own tp slot (pp_group),
        # so activations flow slot by slot; only the plan is made once, by stage 0's lead (tp rank 0).
        self.tp_group = model.dims.tp_group
        self.lead = model.dims.tp_rank == 0
        self.coordinator = self.first and self.lead and self.replica == 0
        self.relay = self.first and self.lead and self.replica > 0  # another replica's stage 0 lead
        if self.coordinator and feeder is None:
            raise InternalError("stage 0 of the continuous ring needs the feeder (the request queue)")
        # Several stages per rank: a tick's messages are taken at its start, in their senders' order (module Note).
        self.ordered = len(self.lanes) > 1
        if self.ordered and groups > self.n_stages:
            raise InternalError(f"several stages per rank run at most {self.n_stages} groups (one per stage), "
                                f"got {groups}")
        self.period = max(groups, self.n_stages)  # ticks per step (the module docstring's M)
        self.hidden = int(model.config.get_text_config(decoder=True).hidden_size)
        self.dtype, self.device = model.dtype, model.device
        if encdec and self._op_bytes[1] < 8 * group_size:
            raise InternalError(f"hidden size {self.hidden} leaves no room for the kept rows' token ids in an op")
        self.sent: list[list[int]] = [[] for _ in range(groups * self.replicas)]  # coordinator: each group's rows
        self.planner = PrefillPlanner(chunk=prefill_chunk, indexes=None if prefix is None else
                                      [prefix.index(d) for d in range(self.replicas)])  # coordinator
        self.last_token: dict[int, int] = {}  # stage 0: each row's token to feed next
        self.inbox: dict[tuple, Any] = {}  # ("h", stage, group) / ("tok", group): taken or delivered on this rank
        self.replies: list[tuple[Reply, list]] = [(Reply(()), []) for _ in range(groups * self.replicas)]
        self.reply_sizes = [1] * groups  # stage 0's lead: the size of each own group's next reply
        self.asked: dict[int, int | None] = {}  # stage 0: each live row's logprobs (its reply's layout)
        # Sends are kept alive until done by the ring's own mailbox (receives are posted here: they carry no key).
        # A rank runs at most one step (an op per group) ahead of the peers it sends to, at most 3 messages an op
        # and lane and a reply: the oldest send past this window was received long ago (Mailbox's Note).
        self._window = 32 + 4 * groups * (len(self.lanes) + self.replicas)
        self._mail = Mailbox(pp_rank=model.dims.pp_rank, rank_of=lambda stage: model.plan.stages[stage].rank,
                             dims=model.dims, device=self.device, window=self._window)
        self.steps = 0  # stage 0: steps in which some row ran
        self.peak_cache_bytes = 0
        self.times = RingTimes()  # this rank's seconds: its stages' forwards, waiting on receives, in all
        self._stopping = False  # stage 0: this step stops the ring
        self._tokens_ahead: dict[int, tuple[Any, torch.Tensor]] = {}  # stage 0: token receives posted ahead
        self._ahead: tuple = ()  # one stage per rank, not stage 0: the next op's header and kept-row receives
        self._busy = False  # stage 0: some row ran in this step
        self._dp_sends: deque[tuple[Any, torch.Tensor]] = deque()  # coordinator <-> relays, kept alive until done

    @property
    def forwards(self) -> int:
        """Stage forward calls on this rank."""
        return sum(lane.forwards for lane in self.lanes)

    @property
    def prefill(self) -> tuple[int, int, int]:
        """This rank's stages: ops with joining rows, the forwards those ran, the most rows with a past (an
        earlier chunk, a reused prefix) that one forward ran."""
        return (sum(lane.prefill_ops for lane in self.lanes), sum(lane.prefill_forwards for lane in self.lanes),
                max(lane.peak_stacked for lane in self.lanes))

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens this rank's stages copied from their prefix caches instead of computing them."""
        return sum(lane.reused_tokens for lane in self.lanes)

    # ------------------------------------------------------------ messages
    def _local(self, stage: int) -> bool:
        return self.model.plan.stages[stage].rank == self.model.dims.pp_rank

    def _peer(self, stage: int) -> int:
        return self.model.dims.global_rank(self.model.plan.stages[stage].rank)

    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        self._mail.send(tensor, self.model.plan.stages[stage].rank)
        self._mail.prune()

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.recv, buf, src=self._peer(stage), group=self.model.dims.pp_group)
        return buf

    def _wait(self, fn, *args, **kwargs) -> None:
        """A blocking receive (a posted one's ``wait``, the plan's broadcast to the tp ranks), timed as waiting."""
        start = time.perf_counter()
        fn(*args, **kwargs)
        self.times.wait += time.perf_counter() - start

    def _post(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> tuple[Any, torch.Tensor]:
        # Posted ahead, in the order the peer sends: the message lands while this rank computes.
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(buf, src=self._peer(stage), group=self.model.dims.pp_group), buf

    @property
    def _op_bytes(self) -> tuple[int, int]:
        """Bytes of an op's fixed message: the int64 header, then the kept rows' states."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return OpHeader.nbytes(self.group_size), self.group_size * self.hidden * itemsize

    def _post_next_op(self, lane: RingStage) -> None:
        """One stage per rank, not stage 0: receive the next op's fixed-size message (header, kept states) ahead."""
        self._ahead = self._post((sum(self._op_bytes),), torch.uint8, lane.index - 1)

    def _read_op(self, fixed: torch.Tensor, lane: RingStage) -> tuple:
        """An op's messages to ``lane`` once its fixed-size one arrived: header, kept rows' states and, when rows
        join, their JSON and states (received now: their size is in the header)."""
        head, stage = self._op_bytes[0], lane.index
        header = OpHeader.unpack(fixed[:head].view(torch.long))
        kept = fixed[head:].view(self.dtype).view(self.group_size, 1, self.hidden)
        payload = new_in = None
        if header.payload_bytes:
            payload = self._recv((header.payload_bytes,), torch.uint8, stage - 1)
            rows = unpack_rows(payload)
            new_in = self._recv((len(rows), lane.received_width(rows), self.hidden), self.dtype, stage - 1)
        return header, kept, payload, new_in

    def _ops_at(self, tick: int) -> list[tuple[RingStage, int, int]]:
        """``(lane, step, group)`` of this rank's ops at ``tick``, in the order it runs them: group, then stage."""
        return ops_at_tick(((lane, lane.index) for lane in self.lanes if not lane.done), tick, period=self.period,
                           count=self.groups)

    def _gather(self, tick: int) -> None:
        """Several stages per rank: take every message from another rank that this tick's ops need, in the order
        their senders sent them at the tick before: the order of the senders' ops (group, then sender stage)."""
        takes = []
        for lane, t, i in self._ops_at(tick):
            if not lane.first and not self._local(lane.index - 1):
                takes.append(((i, lane.index - 1), lane, i))
            elif lane.first and t > 0 and self.lead and not self._local(self.n_stages - 1):
                takes.append(((i, self.n_stages - 1), lane, i))
        for _, lane, i in sorted(takes, key=lambda take: take[0]):
            if not lane.first:
                fixed = self._recv((sum(self._op_bytes),), torch.uint8, lane.index - 1)
                self.inbox[("h", lane.index, i)] = self._read_op(fixed, lane)
            else:
                self.inbox[("tok", i)] = self._recv((self.reply_sizes[i],), torch.float64, self.n_stages - 1)

    def _take(self, lane: RingStage, i: int) -> tuple:
        """Not stage 0: this op's header, kept rows' states, joining rows' JSON and states; with one stage per
        rank from the receive posted ahead (then the next op's goes up), else from the inbox."""
        if self.ordered:
            return self.inbox.pop(("h", lane.index, i))
        work, buf = self._ahead
        self._wait(work.wait)
        header, kept, payload, new_in = self._read_op(buf, lane)
        # After a stop only the other groups' stops follow; after the last group's, nothing.
        if header.run or i < self.groups - 1:
            self._post_next_op(lane)
        return header, kept, payload, new_in

    def _pass_on(self, lane: RingStage, i: int, header: OpHeader, old_out, payload, new_out) -> None:
        """To the next stage, in the order it receives: header, kept rows (always ``group_size`` of them,
        zeros past the kept ones, so it can post the receive ahead), then the joining rows' JSON and states."""
        if lane.last:
            return
        kept = torch.zeros(self.group_size, 1, self.hidden, dtype=self.dtype, device=self.device)
        if old_out is not None and old_out.dtype == torch.long:  # token ids, for the first decoder stage
            _token_view(kept, old_out.shape[0])[:] = old_out
        elif old_out is not None:
            kept[: old_out.shape[0]] = old_out.to(self.dtype)
        if self._local(lane.index + 1):
            self.inbox[("h", lane.index + 1, i)] = (header, kept, payload, new_out)
            return
        # One message for both (the header as bytes, then the states' bytes): one hand-over per op, not two.
        packed = header.pack(self.group_size, self.device)
        self._send(torch.cat([packed.view(torch.uint8), kept.view(-1).view(torch.uint8)]), lane.index + 1)
        if payload is not None:
            self._send(payload, lane.index + 1)
            self._send(new_out.to(self.dtype), lane.index + 1)

    def _reply(self, i: int, message: torch.Tensor) -> None:
        if self._local(0):
            self.inbox[("tok", i)] = message
        else:
            self._send(message, 0)

    # ------------------------------------------------------------ the loop
    # No autograd: the group caches live across steps for as long as the ring has rows, so a graph recorded
    # on them would keep every step's activations alive while the server is busy (memory growing with load).
    @torch.no_grad()
    def run(self) -> None:
        """Serve until stage 0 finds a whole step without rows and nothing queued (collective)."""
        # FSDP: every unit gathered here, on every rank at once; none inside the ring (module docstring).
        start = time.perf_counter()
        try:
            with gathered(self.model.stages) if self.model.dims.fsdp_size > 1 else contextlib.nullcontext():
                self._loop()
        finally:
            self.times.total += time.perf_counter() - start
            self.times.forwards_of(self.lanes)

    def _loop(self) -> None:
        if not self.ordered and not self.first:
            self._post_next_op(self.lanes[0])
        tick = 0
        try:
            while not all(lane.done for lane in self.lanes):
                if self.ordered:
                    self._gather(tick)
                for lane, t, i in self._ops_at(tick):
                    if not self._op(lane, i, t) and i == self.groups - 1:
                        lane.done = True
                tick += 1
        finally:
            self._observe()
            self._mail.close()
            for work, _ in self._dp_sends:
                work.wait()
        if self.inbox:
            raise InternalError(f"the continuous ring ended with unconsumed messages {sorted(self.inbox)}")

    def _op(self, lane: RingStage, i: int, t: int) -> bool:
        """Group ``i`` of step ``t`` on ``lane`` (one of this rank's stages); False when it was a stop."""
        if lane.first:
            if self.coordinator:
                header, new, payload, tokens = self._coordinate(i, t)
            else:
                header, new, payload, tokens = self._relayed(i, t) if self.relay else (None, [], None, None)
            if self.tp_group is not None:
                header, new, payload, tokens = self._share_plan(header, payload, tokens)
            old_in, new_in = torch.tensor([[tok] for tok in tokens], dtype=torch.long, device=self.device), None
        else:
            header, kept, payload, new_in = self._take(lane, i)
            new = unpack_rows(payload) if payload is not None else []
            n = len(header.kept)
            old_in = _token_view(kept, n).clone() if lane.takes_tokens else kept[:n]
        if not header.run:
            self._pass_on(lane, i, header, None, None, None)
            return False
        old_out, new_out = lane.run(i, header, new, old_in, new_in)
        if not lane.last:
            self._pass_on(lane, i, header, old_out, payload, new_out)
        elif self.lead:  # the other tp ranks hold the same logits; one choice, one reply
            self._reply(i, lane.choose(i, new, old_out, new_out))
        self._observe()  # after the op's messages left: the next stage need not wait for this count
        return True

    def _observe(self) -> None:
        self.peak_cache_bytes = max(self.peak_cache_bytes, sum(lane.cache_bytes() for lane in self.lanes))

    # ------------------------------------------------------------ stage 0: who runs
    def _share_plan(self, header: OpHeader | None, payload: torch.Tensor | None, tokens: list[int] | None
                    ) -> tuple[OpHeader, list[NewRow], torch.Tensor | None, list[int]]:
        """Stage 0 under tensor / expert parallelism: the lead's plan to the stage's other tp ranks (a broadcast
        in the tp group: the header and the kept rows' tokens, then the joining rows' JSON), so that every tp
        rank runs the same rows in the same order; returns what the lead planned, on every tp rank."""
        head = OpHeader.nbytes(self.group_size) // 8
        fixed = torch.full((head + self.group_size,), -1, dtype=torch.long, device=self.device)
        if self.lead:
            fixed[:head] = header.pack(self.group_size, self.device)
            fixed[head: head + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self._wait(dist.broadcast, fixed, group=self.tp_group, group_src=0)
        header = OpHeader.unpack(fixed[:head])
        if header.payload_bytes:
            if not self.lead:
                payload = torch.empty(header.payload_bytes, dtype=torch.uint8, device=self.device)
            self._wait(dist.broadcast, payload, group=self.tp_group, group_src=0)
        new = unpack_rows(payload) if payload is not None else []
        return header, new, payload, fixed[head: head + len(header.kept)].tolist()

    def _tokens(self, i: int) -> torch.Tensor:
        """Stage 0: group ``i``'s reply of the last step (in the inbox, else from its receive posted ahead)."""
        if ("tok", i) in self.inbox:
            return self.inbox.pop(("tok", i))
        work, message = self._tokens_ahead.pop(i)
        self._wait(work.wait)
        return message

    def _coordinate(self, i: int, t: int) -> tuple[OpHeader, list[NewRow], torch.Tensor | None, list[int]]:
        """The coordinator: group ``i``'s tokens of the last step from every replica, its rows leave and join; each
        other replica's plan sent to its stage 0 lead; replica 0's header, joining rows, their JSON (None when none
        join) and the kept rows' next input tokens returned."""
        if i == 0:
            self._busy = False
        own = [d * self.groups + i for d in range(self.replicas)]  # group i of each replica
        kept: list[list[int]] = [[] for _ in own]
        if t > 0:
            messages = [self._tokens(i)] + [self._dp_recv((self.replies[g][0].size,), torch.float64, d)
                                            for d, g in enumerate(own) if d > 0]
            kept = [self._deliver(g, m) for g, m in zip(own, messages)]
        if i == 0 and t > 0:
            self._stopping = not any(self.sent) and not self.planner.partial and self.feeder.idle()
        plans = [self._admit(g, k, stop=t > 0 and self._stopping) for g, k in zip(own, kept)]
        for d, (header, _, payload, tokens) in enumerate(plans[1:], start=1):
            size = self.replies[own[d]][0].size if header.run else 0
            tail = tokens + [-1] * (self.group_size - len(tokens)) + [size]
            fixed = torch.cat([header.pack(self.group_size, self.device), torch.tensor(tail, device=self.device)])
            for x in (fixed, payload) if payload is not None else (fixed,):
                self._dp_send(x, d)
        header = plans[0][0]
        self.reply_sizes[i] = self.replies[i][0].size
        if header.run and not self.ordered and not self._local(self.n_stages - 1):
            # this run op's reply comes back: post the receive now (its exact size), in op order. Before the op
            # goes down, not after: gloo sends a message once its receiver posted the receive (a note that travels
            # ahead of the op here), and a note posted after the op could come after the reply was ready.
            self._tokens_ahead[i] = self._post((self.reply_sizes[i],), torch.float64, self.n_stages - 1)
        return plans[0]

    def _dp_send(self, tensor: torch.Tensor, replica: int) -> None:
        self._dp_sends.append((dist.isend(tensor, group=self.dp_group, group_dst=replica), tensor))
        while len(self._dp_sends) > self._window:  # the oldest were received long ago (as the mailbox's sends)
            self._dp_sends.popleft()[0].wait()

    def _dp_recv(self, shape: tuple[int, ...], dtype: torch.dtype, replica: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.recv, buf, group=self.dp_group, group_src=replica)
        return buf

    def _relayed(self, i: int, t: int) -> tuple[OpHeader, list[NewRow], torch.Tensor | None, list[int]]:
        """Another replica's stage 0 lead: group ``i``'s reply of the last step to the coordinator (unread), then
        the coordinator's plan for this op: header, kept rows' tokens, the reply's size, the joining rows' JSON."""
        if t > 0:
            self._dp_send(self._tokens(i), 0)
        head = OpHeader.nbytes(self.group_size) // 8
        fixed = self._dp_recv((head + self.group_size + 1,), torch.long, 0)
        header = OpHeader.unpack(fixed[:head])
        payload = self._dp_recv((header.payload_bytes,), torch.uint8, 0) if header.payload_bytes else None
        self.reply_sizes[i] = int(fixed[-1])
        if header.run and not self.ordered and not self._local(self.n_stages - 1):
            self._tokens_ahead[i] = self._post((self.reply_sizes[i],), torch.float64, self.n_stages - 1)
        new = unpack_rows(payload) if payload is not None else []
        return header, new, payload, fixed[head: head + len(header.kept)].tolist()

    def _deliver(self, g: int, message: torch.Tensor) -> list[int]:
        """The coordinator: replica group ``g``'s tokens to the feeder; the slots of the rows that stay."""
        layout, prompts = self.replies[g]
        kept = []
        for slot, (token, chosen, prompt_lp) in zip(self.sent[g], layout.unpack(message, prompts)):
            if not self.feeder.deliver(slot, token, chosen, prompt_lp):
                kept.append(slot)
                self.last_token[slot] = token
            else:
                self.last_token.pop(slot, None)
                self.asked.pop(slot, None)
        return kept

    def _admit(self, g: int, kept: list[int], stop: bool) -> tuple[OpHeader, list[NewRow], torch.Tensor | None,
                                                                     list[int]]:
        """The coordinator: replica group ``g``'s op (``kept`` stay, queued rows join its free slots): the header,
        the joining rows, their JSON (None when none join) and the kept rows' next input tokens."""
        if stop:
            return OpHeader.stop(), [], None, []
        slots = range(g * self.group_size, (g + 1) * self.group_size)
        new = self.planner.plan(g // self.groups, slots, kept, self.feeder.admit)
        final = [r for r in new if r.final]  # rows part-way into their prompt get no token yet
        order = kept + [r.slot for r in final]
        self.sent[g] = order
        self.asked.update({r.slot: r.logprobs for r in final})
        joining: list[NewRow | None] = [None] * len(kept) + final
        self.replies[g] = (Reply.of(joining, self.asked, order), [None if r is None else r.prompt for r in joining])
        payload = pack_rows(new, self.device) if new else None
        header = OpHeader(run=True, kept=tuple(kept), joining=tuple(r.slot for r in new),
                          payload_bytes=0 if payload is None else payload.numel())
        if order or new:
            if not self._busy:
                self.steps += 1
            self._busy = True
        return header, new, payload, [self.last_token[s] for s in kept]


def _token_view(kept: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` kept rows' token ids ``(n, 1)`` int64, in the bytes of the kept states ``(group_size, 1,
    hidden)``: before the first decoder stage of an encoder-decoder the kept rows carry tokens, not states."""
    return kept.view(-1).view(torch.uint8)[: 8 * n].view(torch.long).view(n, 1)
