"""When each stage of the decode ring runs what: pure arithmetic, identical on every rank.

No rank ever sends metadata: the (step, microbatch) a decode stage runs at a tick, the encoder's
ticks and every message's shape follow from the :class:`Timetable` alone.

Note (protocol): decode stage k (0 = first decode stage) runs microbatch i of step t at tick
``t*M + i + k`` with ``M = max(m, number of decode stages)``; ranks run their ops in tick order,
ties by microbatch, then stage (:meth:`Timetable.ops_at`), and, at each tick, first post the
receives for the messages sent at that tick in the order their senders run the ops that send them
(so the pairing also holds on backends without tags). Ties arise only where a rank holds several
decode stages. Microbatch first keeps a microbatch's pass depth-first through a rank's stages: on a
V layout (rank 0 holding stages 0 and 3, rank 1 stages 1 and 2), rank 1 at the tick of stage 1's
microbatch 1 and stage 2's microbatch 0 runs stage 2 first, so microbatch 0 goes on to rank 0
while rank 1 works on microbatch 1; stage order would hold microbatch 0 behind microbatch 1 there,
and with one microbatch per rank (no slack) each step would take 1.5x the ranks' work.
A decoder-only prompt may be fed in chunks (``prefill_chunk_size`` of the generation config, as
transformers' chunked prefill): its C chunks are steps 0..C-1, the last of which chooses the first
new token, so the ring fills with C x m units of work instead of m (a pipeline's prefill idles
(p - 1) / (units + p - 1) of its time). Message shapes follow from the
microbatch size, the step (a prompt chunk's length at a prefill step, else 1) and the hidden size:
  stage -> next stage   float ``(rows, q, hidden + 1)``: hidden states, last column 1 for rows still
                        generating; all zeros once the microbatch is done (sent once, then nothing)
  last -> first stage   int64 ``(rows, 2)``: next token, still-generating flag (beam search: ``(rows, 3)``,
                        and the row whose beam each row continues)
  stage -> next stage   beam search only: int64 ``(rows,)`` those source rows, right after the hidden
                        states, so each stage reorders its cache before its forward
Sends never block (``isend``) and every receive waits only for a message sent at an earlier tick,
so the ring cannot deadlock.

Example:
    >>> tt = Timetable(first_decode=0, n_decode=2, bounds=((0, 3), (3, 5)), prompt_len=7, max_new=4)
    >>> tt.decode_at(1, 1)          # stage 1 runs (step 0, microbatch 0) at tick 1
    (0, 0)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

__all__ = ["Timetable", "ops_at_tick"]


def ops_at_tick(stages: Iterable[tuple[Any, int]], tick: int, *, period: int, count: int) -> list[tuple[Any, int, int]]:
    """``(stage, step, microbatch)`` of the ops run at ``tick`` by ``stages``, given as ``(stage, offset)`` with
    ``offset`` the ticks the stage starts after the first: a stage runs microbatch ``i`` (of ``count``) of step
    ``t`` at tick ``t * period + i + offset``. In the order a rank runs them: microbatch first, then offset (the
    Note). The static ring (:meth:`Timetable.ops_at`) and the continuous one (``ContinuousRing``) both keep it."""
    ops = []
    for stage, offset in stages:
        since = tick - offset
        if since >= 0 and since % period < count:
            ops.append((stage, since // period, since % period, offset))
    return [op[:3] for op in sorted(ops, key=lambda op: (op[2], op[3]))]


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
            raise InputError(f"prefill_chunk must be >= 1 positions, got {self.prefill_chunk}")

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
    def n_microbatches(self) -> int:
        return len(self.bounds)

    @property
    def period(self) -> int:
        """Ticks per decoding step, ``M = max(m, decode stages)``: with fewer microbatches than
        stages the ring waits for a token to come round before the next step."""
        return max(self.n_microbatches, self.n_decode)

    @property
    def tick_limit(self) -> int:
        """A tick by which every microbatch has finished (past it, the protocol is broken)."""
        return (self.first_token_step + self.max_new + 2) * self.period + self.n_decode

    def decode_at(self, stage: int, tick: int) -> tuple[int, int] | None:
        """(step, microbatch) that decode stage ``stage`` runs at ``tick``, or None."""
        ops = self.ops_at((stage,), tick)
        return ops[0][1:] if ops else None

    def ops_at(self, stages: Iterable[int], tick: int) -> list[tuple[int, int, int]]:
        """``(stage, step, microbatch)`` of the ops ``stages`` run at ``tick``, in the order a rank runs them:
        by microbatch, then stage (see the Note)."""
        # decode stage k starts k ticks after the first decode stage
        return ops_at_tick(((s, s - self.first_decode) for s in stages), tick, period=self.period,
                           count=self.n_microbatches)

    def encode_at(self, stage: int, tick: int) -> int | None:
        """Microbatch that encoder stage ``stage`` runs at encoder tick ``tick`` (tick = i + stage), or None."""
        microbatch = tick - stage
        return microbatch if 0 <= microbatch < self.n_microbatches else None

    def rows(self, microbatch: int) -> int:
        """Rows of microbatch ``microbatch`` (the first dimension of its messages)."""
        lo, hi = self.bounds[microbatch]
        return hi - lo

    def message_positions(self, step: int) -> int:
        """Positions a stage's message carries at ``step``: a prompt chunk's at a prefill step, then one token."""
        chunks = self.chunks
        if step < len(chunks):
            start, end = chunks[step]
            return end - start
        return 1
