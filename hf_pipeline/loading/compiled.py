"""Compiled stages (the ``compile`` load option): each stage's blocks compiled with ``torch.compile``.

Regional compilation, as torchtitan compiles a model: every whole block (decoder layer, T5 block) of a
stage gets its forward compiled, and the code around the blocks (embeddings, the head,
the schedule's own bookkeeping) stays eager. Blocks of one class run the same code, so dynamo compiles
it once per distinct block and input shape and reuses it for the others (its cache is per code object,
guarded by shapes); a block cut in halves at a stage boundary stays eager, since the stage calls its
halves' modules, never the block. Forward and training run compiled; generation steps (a block call with
a KV cache) run eager.

``compile=True`` uses torch's defaults (inductor); a dict passes its entries to ``torch.compile``
(``backend``, ``mode``, ``dynamic``, ``fullgraph``, ``options``). Compiling changes speed, never what is
computed beyond the rounding of fused kernels.

Example:
    >>> compile_blocks(stages, check_compile(True, options))      # -> the number of blocks compiled on this rank
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.cache_utils import Cache

from ..errors import InputError

__all__ = ["COMPILE_KEYS", "check_compile", "compile_blocks"]

# The torch.compile arguments a ``compile`` dict may hold.
COMPILE_KEYS = ("backend", "mode", "dynamic", "fullgraph", "options")


def check_compile(setting: Any, options: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments ``setting`` asks for (None: no compilation).

    Raises:
        InputError: a value that is neither a bool nor a dict of :data:`COMPILE_KEYS`, or stages this version
            does not compile (traced stages; tensor, expert or FSDP parallelism), naming the option.
    """
    if setting is None or setting is False:
        return None
    if setting is not True and not isinstance(setting, dict):
        raise InputError(f"compile must be True, False or a dict of torch.compile arguments, got {setting!r}")
    kwargs = {} if setting is True else dict(setting)
    unknown = sorted(set(kwargs) - set(COMPILE_KEYS))
    if unknown:
        raise InputError(
            f"compile={setting!r}: {unknown} are not torch.compile arguments taken here; use {COMPILE_KEYS}"
        )
    why = ("the stages are traced (a graph already, run by torch's interpreter)" if options.traced else
           "tensor / expert parallelism shards the blocks (DTensor)" if options.tp_size > 1 else
           "FSDP wraps the blocks" if options.fsdp_size > 1 else None)
    if why:
        raise InputError(f"compile=True is not supported here: {why}; load without compile")
    return kwargs


def _holds_cache(args: tuple, kwargs: dict) -> bool:
    """Whether a block call carries a KV cache (transformers' ``Cache``): a generation step."""
    return any(isinstance(v, Cache) for v in (*args, *kwargs.values()))


def _compiled_forward(block: nn.Module, kwargs: dict[str, Any]):
    """``block``'s forward compiled, except for calls with a KV cache, which run eager: a decode step's cache
    grows by a token per step and every microbatch has its own, so dynamo would recompile at each step until
    its cache limit, then run eager anyway (compiling decode needs a static cache, not done here)."""
    import torch

    eager = block.forward
    compiled = torch.compile(eager, **kwargs)

    def forward(*args, **kw):
        return eager(*args, **kw) if _holds_cache(args, kw) else compiled(*args, **kw)

    return forward


def compile_blocks(stages: list[nn.Module], kwargs: dict[str, Any] | None) -> int:
    """Compile each whole block of ``stages`` in place with ``torch.compile(**kwargs)``; the number compiled."""
    if kwargs is None:
        return 0
    count = 0
    for stage in stages:
        for (_, block), half in zip(stage.blocks, stage.block_halves):
            if half is None:
                block.forward = _compiled_forward(block, kwargs)
                count += 1
    return count
