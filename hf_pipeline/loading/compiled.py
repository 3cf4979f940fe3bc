"""Compiled stages (the ``compile`` load option): each stage's blocks compiled with ``torch.compile``.

Regional compilation, as torchtitan compiles a model: every whole block (decoder layer, T5 block) of a
stage gets its forward compiled, and the code around the blocks (embeddings, the head,
the schedule's own bookkeeping) stays eager. Blocks of one class run the same code, so dynamo compiles
it once per distinct block and input shape and reuses it for the others (its cache is per code object,
guarded by shapes); a block cut in halves at a stage boundary stays eager, since the stage calls its
halves' modules, never the block. Forward, training and the generation steps of decoder-only models run
compiled. A generation step carries a KV cache, whose ``update`` indexes the cache's layer list by the block's
own ``layer_idx``: traced, dynamo would guard on that constant and on the layer's state and compile one graph
per block and state, past its recompile limit. So the caches a compiled stage generates with are
:class:`CompiledStepCache`, whose ``update`` dynamo leaves out of the graph (a graph break each side of it):
the compiled parts then depend on shapes alone, shared by every block, and with dynamic shapes (the default for
these calls) the growing cache length compiles once. An encoder-decoder's cache (self- and cross-attention
parts, read inside the block) keeps those steps eager.

``compile=True`` uses torch's defaults (inductor); a dict passes its entries to ``torch.compile``
(``backend``, ``mode``, ``dynamic``, ``fullgraph``, ``options``). Compiling changes speed, never what is
computed beyond the rounding of fused kernels.

Example:
    >>> compile_blocks(stages, check_compile(True, options))      # -> the number of blocks compiled on this rank
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from ..errors import InputError

__all__ = ["COMPILE_KEYS", "CompiledStepCache", "check_compile", "compile_blocks"]

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
    # FSDP2 gathers a block's parameters in its module hooks, around the compiled forward, which then sees plain
    # tensors (as torchtitan compiles per block under FSDP); tensor- and expert-parallel blocks hold DTensors, whose
    # tracing fails in this torch (aot_eager: RecursionError in proxy_tensor) for transformers' blocks.
    why = ("the stages are traced (a graph already, run by torch's interpreter)" if options.traced else
           "tensor parallelism shards the blocks (DTensor)" if options.tp_size > 1 else
           "expert parallelism splits the experts (DTensor)" if options.ep_size > 1 else None)
    if why:
        raise InputError(f"compile=True is not supported here: {why}; load without compile")
    return kwargs


class CompiledStepCache(DynamicCache):
    """transformers' ``DynamicCache``, with :meth:`update` run outside ``torch.compile`` (module docstring): what a
    compiled stage's generation steps use. Eager, it is a ``DynamicCache``."""

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _caches(args: tuple, kwargs: dict) -> list[Cache]:
    """The KV caches (transformers' ``Cache``) a block call carries: a generation step."""
    return [v for v in (*args, *kwargs.values()) if isinstance(v, Cache)]


def _compiled_forward(block: nn.Module, kwargs: dict[str, Any]):
    """``block``'s forward compiled: calls without a cache with ``kwargs``; calls with :class:`CompiledStepCache`
    caches with dynamic shapes unless ``kwargs`` says otherwise (the cache grows a token a step); calls with any
    other cache eager (module docstring)."""
    eager = block.forward
    compiled = torch.compile(eager, **kwargs)
    stepped = torch.compile(eager, **{"dynamic": True, **kwargs})

    def forward(*args, **kw):
        caches = _caches(args, kw)
        if not caches:
            return compiled(*args, **kw)
        return stepped(*args, **kw) if all(isinstance(c, CompiledStepCache) for c in caches) else eager(*args, **kw)

    return forward


def compile_blocks(stages: list[nn.Module], kwargs: dict[str, Any] | None) -> int:
    """Compile each whole block of ``stages`` in place with ``torch.compile(**kwargs)``; the number compiled (each
    stage's count in its ``compiled_blocks``)."""
    if kwargs is None:
        return 0
    count = 0
    for stage in stages:
        for (_, block), half in zip(stage.blocks, stage.block_halves):
            if half is None:
                block.forward = _compiled_forward(block, kwargs)
                stage.compiled_blocks += 1
                count += 1
    return count
