"""Where a rank's time in the continuous ring goes: its stages' decode and prefill forwards, and waiting.

A ring with one group of rows per pipeline rank has no slack: while one rank runs an op, the other waits for
it unless it has an op of its own to run, so an op made longer by a joining prompt's prefill shows here as the
other ranks' waiting. :class:`RingTimes` adds up, per rank and over the rings an Engine ran, the seconds its
stages spent in decode forwards (the kept rows' step) and in prefill forwards (the joining rows' prompts; a
packed op's one forward, its decoding rows' step with them, counts here: :mod:`.packed_op`), and
the seconds it was blocked receiving a message it needed (another stage's op, a reply, a replica's plan, the
stage lead's plan under tensor parallelism).

Example:
    >>> times = RingTimes(decode=6.0, prefill=2.0, wait=1.5, total=10.0)
    >>> times.fractions()
    {'decode': 0.6, 'prefill': 0.2, 'wait': 0.15, 'other': 0.05}
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["RingTimes"]


@dataclass
class RingTimes:
    """Seconds of one rank in continuous rings: ``decode`` and ``prefill`` (its stages' forwards), ``wait``
    (blocked on a receive), ``total`` (inside the rings); the rest of ``total`` is planning, messages sent and
    token choice."""

    decode: float = 0.0
    prefill: float = 0.0
    wait: float = 0.0
    total: float = 0.0

    def __iadd__(self, other: RingTimes) -> RingTimes:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def forwards_of(self, stages: list[Any]) -> None:
        """``decode`` and ``prefill``: the sums over ``stages`` of their own ``seconds`` (each timed by its stage)."""
        self.decode = sum(s.seconds["decode"] for s in stages)
        self.prefill = sum(s.seconds["prefill"] for s in stages)

    def fractions(self) -> dict[str, float]:
        """Each part's share of ``total`` (``other``: the rest); all 0 before any ring ran."""
        if self.total <= 0:
            return {"decode": 0.0, "prefill": 0.0, "wait": 0.0, "other": 0.0}
        rest = max(0.0, self.total - self.decode - self.prefill - self.wait)
        return {k: v / self.total for k, v in
                {"decode": self.decode, "prefill": self.prefill, "wait": self.wait, "other": rest}.items()}
