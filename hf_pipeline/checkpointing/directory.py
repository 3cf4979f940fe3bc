"""What a checkpoint directory holds, and when it is complete: the file names, and finding the last one.

A checkpoint is a directory with ``config.json`` and ``model.safetensors.index.json``, and every
shard the index lists. The index is written last by a save (see :mod:`.staging`), so a directory
whose index and shards are all there is a finished save; anything else (a killed save's staging
directory, a new directory without index yet) is not, and :func:`latest_checkpoint` skips it.
Training state, when saved, sits beside the weights under the names below (see
:mod:`.training_state`). The weight files' own names (``INDEX_NAME``, ``SINGLE_NAME``) are the
reader's, :mod:`hf_pipeline.loading.checkpoint_files`: a save writes what the loader reads.
"""

from __future__ import annotations

import os
import pathlib
import re

from ..checked_files import is_regular_file, read_json
from ..errors import CheckpointError, CheckpointNotFoundError
from ..loading.checkpoint_files import INDEX_NAME, SAVE_STAGING_PREFIX

__all__ = [
    "FORMAT_VERSION",
    "OLD_SCHEDULER_NAME",
    "OPTIMIZER_DIR",
    "RNG_DIR",
    "SAVE_ID_KEY",
    "SCHEDULER_NAME",
    "TRAINER_STATE_NAME",
    "WEIGHT_FILE_PATTERN",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "why_incomplete",
]

TRAINER_STATE_NAME = "trainer_state.json"
SCHEDULER_NAME = "scheduler.json"
OLD_SCHEDULER_NAME = "scheduler.pt"  # earlier versions: a pickle, read only with weights_only=True
OPTIMIZER_DIR = "optimizer"
RNG_DIR = "rng"
# Weight files a save may remove when its index does not list them: transformers' own rule for
# stale shards (a name starting with "model" and ending in -NNNNN-of-NNNNN), safetensors only.
WEIGHT_FILE_PATTERN = re.compile(r"model.*-\d{5}-of-\d{5}\.safetensors")
SAVE_ID_KEY = "hf_pipeline_save_id"  # in the index metadata and trainer_state.json: which save wrote them
FORMAT_VERSION = 1  # of the training state files (optimizer state, its index, trainer_state.json)
# Name parts of directories that interrupted saves of older versions left: never a checkpoint.
_TMP = ".tmp-"
_OLD = ".old-"


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory that a finished save left: config and index present, every file the index lists too.

    Files no index lists (a killed save's staging directory, stale shards) do not matter. Only regular files
    count (a FIFO in a shard's place is not read, and the directory is no complete checkpoint).
    """
    path = pathlib.Path(path)
    if not (path.is_dir() and _TMP not in path.name and _OLD not in path.name):
        return False
    try:
        return _regular(path / "config.json") and all(_regular(path / f) for f in _listed_shards(path))
    except CheckpointError:
        return False


def _regular(path: pathlib.Path) -> bool:
    return is_regular_file(path, "a file of the checkpoint")


def _listed_shards(path: pathlib.Path) -> set[str]:
    """The shard names the index of checkpoint ``path`` lists (read through :mod:`hf_pipeline.checked_files`).

    Raises:
        CheckpointNotFoundError: no index; CheckpointError: one that is no regular file, damaged or not ours.
    """
    index = read_json(path / INDEX_NAME, "the checkpoint index", expect=dict, keys=("weight_map",))
    files = index["weight_map"].values() if isinstance(index["weight_map"], dict) else None
    if files is None or not all(isinstance(f, str) for f in files):
        raise CheckpointError(f"{path / INDEX_NAME} has a weight_map that is no mapping of key -> file name")
    return set(files)


def latest_checkpoint(root: str | os.PathLike, prefix: str = "checkpoint-") -> pathlib.Path | None:
    """The complete ``<root>/<prefix><step>`` directory with the highest step, or None.

    Directories of interrupted saves (no index yet, or ``.tmp-`` names of older versions) are skipped;
    a checkpoint overwritten by a save that was killed is found with its old or its new contents.

    Args:
        root: the directory holding the checkpoints.
        prefix: what their names start with, before the step.

    Returns:
        The checkpoint directory, or None when ``root`` holds no complete one.
    """
    root = pathlib.Path(root)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = re.fullmatch(re.escape(prefix) + r"(\d+)", p.name)
        if m and is_complete_checkpoint(p):
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def why_incomplete(path: pathlib.Path) -> str:
    """Why :func:`is_complete_checkpoint` refuses ``path``, and what to pass instead."""
    if not path.is_dir():
        return "it does not exist or is not a directory; pass the directory save_pretrained wrote"
    if path.name.startswith(SAVE_STAGING_PREFIX):
        return (
            f"it is the staging directory of a save_pretrained into {path.parent} that did not finish (killed or "
            f"failed), and its files may be partial; pass {path.parent} itself, or latest_checkpoint(root) for the "
            "last complete one"
        )
    if _TMP in path.name or _OLD in path.name:
        marker = _TMP if _TMP in path.name else _OLD
        return (
            f"its name {path.name!r} contains {marker!r}, which marks a directory an interrupted save left behind, "
            "so it is never taken for a checkpoint whatever it holds; pass the checkpoint directory, or rename this "
            f"one without {marker!r} if it is a complete checkpoint of yours"
        )
    try:
        if not _regular(path / "config.json"):
            return "it has no config.json; pass the directory save_pretrained wrote"
        files = _listed_shards(path)
        missing = sorted(f for f in files if not _regular(path / f))
    except CheckpointNotFoundError:
        return f"it has no {INDEX_NAME}; pass a directory save_pretrained wrote (it always writes the index)"
    except CheckpointError as e:  # a file of it is damaged, not ours or no regular file: named by the error
        return f"{e}"
    return (
        f"{INDEX_NAME} lists {len(missing)} shard(s) that are not there (e.g. {missing[0]!r}); the save or copy is "
        "incomplete"
    )
