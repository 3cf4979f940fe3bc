"""The continuous ring's feeder: rank 0's request queue as the rows that join free slots, the slot pool.

:class:`Feeder` is what the ring (:class:`~hf_pipeline.continuous_batching.continuous_ring.ContinuousRing`)
asks of stage 0's queue; :class:`RingFeeder` is the serving engine's: it lets queued requests'
choices into free slots (a request with ``n`` choices is ``n`` rows, each seeded from ``(seed,
choice index)``), never more rows in flight than its capacity (the pool,
:func:`~hf_pipeline.continuous_batching.kv_budget.pool_rows`), hands each token to its request's
handle (through the engine's per-choice writer) as it comes and ends a row at a stop id, a stop
string, its own ``max_new_tokens`` or when its request is cancelled.

Example (rank 0, inside the engine):
    >>> feeder = RingFeeder(engine, capacity=pool_rows(model, max_batch=8, kv_cache_bytes=2**30, context=512),
    ...                     writer=_ChoiceWriter)
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from .wire import NewRow

__all__ = ["Feeder", "RingFeeder"]


class Feeder(Protocol):
    """Stage 0's view of the request queue, as the ring calls it (:class:`RingFeeder` implements it)."""

    def deliver(self, slot: int, token: int, logprob: Any = None, prompt_logprobs: Any = None) -> bool:
        """The row in ``slot`` got ``token`` (with its log-probability and, on its first token, its prompt's,
        where it asked for them); returns True when the row is done (its slot frees)."""

    def admit(self, free: list[int]) -> list[NewRow]:
        """Rows to start in some of the ``free`` slots (of one group) now."""

    def idle(self) -> bool:
        """Whether nothing waits to be admitted."""


class RingFeeder:
    """Rank 0: the engine's queue as the ring's :class:`Feeder`.

    Args:
        engine: the serving engine: its ``next_request()`` (the next queued request and its seed), ``running``,
            ``queued``, ``tokenizer`` and ``eos`` ids; the requests are its handles,
            :class:`~hf_pipeline.serving.handles.Handle`.
        capacity: rows in flight at most (:func:`~.kv_budget.pool_rows`).
        writer: the engine's per-choice writer class (``writer(handle, index, tokenizer, stop_ids)``).
    """

    def __init__(self, engine: Any, capacity: int, writer: Any):
        self.engine, self.capacity, self.writer = engine, capacity, writer
        self.pending: deque[tuple[Any, int, int | None]] = deque()  # (handle, choice index, seed) not yet in
        self.live: dict[int, tuple[Any, int, Any]] = {}  # slot -> (handle, choice index, writer)
        self.peak_rows = 0  # the most rows in flight at once (the pool bounds it)

    def _pull(self) -> None:
        """Move the oldest live queued request's choices to ``pending`` (the engine's ``next_request``)."""
        taken = self.engine.next_request() if not self.pending else None
        if taken is not None:
            handle, seed = taken
            self.pending.extend((handle, k, seed) for k in range(handle.request.n))

    def admit(self, free: list[int]) -> list[NewRow]:
        rows: list[NewRow] = []
        free = list(free)
        while free and len(self.live) < self.capacity:
            if not self.pending:
                self._pull()
            if not self.pending:
                break
            handle, k, seed = self.pending.popleft()
            if handle.done:  # cancelled while it waited for a slot
                self._forget(handle)
                continue
            req, slot = handle.request, free.pop(0)
            stop_ids = self.engine.stop_ids(req)
            self.live[slot] = (handle, k, self.writer(handle, k, self.engine.tokenizer, stop_ids))
            # echo with max_tokens 0 still runs one step (its prompt's log-probabilities); the writer drops the token.
            rows.append(NewRow(slot=slot, prompt=list(req.prompt_ids), max_new_tokens=max(1, req.max_new_tokens),
                               temperature=req.temperature, top_p=req.top_p, seed=seed, index=k,
                               stop_ids=sorted(stop_ids), min_tokens=req.min_tokens, logprobs=req.logprobs,
                               prompt_logprobs=req.logprobs if req.echo else None,
                               presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                               repetition_penalty=req.repetition_penalty,
                               logit_bias=[[t, b] for t, b in req.logit_bias.items()], grammar=req.grammar))
        self.peak_rows = max(self.peak_rows, len(self.live))
        return rows

    def deliver(self, slot: int, token: int, logprob: Any = None, prompt_logprobs: Any = None) -> bool:
        handle, k, writer = self.live[slot]
        if prompt_logprobs is not None:
            writer.prompt(prompt_logprobs)
        if handle.choices[k].finish_reason is None:
            writer.add([token], None if logprob is None else [logprob])
        if handle.choices[k].finish_reason is None:
            return False
        del self.live[slot]
        self._forget(handle)
        return True

    def _forget(self, handle: Any) -> None:
        if handle.done and handle in self.engine.running:
            self.engine.running.remove(handle)

    def idle(self) -> bool:
        return not self.pending and self.engine.queued == 0

    def fail_all(self, message: str) -> None:
        """A failure inside the ring: every request in it or waiting for a slot ends with ``message``."""
        for handle, _, _ in list(self.live.values()) + list(self.pending):
            handle.fail(message)
        self.live.clear()
        self.pending.clear()
        self.engine.running = []
