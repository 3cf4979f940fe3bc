"""The continuous ring's KV budget: how many rows the slot pool may hold in a rank's KV-cache memory.

A row may grow to the model's full context, so the pool is sized for full-context rows on the rank
whose stages hold the most decoder layers (its KV cache is the largest): :func:`row_kv_bytes` is one such
row's bytes, from the config alone (:func:`hf_pipeline.planning.kv_cache_sizes.kv_cache_bytes`), and
:func:`pool_rows` how many of them a budget holds, at most ``max_batch``. Rows beyond the pool wait
in the queue (:class:`~hf_pipeline.continuous_batching.feeder.RingFeeder` admits up to it).

Example (the serving engine's pool):
    >>> pool = pool_rows(model, max_batch=8, kv_cache_bytes=2**30, context=model.config.max_position_embeddings)
"""

from __future__ import annotations

from ..core import PipelineCore
from ..errors import UsageError
from ..planning.kv_cache_sizes import kv_cache_bytes

__all__ = ["pool_rows", "prefix_blocks", "row_kv_bytes"]


def row_kv_bytes(model: PipelineCore, context: int) -> int:
    """KV-cache bytes one row of ``context`` tokens takes on the rank whose stages hold the most decoder layers
    (a rank with several stages, interleaved or V, keeps a cache for each).

    Returns:
        context x layers of the rank's stages x KV heads x head dim x 2 (K and V) x dtype bytes (sliding
        layers capped at their window), the largest over the ranks.
    """
    decoder = model.resolved.stacks[-1].blocks
    per_rank: dict[int, int] = {}
    for s in model.plan.stages:
        nbytes = kv_cache_bytes(model.config, layers=[decoder.index(b) for b in s.attention_blocks if b in decoder],
                                dtype=model.dtype, batch=1, seq=context)
        per_rank[s.rank] = per_rank.get(s.rank, 0) + nbytes
    return max(per_rank.values())


def pool_rows(model: PipelineCore, *, max_batch: int, kv_cache_bytes: int | None, context: int | None) -> int:
    """Rows the ring may hold at once: ``max_batch``, fewer when ``kv_cache_bytes`` cannot hold them.

    Args:
        model: the pipelined model.
        max_batch: rows in flight at most.
        kv_cache_bytes: KV-cache memory per rank for the pool (None: no bound beyond ``max_batch``).
        context: the model's context (positions a row may reach); None: no memory bound can be computed.
    Returns:
        The pool's rows (>= 1).
    Raises:
        UsageError: the budget cannot hold one full-context row.
    """
    if kv_cache_bytes is None or context is None:
        return max_batch
    per_row = row_kv_bytes(model, context)
    rows = min(max_batch, kv_cache_bytes // max(per_row, 1))
    if rows < 1:
        raise UsageError(
            f"kv_cache_bytes={kv_cache_bytes} cannot hold one request of the full context ({context} tokens need "
            f"{per_row} bytes on the most loaded rank); raise the budget or serve a model with a shorter context"
        )
    return rows


def prefix_blocks(model: PipelineCore, *, block: int, pool: int, kv_cache_bytes: int | None,
                  context: int | None) -> int:
    """Blocks of ``block`` tokens the prefix cache (:mod:`.prefix_cache`) may keep beside the pool's rows.

    Args:
        model: the pipelined model.
        block: tokens per block.
        pool: the pool's rows (:func:`pool_rows`), each sized for a full-context row.
        kv_cache_bytes: KV-cache memory per rank (None: as many blocks as the pool's rows hold, ``pool`` full
            contexts, 64 blocks a row when the context is unknown).
        context: the model's context.
    Returns:
        What the budget leaves once the pool is counted, in blocks (0: no prefix is kept).
    """
    if kv_cache_bytes is None or context is None:
        return pool * (-(-context // block) if context else 64)
    spare = kv_cache_bytes - pool * row_kv_bytes(model, context)
    return max(0, spare // max(row_kv_bytes(model, block), 1))
