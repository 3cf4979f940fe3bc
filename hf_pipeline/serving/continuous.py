"""Continuous batching for the serving engine: the request queue as the decode ring's feeder, the slot pool.

The ring itself is :class:`~hf_pipeline.generation.continuous.ContinuousRing`; here rank 0's side
of it: :class:`RingFeeder` lets queued requests' choices into free slots (a request with ``n``
choices is ``n`` rows, each seeded from ``(seed, choice index)``), hands each token to its
:class:`~hf_pipeline.serving.handles.Handle` as it comes and ends a row at a stop id, a stop string,
its own ``max_new_tokens`` or when its request is cancelled. :func:`pool_rows` bounds the rows in
flight by the KV-cache memory a full-context row may need on the most loaded stage.

Example (rank 0, inside the engine):
    >>> feeder = RingFeeder(engine, capacity=pool_rows(model, max_batch=8, kv_cache_bytes=2**30))
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..errors import UsageError
from ..generation.continuous import NewRow
from ..planning.kv_cache_sizes import kv_cache_bytes
from .handles import Handle

__all__ = ["RingFeeder", "pool_rows", "row_kv_bytes"]


def row_kv_bytes(model: Any, context: int) -> int:
    """KV-cache bytes one row of ``context`` tokens takes on the stage with the most decoder layers.

    Returns:
        context x layers of the stage x KV heads x head dim x 2 (K and V) x dtype bytes (sliding
        layers capped at their window), the largest over the stages.
    """
    decoder = model.resolved.stacks[-1].blocks
    per_stage = [
        kv_cache_bytes(model.config, layers=[decoder.index(b) for b in s.attention_blocks if b in decoder],
                       dtype=model.dtype, batch=1, seq=context)
        for s in model.plan.stages
    ]
    return max(per_stage)


def pool_rows(model: Any, *, max_batch: int, kv_cache_bytes: int | None, context: int | None) -> int:
    """Rows the ring may hold at once: ``max_batch``, fewer when ``kv_cache_bytes`` cannot hold them.

    Args:
        model: the pipelined model.
        max_batch: rows in flight at most.
        kv_cache_bytes: KV-cache memory per rank for the pool (None: no bound beyond ``max_batch``).
        context: the model's context (positions a row may reach); None: no memory bound can be computed.
    Returns:
        The pool's rows (>= 1).
    Raises:
        UsageError: the budget cannot hold one full-context row.
    """
    if kv_cache_bytes is None or context is None:
        return max_batch
    per_row = row_kv_bytes(model, context)
    rows = min(max_batch, kv_cache_bytes // max(per_row, 1))
    if rows < 1:
        raise UsageError(
            f"kv_cache_bytes={kv_cache_bytes} cannot hold one request of the full context ({context} tokens need "
            f"{per_row} bytes on the most loaded stage); raise the budget or serve a model with a shorter context"
        )
    return rows


class RingFeeder:
    """Rank 0: the engine's queue as the ring's feeder (see :class:`~hf_pipeline.generation.continuous.Feeder`).

    Args:
        engine: the serving engine (its queue, lock, tokenizer, EOS ids and random seeds).
        capacity: rows in flight at most (:func:`pool_rows`).
        writer: the engine's per-choice writer class (``writer(handle, index, tokenizer, stop_ids)``).
    """

    def __init__(self, engine: Any, capacity: int, writer: Any):
        self.engine, self.capacity, self.writer = engine, capacity, writer
        self.pending: deque[tuple[Handle, int, int | None]] = deque()  # (handle, choice index, seed) not yet in
        self.live: dict[int, tuple[Handle, int, Any]] = {}  # slot -> (handle, choice index, writer)
        self.peak_rows = 0  # the most rows in flight at once (the pool bounds it)

    def _pull(self) -> None:
        """Move the oldest live queued request's choices to ``pending`` (under the engine's lock)."""
        engine = self.engine
        with engine._lock:
            while engine._queue and not self.pending:
                handle = engine._queue.popleft()
                if handle.done:
                    continue
                req = handle.request
                seed = None if req.greedy else (req.seed if req.seed is not None else engine._rng.randrange(2**31))
                self.pending.extend((handle, k, seed) for k in range(req.n))
                engine.running.append(handle)

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
            stop_ids = self.engine.eos | set(req.stop_token_ids)
            self.live[slot] = (handle, k, self.writer(handle, k, self.engine.tokenizer, stop_ids))
            rows.append(NewRow(slot=slot, prompt=list(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                               temperature=req.temperature, top_p=req.top_p, seed=seed, index=k))
        self.peak_rows = max(self.peak_rows, len(self.live))
        return rows

    def deliver(self, slot: int, token: int) -> bool:
        handle, k, writer = self.live[slot]
        if handle.choices[k].finish_reason is None:
            writer.add([token])
        if handle.choices[k].finish_reason is None:
            return False
        del self.live[slot]
        self._forget(handle)
        return True

    def _forget(self, handle: Handle) -> None:
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
