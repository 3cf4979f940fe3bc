"""What a stage's forward keeps alive for backward, with and without activation checkpointing.

The memory planner (:mod:`.planner`) runs each stage once on fake tensors and sums what autograd
saves (:func:`measure_saved_bytes`). With activation checkpointing a checkpointed block saves nothing
through autograd's hooks: torch's non-reentrant ``checkpoint`` holds the block's *inputs* instead (in
the closure that recomputes it) and, in backward, recomputes the block, whose saved tensors then
live until that block's backward is done. :class:`CheckpointProbe` is the checkpoint function the
planner installs on the fake stages (with the layer choice of
:func:`~hf_pipeline.recompute.layers.apply_checkpointing`, so it is the one the
model makes): it records each checkpointed block's inputs (kept per microbatch) and measures what
the block saves when it runs un-checkpointed (its recompute, one block at a time).

Example:
    >>> probe = CheckpointProbe(params)
    >>> apply_checkpointing([stage], skeleton, CheckpointingSettings(every_n_layers=1), cpu, function=probe)
    >>> kept, out = probe.measure(lambda: stage(**inputs))
    >>> probe.backward_extra_bytes     # above ``kept`` while a block is recomputed in backward
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from ..compat import storage_key

__all__ = ["CheckpointProbe", "measure_saved_bytes", "saved_storages"]


def saved_storages(fn: Callable[[], Any], params: Sequence[torch.Tensor] = ()) -> tuple[dict[int, int], Any]:
    """(storage -> bytes of every tensor autograd saves for backward while ``fn()`` runs, fn's result).

    Storages of ``params`` are left out (weights, not activations). Works on real and on fake tensors.
    """
    owned = {storage_key(p) for p in params}
    seen: dict[int, int] = {}
    # Held until fn returns: a branch whose graph is dropped mid-run (a router's group scores) frees its saved
    # storages, and a later storage at the same address would be taken for one already counted.
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in owned and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return seen, out


def measure_saved_bytes(fn: Callable[[], Any], params: Sequence[torch.Tensor] = ()) -> tuple[int, Any]:
    """(bytes of the tensors autograd saves for backward while ``fn()`` runs, fn's result).

    Tensors sharing storage count once; storages of ``params`` are not counted (they are weights,
    not activations). Works on real and on fake tensors.
    """
    seen, out = saved_storages(fn, params)
    return sum(seen.values()), out


class CheckpointProbe:
    """A checkpoint function that also measures what checkpointing keeps (see the module docstring).

    After :meth:`measure`: ``kept_bytes`` (what one microbatch keeps for backward) and ``backward_extra_bytes``
    (how far above that the microbatch's own backward goes: when block ``k`` is recomputed, what was kept before
    it plus its recomputed activations; the blocks after it have been freed by then).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.owned = {storage_key(p) for p in self.params}
        self.inputs: dict[int, int] = {}  # storage -> bytes of the checkpointed blocks' tensor inputs
        self.seen: dict[int, int] = {}  # storage -> bytes saved through autograd outside checkpointed blocks
        self.kept_bytes = 0
        self.backward_extra_bytes = 0
        self._backward_peak = 0
        self._held: list[torch.Tensor] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.owned and key not in self.seen:
            self.seen[key] = t.untyped_storage().nbytes()
            self._held.append(t)  # as saved_storages: no later storage reuses a counted one's address
        return t

    def _kept(self) -> int:
        return sum({**self.inputs, **self.seen}.values())

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        for t in args:
            if isinstance(t, torch.Tensor) and storage_key(t) not in self.owned:
                self.inputs.setdefault(storage_key(t), t.untyped_storage().nbytes())
        recompute, _ = measure_saved_bytes(lambda: function(*args), self.params)
        self._backward_peak = max(self._backward_peak, self._kept() + recompute)
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    def measure(self, fn: Callable[[], Any]) -> tuple[int, Any]:
        """(bytes kept for backward by ``fn()`` with its blocks checkpointed through this probe, fn's result)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            out = fn()
        self._held.clear()
        self.kept_bytes = self._kept()
        self.backward_extra_bytes = max(0, self._backward_peak - self.kept_bytes)
        return self.kept_bytes, out
