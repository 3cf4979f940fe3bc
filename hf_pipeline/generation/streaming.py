"""A transformers streamer fed from the decode ring, one step at a time, in order.

Example (the last stage's rank):
    >>> steps = StepStreamer(TextStreamer(tok), batch=4, pad=0)
    >>> steps.start(prompt); steps.record(0, 0, 2, tokens); steps.flush(0); steps.end()
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepStreamer"]


class StepStreamer:
    """Feeds a transformers streamer (``put`` / ``end``) on the last stage's rank: the prompt first,
    then one ``(B,)`` tensor per step, once every microbatch has its token for that step (rows
    finished earlier carry the pad id, as transformers' own streaming does)."""

    def __init__(self, streamer: Any, batch: int, pad: int):
        self.streamer, self.batch, self.pad = streamer, batch, pad
        self.pending: dict[int, torch.Tensor] = {}  # step -> (B,) tokens so far

    def start(self, prompt: torch.Tensor) -> None:
        self.streamer.put(prompt.cpu())

    def record(self, t: int, lo: int, hi: int, tokens: torch.Tensor) -> None:
        step = self.pending.setdefault(t, torch.full((self.batch,), self.pad, dtype=torch.long))
        step[lo:hi] = tokens.cpu()

    def flush(self, t: int) -> None:
        if t in self.pending:
            self.streamer.put(self.pending.pop(t))

    def discard(self, t: int) -> None:
        """Drop step ``t``: no row generated at it (transformers puts nothing for it)."""
        self.pending.pop(t, None)

    def end(self) -> None:
        self.streamer.end()
