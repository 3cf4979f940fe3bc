"""How a batch's rows are cut into contiguous microbatches (and data-parallel replicas' shares).

``generate`` cuts the batch twice with it: first into one share per data-parallel replica, then each
share into the microbatches the decode ring keeps in flight. Pure, tested alone
(``tests/generation/test_sampling.py``).

Example:
    >>> microbatch_bounds(5, 2)
    [(0, 3), (3, 5)]
"""

from __future__ import annotations

from ..errors import InputError

__all__ = ["microbatch_bounds"]


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
