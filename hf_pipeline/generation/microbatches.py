"""How a batch's rows are cut into contiguous microbatches (and data-parallel replicas' shares).

``generate`` cuts the batch twice with it: first into one share per data-parallel replica, then each
share into the microbatches the decode ring keeps in flight. Pure, tested alone
(``tests/generation/test_sampling.py``).

Example:
    >>> microbatch_bounds(5, 2)
    [(0, 3), (3, 5)]
    >>> replica_share(5, 2, 1, 3, same_count=True)      # replica 1 of 2: rows 3..5, as many microbatches as replica 0
    ((3, 5), [(0, 1), (1, 2)])
"""

from __future__ import annotations

from ..errors import InputError

__all__ = ["microbatch_bounds", "replica_share"]


def microbatch_bounds(batch: int, n: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` row ranges of ``n`` microbatches (sizes differ by at most one).

    Args:
        batch: number of rows.
        n: number of microbatches, ``1 <= n <= batch``.
    Returns:
        ``n`` ranges covering ``range(batch)`` in order, larger ones first (as ``torch.tensor_split``).
    """
    if batch < 1:
        raise InputError(
            f"cannot split an empty batch (batch={batch}) into microbatches; pass at least one sequence"
        )
    if not 1 <= n <= batch:
        raise InputError(f"n_microbatches must be in [1, batch={batch}], got {n}")
    base, extra = divmod(batch, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def replica_share(
    units: int, replicas: int, replica: int, n_microbatches: int, *, same_count: bool = False,
) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """Replica ``replica``'s contiguous share of ``units`` rows, and its microbatches (share-local ranges).

    Args:
        units: rows of the whole batch, ``>= replicas``.
        replicas: data-parallel replicas.
        replica: this replica's index.
        n_microbatches: microbatches asked for (each replica keeps at most one per row).
        same_count: every replica cuts its share into the same number of microbatches (the fewest rows of
            any share caps it): replicas that run each MoE layer together (experts over data-parallel ranks)
            must run the same (step, microbatch) forwards, so their decode rings' timetables are the same.
    Returns:
        ``((lo, hi), bounds)``: the share's rows of the batch, and its microbatches' ``[start, stop)`` ranges.
    """
    lo, hi = microbatch_bounds(units, replicas)[replica]
    cap = units // replicas if same_count else hi - lo  # the smallest share (larger ones first)
    return (lo, hi), microbatch_bounds(hi - lo, min(n_microbatches, cap))
