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

Rotation (``save_total_limit``) removes only checkpoints the Trainer wrote. transformers removes
every ``checkpoint-*`` folder of ``output_dir`` beyond the limit, the user's own too (a
``checkpoint-notes/``, a ``checkpoint-1000/`` made by hand). Here the Trainer writes a mark last into
each checkpoint, ``hf_pipeline_checkpoint.json``, naming the folder and the save id of its weights'
index (:func:`mark_checkpoint`); a folder is removed only while its mark names it and its weights
(:func:`written_by_trainer`): not one made by hand, copied under another name, or saved into since.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil

import torch

from ..checked_files import is_regular_file, read_json
from ..checkpointing.directory import (
    RNG_DIR,
    SAVE_ID_KEY,
    TRAINER_STATE_NAME,
    is_complete_checkpoint,
    why_incomplete,
)
from ..checkpointing.durable import write_json
from ..checkpointing.state_files import read_rng_state, set_rng_state
from ..checkpointing.state_shards import sharded_state
from ..checkpointing.training_state import rng_file_name
from ..core import PipelineCore
from ..distributed.agreement import collective_errors
from ..errors import CheckpointNotFoundError, PipelineError
from ..loading.checkpoint_files import INDEX_NAME, CheckpointIndex
from ..loading.key_conversions import convert_tensors
from ..loading.key_plan import UNEXPECTED_HINT, key_plan, wanted_tensors
from ..loading.weights import load_tensors
from ..log import get_logger

logger = get_logger(__name__)

__all__ = [
    "MARK_NAME",
    "check_trainer_state",
    "keep_only_checkpoint",
    "mark_checkpoint",
    "reload_weights",
    "restore_rng",
    "rotate_checkpoints",
    "written_by_trainer",
]

MARK_NAME = "hf_pipeline_checkpoint.json"
_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")  # transformers' PREFIX_CHECKPOINT_DIR and the step


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
        # Experts stored one tensor each (a checkpoint as transformers writes it): merged as the loader merges them.
        tensors.update(convert_tensors(key_plan(model.skeleton, model.resolved, index).conversions, tensors,
                                       model.skeleton))
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


# --------------------------------------------------------------------------------------------
# Rotation: only the checkpoints the Trainer wrote
# --------------------------------------------------------------------------------------------
def _save_id(directory: pathlib.Path) -> str | None:
    """The save id in the weights' index (None without one: an adapter checkpoint)."""
    try:
        return read_json(directory / INDEX_NAME, "the weights' index")["metadata"][SAVE_ID_KEY]
    except (PipelineError, OSError, KeyError, TypeError):  # a FIFO, a damaged index: no save of ours
        return None


def mark_checkpoint(directory: str | os.PathLike) -> None:
    """Rank 0, once ``directory`` is complete: mark it as a checkpoint the Trainer wrote (rotation may remove it)."""
    directory = pathlib.Path(directory)
    mark = {"checkpoint": directory.name, "save": _save_id(directory), "written_by": "hf_pipeline.PipelineTrainer"}
    write_json(directory / MARK_NAME, mark)


def written_by_trainer(directory: str | os.PathLike) -> bool:
    """True for a ``checkpoint-<step>`` folder whose mark names it and the save that wrote its weights."""
    directory = pathlib.Path(directory)
    if directory.is_symlink() or not directory.is_dir() or not _CHECKPOINT_NAME.fullmatch(directory.name):
        return False
    try:
        mark = read_json(directory / MARK_NAME, "the Trainer's checkpoint mark")
    except (PipelineError, OSError):  # none, damaged or no regular file: not ours, never removed
        return False
    return isinstance(mark, dict) and mark.get("checkpoint") == directory.name and mark.get("save") == _save_id(
        directory
    )


def _trainer_checkpoints(run_dir: str | os.PathLike) -> list[pathlib.Path]:
    """The Trainer's checkpoints in ``run_dir``, oldest first: as transformers' ``sort_checkpoints(use_mtime=True)``
    orders them (by modification time, by step where the times are less than a second apart)."""
    ours = [p for p in pathlib.Path(run_dir).glob("checkpoint-*") if written_by_trainer(p)]
    by_time = sorted(ours, key=lambda p: (p.stat().st_mtime, str(p)))
    if len(by_time) > 1 and by_time[-1].stat().st_mtime - by_time[0].stat().st_mtime >= 1.0:
        return by_time
    return sorted(ours, key=lambda p: int(_CHECKPOINT_NAME.fullmatch(p.name).group(1)))


def _remove(checkpoint: pathlib.Path) -> None:
    logger.info("Deleting older checkpoint [%s] due to args.save_total_limit", checkpoint)
    shutil.rmtree(checkpoint, ignore_errors=True)


def rotate_checkpoints(run_dir: str | os.PathLike, save_total_limit: int | None, best_model_checkpoint: str | None):
    """transformers' ``rotate_checkpoints(use_mtime=True)`` over the checkpoints the Trainer wrote only.

    Keeps the newest ``save_total_limit`` of them, always the newest and the best; every other
    folder of ``run_dir`` is left alone.
    """
    if save_total_limit is None or save_total_limit <= 0:
        return
    ours = _trainer_checkpoints(run_dir)
    if len(ours) <= save_total_limit:
        return
    protected = {ours[-1].resolve()}  # the newest, for resuming; and the best (counted as transformers counts it)
    if best_model_checkpoint is not None:
        protected.add(pathlib.Path(best_model_checkpoint).resolve())
    remaining = len(ours)
    for checkpoint in ours:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if checkpoint.resolve() not in protected:
            _remove(checkpoint)
            remaining -= 1


def keep_only_checkpoint(run_dir: str | os.PathLike, best_model_checkpoint: str) -> None:
    """At the end of training with ``save_total_limit=1``: remove the Trainer's checkpoints but the best one
    (transformers removes every ``checkpoint-<number>`` folder but it)."""
    for checkpoint in _trainer_checkpoints(run_dir):
        if checkpoint.resolve() != pathlib.Path(best_model_checkpoint).resolve():
            _remove(checkpoint)
