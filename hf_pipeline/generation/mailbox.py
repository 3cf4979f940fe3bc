"""The point-to-point messages of one rank's decode ring.

Non-blocking sends kept alive until done, receives posted ahead and waited for when taken,
same-rank deliveries without copies. Keys say what a message carries: ``("h", stage, microbatch)``
hidden states for a stage, ``("tok", microbatch)`` tokens back to the first decode stage,
``("enc", stage, microbatch)`` / ``("encout", microbatch)`` the encoder's.

Example:
    >>> box = Mailbox(pp_rank=0, rank_of=lambda stage: stage, dims=model.dims, device=model.device)
    >>> box.post(("h", 1, 0), 0, (4, 1, 65), torch.float32)     # receive stage 0's message for stage 1
    >>> hidden = box.take(("h", 1, 0))
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import InternalError

__all__ = ["Mailbox"]


class Mailbox:
    """Point-to-point messages of one rank's ring, keyed by what they carry (``("h", stage, mb)``...).

    A message for a stage on this rank is kept as is (no copy, no send). Receives are posted before
    they are needed and waited for only when :meth:`take` asks for the key.

    Args:
        window: None, or the most sends kept in flight: past it :meth:`prune` waits for the oldest. Only for
            protocols in which no rank runs that many messages ahead of the peer that receives them (the
            continuous ring: a rank is at most one op per group ahead), so the oldest was received long ago
            and its wait returns at once.

    Note (gloo): a gloo send's work reports ``is_completed()`` only once it was waited for, even after the peer
    received it, so pruning by ``is_completed`` frees nothing there: a long-lived ring kept every send's buffer
    and rescanned them all at each prune. With ``window`` the sends are freed in order, whatever the backend.
    """

    def __init__(self, *, pp_rank: int, rank_of: Callable[[int], int], dims: Any, device: torch.device,
                 window: int | None = None):
        self.pp_rank, self.rank_of, self.dims, self.device = pp_rank, rank_of, dims, device
        self.inbox: dict[tuple, Any] = {}
        self.sends: deque[tuple[Any, torch.Tensor]] = deque()
        self.window = window

    def deliver(self, key: tuple, stage: int, tensor: torch.Tensor) -> None:
        rank = self.rank_of(stage)
        if rank == self.pp_rank:
            self.inbox[key] = tensor
            return
        self.send(tensor, rank)

    def send(self, tensor: torch.Tensor, rank: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.dims.global_rank(rank), group=self.dims.pp_group)
        self.sends.append((work, tensor))  # the buffer must live until the send completes

    def post(self, key: tuple, src_stage: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buf, src=self.dims.global_rank(self.rank_of(src_stage)), group=self.dims.pp_group)
        self.inbox[key] = (work, buf)

    def take(self, key: tuple) -> torch.Tensor:
        item = self.inbox.pop(key)
        if isinstance(item, tuple):
            work, buf = item
            work.wait()
            return buf
        return item

    def prune(self) -> None:
        if self.window is not None:
            while len(self.sends) > self.window:
                self.sends.popleft()[0].wait()  # received long ago (``window``): returns at once
        # Completed sends release their buffers now and then; checking every time would cost more.
        elif len(self.sends) > 32:
            self.sends = deque((w, t) for w, t in self.sends if not w.is_completed())

    def close(self) -> None:
        """Wait for every send; a message left unread means the ranks disagreed on the timetable."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        if self.inbox:
            raise InternalError(
                f"pipelined generation ended with unconsumed messages {sorted(self.inbox)} (protocol error)"
            )
