"""Crash-safe saving: files staged in a hidden directory, then moved into place with the index last.

A kill of any rank at any instant leaves the old or the new checkpoint complete, and found by
``from_pretrained(dir)`` and :func:`~.layout.latest_checkpoint`: every rank writes (and
fsyncs) its files into a hidden staging directory ``<dir>/.hf_pipeline.tmp-<save id>``; once every
rank has finished (agreed through a collective), rank 0 moves them into place with ``os.replace``
(:func:`publish`): first the shards, under names no file of the directory has
(``model-0000i-of-0000n.safetensors``, or ``model-<save id>-0000i-of-0000n.safetensors`` when those
exist already, see :func:`shard_file_names`), then the training state, tokenizer and config, and
the index last: replacing the index is the one instant the checkpoint switches from old to new.
Only then are the stale weight files removed. Kill points:

- before or between shards, before the agreement: only the staging directory is new; the old
  checkpoint is untouched (a new directory has no index, so it is never taken for a checkpoint).
- while rank 0 moves shards in: the new files have names the old index does not list, so the
  old checkpoint stays complete; the loader ignores files no index lists.
- before the index (config, tokenizer, training state already replaced): the old index still
  lists the old, untouched shards. The config is the new one: for a save of the same model (a
  resume, a fine-tune saved back) it describes the old weights as well. Training state replaced
  in place belongs to the new save: ``load_training_state`` sees its save id differ from the
  index's and refuses to pair it with the old weights (only when overwriting a directory that
  holds training state; fresh ``checkpoint-N`` directories have no such window).
- after the index: it lists only new shards, all present and fsynced: the new checkpoint is
  complete. Stale files (and the old ``model.safetensors``, which transformers would load in
  preference to an index until it is removed — a complete old checkpoint) are listed by no index.

A killed save leaves its staging directory behind; the loader ignores it and warns, and the next
save into the directory removes it. That is safe because rank 0 holds the directory's save lock
from before the staging directory is made until after the clean-up (:mod:`.lock`): while it
does, no other save is running there, so no staging directory but this save's can be live. A
save that fails (raises on any rank) removes what it wrote, and the directory too if it created
it (:func:`remove_failed_save`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..loading.checkpoint_files import INDEX_NAME, SAVE_STAGING_PATTERN, SINGLE_NAME
from .directory import (
    OPTIMIZER_DIR,
    RNG_DIR,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    WEIGHT_FILE_PATTERN,
)
from .durable import fsync
from .lock import check_inside

__all__ = ["SaveProgress", "publish", "remove_failed_save", "shard_file_names"]


@dataclass(kw_only=True)
class SaveProgress:
    """How far rank 0 got in moving a save into place: what :func:`remove_failed_save` undoes."""

    committed: bool = False  # the new index is in place: the new checkpoint is complete
    moved: list[pathlib.Path] = field(default_factory=list)  # shards already moved in (fresh names)


def shard_file_names(shards_per_rank: Sequence[int], tag: str | None) -> list[list[str]]:
    """Per rank, the file names of its shards: ``model[-<tag>]-0000i-of-0000n.safetensors``, numbered across ranks.

    Args:
        shards_per_rank: how many shard files each global rank writes, by rank.
        tag: the save id, when the plain names are taken by files of the directory; else None.
    """
    total = sum(shards_per_rank)
    infix = f"-{tag}" if tag else ""
    out, first = [], 0
    for count in shards_per_rank:
        out.append([f"model{infix}-{first + i + 1:05d}-of-{total:05d}.safetensors" for i in range(count)])
        first += count
    return out


def _publish_order(rel: pathlib.Path) -> int:
    """Training state first (trainer_state.json, which names the save, last of it), then other files, config last."""
    if rel.parts[0] in (OPTIMIZER_DIR, RNG_DIR) or rel.name == SCHEDULER_NAME:
        return 0
    return {TRAINER_STATE_NAME: 1, "generation_config.json": 3, "config.json": 4}.get(str(rel), 2)


def publish(
    final: pathlib.Path,
    staging: pathlib.Path,
    shard_names: list[str],
    progress: SaveProgress,
    phase: Callable[[str], None],
) -> None:
    """Move the staged files into ``final``: shards, training state, tokenizer, config, then the index; then clean up.

    Until the index is replaced the old index lists only old files, which nothing here touches (new
    shard names are fresh); from that instant the new index lists only new files, all in place.

    Args:
        final: the checkpoint directory.
        staging: the staging directory inside it, holding every rank's files.
        shard_names: every shard file of the save (all ranks').
        progress: updated as files move, for :func:`remove_failed_save`.
        phase: called with ``"moved"``, ``"before_index"``, ``"after_index"`` and ``"cleaned"``
            (the save's test hook).
    """
    for name in shard_names:
        os.replace(staging / name, final / name)
        progress.moved.append(final / name)
        phase("moved")
    listed = set(shard_names)
    rest = sorted(
        (p.relative_to(staging) for p in staging.rglob("*") if p.is_file()),
        key=lambda r: (_publish_order(r), str(r)),
    )
    rest = [r for r in rest if str(r) != INDEX_NAME and str(r) not in listed]
    check_inside(final, sorted({str(r.parent) for r in rest if r.parent != pathlib.Path(".")}))
    dirs = {final}
    for rel in rest:
        target = final / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, target)
        dirs.add(target.parent)
    for d in dirs:
        fsync(d)
    phase("before_index")
    os.replace(staging / INDEX_NAME, final / INDEX_NAME)  # the switch from the old checkpoint to the new one
    fsync(final)
    progress.committed = True
    phase("after_index")
    _remove_stale(final, staging, listed)
    phase("cleaned")


def _remove_stale(final: pathlib.Path, staging: pathlib.Path, listed: set[str]) -> None:
    """After the switch: weight files the new index does not list, and staging directories."""
    for p in final.iterdir():
        if p.name in listed or not p.is_file():
            continue
        if p.name == SINGLE_NAME or WEIGHT_FILE_PATTERN.fullmatch(p.name):
            p.unlink()  # a stale weight file; an old model.safetensors would shadow the index for transformers
    shutil.rmtree(staging, ignore_errors=True)
    for p in final.iterdir():  # staging directories of earlier saves that were killed
        if SAVE_STAGING_PATTERN.fullmatch(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def remove_failed_save(
    final: pathlib.Path, staging: pathlib.Path, created: list[pathlib.Path], progress: SaveProgress
) -> None:
    """After a failed save: remove what it wrote (and the directories it made) unless the index was already replaced.

    Args:
        final: the checkpoint directory.
        staging: the save's staging directory.
        created: the directories the save made, deepest first.
        progress: how far :func:`publish` got.
    """
    shutil.rmtree(staging, ignore_errors=True)
    if progress.committed:
        return  # the new checkpoint is complete; only the clean-up after it failed
    for path in progress.moved:  # fresh names: nothing of the old checkpoint
        with contextlib.suppress(OSError):
            path.unlink()
    if created and created[0] == final:
        shutil.rmtree(final, ignore_errors=True)
    for d in created:
        with contextlib.suppress(OSError):
            d.rmdir()  # a parent made for this save, if it is still empty
