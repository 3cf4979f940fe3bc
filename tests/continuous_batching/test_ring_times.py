"""RingTimes: a rank's seconds in the continuous ring, added over rings and split into shares (pure)."""

from __future__ import annotations

import pytest

from hf_pipeline.continuous_batching.ring_times import RingTimes


class _Stage:
    def __init__(self, decode: float, prefill: float):
        self.seconds = {"decode": decode, "prefill": prefill}


def test_times_add_over_rings_and_split_into_shares_of_the_total():
    times = RingTimes()
    assert times.fractions() == {"decode": 0.0, "prefill": 0.0, "wait": 0.0, "other": 0.0}  # no ring ran yet
    ring = RingTimes(wait=1.5, total=10.0)
    ring.forwards_of([_Stage(4.0, 1.0), _Stage(2.0, 1.0)])  # a rank's two stages (interleaved)
    assert (ring.decode, ring.prefill) == (6.0, 2.0)
    times += ring
    times += RingTimes(decode=2.0, prefill=0.0, wait=0.5, total=10.0)
    assert times == RingTimes(decode=8.0, prefill=2.0, wait=2.0, total=20.0)
    shares = times.fractions()
    assert shares == pytest.approx({"decode": 0.4, "prefill": 0.1, "wait": 0.1, "other": 0.4})
    assert sum(shares.values()) == pytest.approx(1.0)
