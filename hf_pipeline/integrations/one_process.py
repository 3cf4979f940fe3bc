"""A pipelined Trainer's step as accelerate would run it on one process.

accelerate counts every rank of the job as a data-parallel process, and transformers' and TRL's trainers gather,
slice, normalise and seed by that count (TRL's GRPO gathers every process's rewards to normalise them per prompt
group, keeps its own process's slice of them, divides token counts by the process count, logs the gathered
completions). The ranks of a pipeline (and its replicas, which here see the whole global batch on every rank) are
one process holding the whole batch: inside :func:`one_process` accelerate's state says so (its gathers return
their input, the process index is 0), and the Trainer's code computes exactly what it computes on one process.
Only the step's own code runs inside: the pipeline's collectives are its own (``torch.distributed`` groups), and
the Trainer's loop outside it (checkpoints on the main process, logging) sees the real job.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..errors import UsageError

__all__ = ["one_process", "one_process_batches"]

_ONE = ("distributed_type", "num_processes", "process_index", "local_process_index")


def one_process_batches(args, replicas: int) -> None:
    """Size what TRL's GRPO and RLOO configs sized by accelerate's process count (``args.world_size``) for one process
    holding every replica's rows: a generation batch of ``per_device_train_batch_size x replicas x
    steps_per_generation`` completions (one process's own default: its accumulation steps' rows).

    Raises:
        UsageError: that batch does not hold whole groups of ``num_generations`` completions.
    """
    steps = getattr(args, "steps_per_generation", None)
    if not (steps and getattr(args, "generation_batch_size", None)):
        return
    args.generation_batch_size = args.per_device_train_batch_size * replicas * steps
    generations = getattr(args, "num_generations", None) or 1
    if args.generation_batch_size % generations:
        raise UsageError(
            f"the generation batch of per_device_train_batch_size={args.per_device_train_batch_size} x {replicas} "
            f"replicas x steps_per_generation={steps} = {args.generation_batch_size} completions does not divide into "
            f"groups of num_generations={generations}; pass a per_device_train_batch_size or steps_per_generation that "
            f"makes it a multiple"
        )


@contextlib.contextmanager
def one_process(accelerator) -> Iterator[None]:
    """accelerate's process state (``accelerator.state`` and ``PartialState``, each shared by all its objects) reads
    as one process inside the block, and as it was after it."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    one = dict(zip(_ONE, (DistributedType.NO, 1, 0, 0)))
    states = (PartialState(), accelerator.state)  # the Trainer's accelerator exists: both are set up
    saved = [{name: getattr(state, name) for name in one} for state in states]
    try:
        for state in states:
            for name, value in one.items():
                setattr(state, name, value)
        yield
    finally:
        for state, old in zip(states, saved):
            for name, value in old.items():
                setattr(state, name, value)
