"""The coordinator's prefill plan: which part of each joining row's prompt runs in an op.

Chunked prefill (as vLLM's and SGLang's): each op of a group runs at most ``chunk`` prompt tokens
beside the group's decoding rows, so a long prompt no longer stalls them for a whole-prompt forward.
A row whose prompt does not fit joins over consecutive ops of its group (``NewRow.start`` /
``end``); it holds its slot from the first chunk on but decodes, and gets its first token, only
once its whole prompt is in. Rows already part-way in go first, then queued rows while budget
remains (the feeder admits one at a time). A row that asked for its prompt's log-probabilities
(``echo``) runs its whole prompt in one op: they come from every prompt position's logits.

Prefix caching: before a queued row's first chunk, the replica's index (:mod:`.prefix_cache`) says how
many head tokens it reuses; those cost no budget. After planning an op the index sees the touches
and additions every stage will make, in the same order (:mod:`.prefix_cache` Note).

Example (the coordinator, for replica ``d``'s group of slots ``free`` and ``kept``):
    >>> new = planner.plan(d, slots_of_group, kept, feeder.admit)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace

from ..errors import InternalError
from .prefix_cache import PrefixCache
from .wire import NewRow

__all__ = ["PrefillPlanner"]


class PrefillPlanner:
    """Chunks and reused prefixes of the joining rows (see the module docstring).

    Args:
        chunk: prompt tokens an op runs at most (None or 0: whole prompts).
        indexes: each data-parallel replica's prefix index (None: no prefix reuse).

    Attributes:
        partial: slot -> the row's last planned chunk, for rows part-way in.
        chunks: row ops that ran part of a prompt split over several ops.
        prefix_hits / reused_tokens: rows that reused a cached prefix, and its tokens.
    """

    def __init__(self, *, chunk: int | None, indexes: list[PrefixCache] | None):
        self.chunk, self.indexes = chunk or sys.maxsize, indexes
        self.partial: dict[int, NewRow] = {}
        self.chunks = self.prefix_hits = self.reused_tokens = 0

    def plan(self, replica: int, slots: range, kept: list[int], admit: Callable[[list[int]], list[NewRow]]
             ) -> list[NewRow]:
        """The rows that run part of their prompt in this op of the group of ``slots`` (``kept`` decode): whole
        prompts first (they run batched), then chunks and reused prefixes."""
        budget = self.chunk
        rows: list[NewRow] = []
        for slot in [s for s in slots if s in self.partial]:
            if budget <= 0:
                break
            r = self.partial[slot]
            rows.append(replace(r, start=r.end, end=min(len(r.prompt), r.end + budget), reused=0))
            budget -= rows[-1].width
        index = self.indexes[replica] if self.indexes else None
        free = [s for s in slots if s not in kept and s not in self.partial]
        while free and budget > 0:
            got = admit(free[:1])
            if not got:
                break
            if len(got) != 1 or got[0].slot != free[0]:
                raise InternalError("the feeder admitted a row into a slot that is not free")
            r, free = got[0], free[1:]
            echo = r.prompt_logprobs is not None
            hit = index.match(r.prompt) if index is not None and not echo else 0
            end = len(r.prompt) if echo else min(len(r.prompt), hit + budget)
            rows.append(replace(r, start=hit, end=end, reused=hit))
            budget -= rows[-1].width
        rows.sort(key=lambda r: not r.whole)  # stable
        self._account(rows, index)
        return rows

    def _account(self, rows: list[NewRow], index: PrefixCache | None) -> None:
        """The op's rows as planned: partial rows remembered, the index updated as each stage will update its
        cache (touches in row order, then additions), counters."""
        for r in rows:
            if r.final:
                self.partial.pop(r.slot, None)
            else:
                self.partial[r.slot] = r
            self.chunks += not (r.start == r.reused and r.final)
            self.prefix_hits += bool(r.reused)
            self.reused_tokens += r.reused
        if index is not None:
            for r in rows:
                if r.reused:
                    index.touch(r.prompt, r.reused)
            for r in rows:
                if r.final:
                    index.add(r.prompt)
