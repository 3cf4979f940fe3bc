"""Whether a stage module's forward is running one of the schedule's microbatches.

Torch's ``PipelineStage`` also calls the stage module outside the microbatches: when a schedule first
runs, each stage's forward runs once on tensors of the first microbatch's shapes (empty ones on later
stages) so torch learns the shapes it sends (its metadata inference), and its backward metadata pass
follows. Hooks that add up what the microbatches compute (the routers' counts of
``training/router_aux.py``) must skip those calls: :class:`MarkedStage`, the class every stage of
the runtime is built from, marks the forwards it runs through ``forward_one_chunk`` (torch's per
microbatch entry), and :func:`in_microbatch` says whether one is running.

A plain counter, not a thread-local: a rank runs one stage forward at a time.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage

__all__ = ["MarkedStage", "in_microbatch"]

_running = 0


def in_microbatch() -> bool:
    """True while a pipeline stage runs one of the schedule's microbatches forward."""
    return _running > 0


class MarkedStage(PipelineStage):
    """A ``PipelineStage`` whose microbatch forwards are marked (see the module docstring)."""

    def forward_one_chunk(self, *args: Any, **kwargs: Any):
        global _running
        _running += 1
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            _running -= 1
