"""Data for a pipelined Trainer: the same global batch on every rank, and the items it holds.

``model.train_step`` and a pipelined forward take the same global batch on every rank of the job:
the ranks of one pipeline need the same rows, and each data-parallel replica takes its own share
of them (rows ``[r * B, (r + 1) * B)`` for replica ``r`` of ``dp``) inside the step. So a pipelined
Trainer's loader is the loader of ONE process whose batch is ``dp`` replica batches: accelerate's
``prepare_data_loader`` with one process (its seeded sampler, device placement, skipping on resume)
instead of the Accelerator's, which would give every rank of the job different rows. The batch
order is then the one transformers' Trainer gives on one process with that batch size, and the
replicas see distinct rows of it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

__all__ = ["count_items", "single_process_loader", "uncached_datasets"]


@contextlib.contextmanager
def uncached_datasets() -> Iterator[None]:
    """datasets' caching off inside the block: a ``map`` writes its result to a temporary file of a random name.

    Every rank of a pipelined Trainer runs the code of one process (main process included): a ``map`` named by the
    dataset's fingerprint would have ranks holding the same stage (data-parallel replicas) write the same cache file
    at once, in the dataset's own folder.
    """
    import datasets

    was = datasets.is_caching_enabled()
    datasets.disable_caching()
    try:
        yield
    finally:
        if was:
            datasets.enable_caching()


def single_process_loader(accelerator, loader: DataLoader) -> DataLoader:
    """``loader`` prepared by accelerate as for one process: the same batches, in the same order, on every rank.

    Args:
        accelerator: the Trainer's ``Accelerator`` (device, seeded sampler, ``data_seed``, RNG types).
        loader: a plain ``DataLoader`` over the whole dataset with the global batch size.

    Returns:
        The prepared loader (batches on the accelerator's device).
    """
    config = accelerator.dataloader_config
    return prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=1,
        process_index=0,
        split_batches=False,
        put_on_device=accelerator.device_placement,
        rng_types=list(accelerator.rng_types or []),
        # Dispatching reads on rank 0 and sends each process its slice: here every rank reads it all.
        dispatch_batches=False,
        even_batches=True,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )


def count_items(loss, batches: list[dict[str, Any]], config, device: torch.device) -> torch.Tensor | None:
    """The real items (tokens not labelled -100, or rows) of the batches of one optimizer step.

    The count transformers' Trainer passes as ``num_items_in_batch``, taken with the head's own count
    (causal LM: labels shifted by one), from the whole global batches every rank holds; nothing is
    gathered.

    Args:
        loss: the head's :class:`~hf_pipeline.families.losses.LossFunction`.
        batches: the step's batches (dicts as the collator makes them).
        config: the model config.
        device: where the count goes.

    Returns:
        A scalar int64 tensor, or None when the batches carry no ``labels``.
    """
    if not batches or any(b.get("labels") is None for b in batches):
        return None
    total = 0
    for b in batches:
        n = loss.count(b["labels"], config)
        total += sum(n) if isinstance(n, tuple) else n
    return torch.tensor(total, device=device)
