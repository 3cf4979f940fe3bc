"""Which queued requests run together in static rounds (``Engine(..., batching="static")``).

A static round is one pipelined ``generate`` call over a static batch: the requests it takes start
together and the round ends when its longest row ends. The default, continuous batching (rows
joining and leaving the decode ring between tokens, :mod:`hf_pipeline.continuous_batching`), needs no batches; static
rounds also serve the models the ring does not (encoder-decoders, data-parallel replicas).

A batch holds requests that can share one ``generate`` call:
  * the same sampling parameters (greedy, or the same temperature and top_p), the same stop strings,
    stop ids and ``response_format`` grammar (``generate`` takes them per call, not per row);
  * a seeded request alone: ``generate`` seeds row ``r`` from ``(seed, r)`` (``sampling.row_seed``),
    so a seeded request's tokens would otherwise depend on where it sits in the batch;
  * prompts left padded to the longest: the longest prompt plus the largest ``max_new_tokens`` must fit
    the model's context, so a request that would push the batch past it waits for the next round.
Greedy rows do not depend on their batch: the ring is exact under left padding (the tests compare every
request with transformers' ``generate`` of that request alone).

Example:
    >>> batcher = StaticBatcher(max_rows=8, context=512)
    >>> batch = batcher.take(queue)     # removes the handles it takes from the deque
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from .handles import CompletionRequest, Handle

__all__ = ["RoundPlan", "StaticBatcher", "batch_key"]


def batch_key(req: CompletionRequest, request_id: str) -> tuple[Any, ...]:
    """Requests with equal keys can share one generate call (the reasons are in the module docstring)."""
    sampling = ("greedy",) if req.greedy else ("sample", req.temperature, req.top_p)
    alone = request_id if req.seed is not None and not req.greedy else None
    return sampling + (tuple(req.stop), tuple(req.stop_token_ids), req.grammar, alone)


@dataclass(kw_only=True)
class StaticBatcher:
    """Takes the next batch from the queue: the oldest request and the queued requests that can share
    its generate call, in order, up to ``max_rows`` rows (a request with ``n`` choices is ``n`` rows).

    Attributes:
        max_rows: rows per generate call at most.
        context: the model's context (positions); None when it has no limit.
    """

    max_rows: int = 8
    context: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise InputError(f"max_rows (--max-batch) must be >= 1, got {self.max_rows}")

    def fits(self, handles: list[Handle], extra: Handle) -> bool:
        reqs = [h.request for h in handles] + [extra.request]
        rows = sum(r.n for r in reqs)
        longest = max(len(r.prompt_ids) for r in reqs) + max(r.max_new_tokens for r in reqs)
        return rows <= self.max_rows and (self.context is None or longest <= self.context)

    def take(self, queue: deque[Handle]) -> list[Handle]:
        """Remove and return the next batch from ``queue`` (cancelled handles are dropped on the way).

        Returns:
            The handles of one generate call, oldest first; empty when the queue holds none.
        """
        while queue and queue[0].done:
            queue.popleft()
        if not queue:
            return []
        head = queue.popleft()
        batch, key, kept = [head], batch_key(head.request, head.id), deque()
        while queue:
            h = queue.popleft()
            if h.done:
                continue
            if batch_key(h.request, h.id) == key and self.fits(batch, h):
                batch.append(h)
            else:
                kept.append(h)
        queue.extend(kept)
        return batch


@dataclass(kw_only=True)
class RoundPlan:
    """One round as every rank needs it: plain data, sent as JSON (never pickle).

    Attributes:
        round_id: counts rounds (names the streamed tokens' keys).
        rows: each row's prompt ids, a request with ``n`` choices giving ``n`` rows, in batch order.
        max_new_tokens: the largest of the batch (each request stops at its own).
        temperature / top_p: 0 for greedy; the batch's sampling parameters.
        stop / stop_token_ids: the batch's stop strings and extra stop ids.
        seed: the call's seed (the request's own, or drawn on rank 0 for unseeded sampling).
        stream: whether some request of the round streams (tokens then come back every step).
        grammar: None, or the llguidance grammar every row follows (``response_format``).
    """

    round_id: int
    rows: list[list[int]]
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    stop_token_ids: list[int]
    seed: int | None
    stream: bool = True
    grammar: str | None = None

    @classmethod
    def of(cls, round_id: int, handles: list[Handle], rng: random.Random) -> RoundPlan:
        first = handles[0].request
        seed = None if first.greedy else (first.seed if first.seed is not None else rng.randrange(2**31))
        return cls(
            round_id=round_id, rows=[list(h.request.prompt_ids) for h in handles for _ in range(h.request.n)],
            max_new_tokens=max(h.request.max_new_tokens for h in handles), temperature=first.temperature,
            top_p=first.top_p, stop=list(first.stop), stop_token_ids=list(first.stop_token_ids), seed=seed,
            stream=any(h.request.stream for h in handles), grammar=first.grammar,
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)
