"""How the serving engine's ranks talk: each round's plan from rank 0 to all, tokens back to rank 0.

  * :func:`broadcast_json`: rank 0's plan to every rank, as JSON bytes in an int tensor (data only,
    never pickle: a rank runs nothing it did not compute itself).
  * :class:`TokenChannel`: the decode ring chooses tokens on the last stage's rank, which is rank 0
    only in one process (or with a V schedule); the HTTP server lives on rank 0. While rank 0's main
    thread is inside the collective ``generate``, the last stage's rank writes each step's tokens into
    the job's TCP store (the rendezvous store every rank already has) and a thread on rank 0 reads them,
    in order. The store, not a second process group: it needs no collective of its own, so nothing
    can deadlock with the ring's sends and receives.

Example:
    >>> plan = broadcast_json(ctx, {"op": "round", ...} if ctx.rank == 0 else None)
"""

from __future__ import annotations

import datetime
import json
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..compat import default_store

__all__ = ["TokenChannel", "broadcast_json"]

_WAIT = datetime.timedelta(milliseconds=100)  # how often rank 0's reader looks whether the round is over


def _tensor_device(ctx) -> torch.device:
    # NCCL moves only device tensors; gloo (and one process) host tensors.
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def broadcast_json(ctx, value: Any) -> Any:
    """``value`` (JSON data, given on rank 0) on every rank. Collective over ``ctx.group``.

    Returns:
        The decoded value on every rank (rank 0's own value on rank 0).
    """
    if ctx.world_size == 1:
        return value
    device = _tensor_device(ctx)
    data = json.dumps(value).encode() if ctx.rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=ctx.group)
    payload = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if ctx.rank == 0:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(payload, src=0, group=ctx.group)
    return value if ctx.rank == 0 else json.loads(bytes(payload.cpu().tolist()).decode())


class TokenChannel:
    """A transformers streamer (``put`` / ``end``) for one round, given to ``generate`` on every rank:
    on the last stage's rank it forwards each step's ``(B,)`` tokens to ``deliver(step, tokens)`` on
    rank 0, directly when that is the same process, else through the TCP store.

    Args:
        ctx: the rank context.
        round_id: the round (keys in the store are per round).
        deliver: rank 0's callback, ``deliver(step, list_of_B_token_ids)``.
        writes: whether this rank forwards what it is given (False on all but one of the ranks sharing the
            last stage).
    """

    def __init__(self, ctx, round_id: int, deliver: Callable[[int, list[int]], None], *, writes: bool = True):
        self.ctx, self.round_id, self.deliver = ctx, round_id, deliver
        # The last stage's tensor- / expert-parallel ranks all hold the tokens: one of them writes each key (a
        # second write after rank 0 read and deleted it would be read as the next round's step, in this
        # engine or the next one made on the model).
        self.writes = writes or ctx.rank == 0
        self.step = 0
        self.remote = ctx.world_size > 1
        self._store = default_store() if self.remote else None
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()

    def _key(self, step: int) -> str:
        return f"hf_pipeline/serve/{self.round_id}/{step}"

    # -------------------------------------------------------------- the last stage's rank
    def put(self, value: torch.Tensor) -> None:
        if value.dim() != 1:
            return  # the prompt, put first
        tokens = [int(t) for t in value.tolist()]
        if not self.writes:
            return
        if self.ctx.rank == 0:
            self.deliver(self.step, tokens)
        else:
            self._store.set(self._key(self.step), json.dumps(tokens))
        self.step += 1

    def end(self) -> None:
        if self.ctx.rank != 0 and self.writes:
            self._store.set(self._key(self.step), "null")  # the round is over: rank 0's reader stops at once

    # -------------------------------------------------------------- rank 0
    def start_reader(self) -> None:
        """On rank 0 of several: read the steps the last stage's rank writes, until :meth:`close`."""
        if self.remote and self.ctx.rank == 0:
            self._reader = threading.Thread(target=self._read, name="hf-pipeline-tokens", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        step = 0
        while True:
            key = self._key(step)
            try:
                # Blocks in the store's client, without the GIL: polling from Python would take the GIL
                # from this process's main thread, which is running the ring meanwhile.
                self._store.wait([key], _WAIT)
            except dist.DistStoreError:  # not there yet: the wait timed out
                if self._stop.is_set() and not self._store.check([key]):
                    return  # closed once generate returned: every step was written before it did
                continue
            tokens = json.loads(self._store.get(key))
            self._store.delete_key(key)
            if tokens is None:
                return
            self.deliver(step, tokens)
            step += 1

    def close(self) -> None:
        """Stop the reader once it has read every step written (call it after ``generate`` returned; the
        end mark normally stopped it already, a failed round's missing mark costs one wait)."""
        self._stop.set()
        if self._reader is not None:
            self._reader.join()
