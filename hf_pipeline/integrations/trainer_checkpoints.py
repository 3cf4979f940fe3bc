"""Trainer checkpoints of a pipelined model: written by every rank, read back as data only.

``checkpoint-N/`` holds what transformers' Trainer writes there, in the package's formats:

* the model as a normal transformers checkpoint (``config.json``, safetensors shards and their
  index), written collectively by ``model.save_pretrained`` (each rank writes its stages' tensors);
* the optimizer state per pipeline rank (``optimizer/``, keyed by checkpoint key, read back with
  ``weights_only=True``), the scheduler as ``scheduler.json`` and every rank's RNG states as
  ``rng/rank-XXXXX.safetensors`` (:mod:`hf_pipeline.checkpointing.training_state`);
* ``trainer_state.json``: transformers' own ``TrainerState`` (global step, log history, callbacks'
  state), so the Trainer's checkpoint rotation, ``resume_from_checkpoint=True`` and
  ``load_best_model_at_end`` find what they expect.

Resuming reads only these files: the weights into the existing stages (safetensors), the optimizer
and scheduler through ``load_training_state``, the RNG states from safetensors. Nothing is
unpickled beyond ``weights_only`` loading of the optimizer's tensors; every file is read through
:mod:`hf_pipeline.checked_files` inside an agreement, so a bad file on one rank is named on every rank.
"""

from __future__ import annotations

import os
import pathlib

import torch

from ..checked_files import is_regular_file, read_json
from ..checkpointing.directory import RNG_DIR, TRAINER_STATE_NAME, is_complete_checkpoint, why_incomplete
from ..checkpointing.state_files import read_rng_state, set_rng_state
from ..checkpointing.state_shards import sharded_state
from ..checkpointing.training_state import rng_file_name
from ..core import PipelineCore
from ..distributed.agreement import collective_errors
from ..errors import CheckpointNotFoundError
from ..loading.checkpoint_files import CheckpointIndex
from ..loading.key_plan import UNEXPECTED_HINT, wanted_tensors
from ..loading.weights import load_tensors
from ..log import get_logger

logger = get_logger(__name__)

__all__ = ["check_trainer_state", "reload_weights", "restore_rng"]


def reload_weights(model: PipelineCore, directory: str | os.PathLike) -> None:
    """Copy this rank's stage tensors from the checkpoint in ``directory`` into ``model``. Collective.

    Args:
        model: the :class:`~hf_pipeline.model.PipelinedModel` (any stage layout: tensors are found by key).
        directory: a complete checkpoint (as ``save_pretrained`` writes it).

    Raises:
        CheckpointNotFoundError: ``directory`` is no complete checkpoint (on every rank).
        CheckpointError: a tensor is missing or of another shape, or a file of it (``trainer_state.json``
            included) is truncated, not ours or no regular file (on every rank).
    """
    directory = pathlib.Path(directory)
    with collective_errors(model.ctx, "reading the checkpoint's weights"):
        if not is_complete_checkpoint(directory):
            raise CheckpointNotFoundError(f"{directory} is not a complete checkpoint: {why_incomplete(directory)}")
        check_trainer_state(directory)
        index = CheckpointIndex.from_directory(directory)
        wanted, aliases, expected, ignore = wanted_tensors(
            model.skeleton, model.resolved, list(model.stages), index, model.dtype
        )
        tensors, _ = load_tensors(
            index, wanted, aliases=aliases, device=model.device, expected_keys=expected, ignore_unexpected=ignore,
            unexpected_hint=UNEXPECTED_HINT,
        )
        with torch.no_grad():
            for stage in model.stages:
                for name, t in stage.state_dict(keep_vars=True).items():
                    if name in tensors:  # a sharded tensor keeps this rank's slice of the whole one read
                        t.copy_(sharded_state(t, tensors[name]))


def restore_rng(model: PipelineCore, directory: str | os.PathLike) -> bool:
    """Set this rank's RNG states from ``directory/rng/`` when as many ranks wrote it as run now. Collective.

    Returns:
        True when restored; False (with a warning: dropout then draws other masks than an
        uninterrupted run) when the checkpoint has no RNG states or another world size wrote them.

    Raises:
        CheckpointError: on every rank, naming the file, when one rank's file is truncated, not ours or no
            regular file (each rank reads its own file: without the agreement the others would train on).
    """
    folder = pathlib.Path(directory) / RNG_DIR
    with collective_errors(model.ctx, "restoring the RNG states"):
        written = sorted(folder.glob("rank-*.safetensors")) if folder.is_dir() else []
        path = folder / rng_file_name(model.ctx.rank)
        restore = len(written) == model.ctx.world_size and is_regular_file(path, "the RNG state")
        if restore:
            set_rng_state(read_rng_state(path))
    if not restore:
        logger.warning(
            "not restoring RNG state from %s: %d rank file(s) for a job of %d ranks; a resumed run then draws "
            "different dropout masks than an uninterrupted one", folder, len(written), model.ctx.world_size,
        )
    return restore


def check_trainer_state(directory: str | os.PathLike) -> None:
    """Read ``trainer_state.json`` of a Trainer checkpoint as transformers' Trainer will, naming it when bad.

    transformers reads it (``TrainerState.load_from_json``) right after the model is reloaded, with no
    agreement across ranks and a raw ``JSONDecodeError``; reading it first, inside the reload's
    agreement, names a truncated or foreign file on every rank. A missing one is left to the caller.

    Raises:
        CheckpointError: the file is no regular file, truncated, or no JSON object.
    """
    path = pathlib.Path(directory) / TRAINER_STATE_NAME
    if is_regular_file(path, "the Trainer's state"):
        read_json(path, "the Trainer's state", expect=dict)
