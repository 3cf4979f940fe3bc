"""Where a checkpoint is and which file holds each key: hub ids, subfolders and the shard index.

:func:`resolve_checkpoint` turns a directory or a cached hub id into a local directory (no network
unless asked); :class:`CheckpointIndex` maps every checkpoint key to its shard file without reading
any tensor data. The reading itself is :mod:`.weights`.

Example:
    >>> index = CheckpointIndex.from_directory(resolve_checkpoint("org/model"))
    >>> index.shards_for(["model.embed_tokens.weight"])
    {'model-00001-of-00003.safetensors': ['model.embed_tokens.weight']}
"""

from __future__ import annotations

import os
import pathlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ..checked_files import is_regular_file, load_torch_data, read_json
from ..errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError
from .safetensors_header import read_header

__all__ = [
    "BIN_INDEX_NAME",
    "BIN_NAME",
    "INDEX_NAME",
    "SAVE_STAGING_PATTERN",
    "SAVE_STAGING_PREFIX",
    "SINGLE_NAME",
    "CheckpointIndex",
    "FileStamp",
    "changed_while_read",
    "checkpoint_nbytes",
    "file_stamp",
    "load_pytorch_file",
    "name_listing",
    "pytorch_files",
    "resolve_checkpoint",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_NAME = "pytorch_model.bin"
# save_pretrained stages a save in <dir>/.hf_pipeline.tmp-<save id>; one that was killed leaves it behind.
SAVE_STAGING_PREFIX = ".hf_pipeline.tmp-"
SAVE_STAGING_PATTERN = re.compile(re.escape(SAVE_STAGING_PREFIX) + r"[0-9a-f]{12}")
_MAX_LISTED = 10  # names shown in a missing/unexpected-key message


def name_listing(names: Sequence[str]) -> str:
    """The first names, comma-separated, and how many more there are (for error messages)."""
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def resolve_checkpoint(
    path_or_id: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    subfolder: str = "",
    download: bool = False,
) -> pathlib.Path:
    """The local directory of a checkpoint: a directory as it is, a hub id from the local cache first.

    A cached hub id resolves from disk alone (huggingface_hub's ``local_files_only``: no request,
    no retries, whether or not the hub is reachable). Loaders then hand transformers this
    directory, never the id, so they do not touch the network either.

    Args:
        path_or_id: a local directory in Hugging Face layout, or a hub id ("org/name") that is already
            in the local huggingface_hub cache (``HF_HUB_CACHE`` / ``HF_HOME``).
        revision: branch, tag or commit of a hub id (default "main"); ignored for a local directory.
        cache_dir: the huggingface_hub cache to look a hub id up in, as transformers' ``cache_dir``.
        subfolder: the checkpoint's folder inside the directory or repository, as transformers' ``subfolder``.
        download: when the id is not cached, download it (``snapshot_download``) unless ``HF_HUB_OFFLINE``
            is set; default False: nothing is downloaded and the error says how to.

    Returns:
        The directory holding ``config.json`` and the safetensors files.

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) when it is neither.
    """
    path = pathlib.Path(path_or_id).expanduser()
    if path.is_dir():
        return _subfolder(path, subfolder)
    if path.exists():
        raise CheckpointNotFoundError(
            f"{str(path)!r} is a file; pass the checkpoint directory that holds it ({path.parent})"
        )
    import huggingface_hub  # local import: only hub ids need it
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    repo_id = str(path_or_id)
    where = f"the local Hugging Face cache {cache_dir or constants.HF_HUB_CACHE}"
    try:
        # local_files_only: the cache is looked up on disk only; downloading is the caller's choice.
        snapshot = pathlib.Path(
            huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
        )
    except HFValidationError:
        raise CheckpointNotFoundError(
            f"{repo_id!r} is neither a local directory (no such path) nor a hub id ('org/name'); "
            "pass an existing checkpoint directory or the id of a model in the local Hugging Face cache"
        ) from None
    except Exception as e:  # LocalEntryNotFoundError, IncompleteSnapshotError, ...
        if (
            download
            and not constants.HF_HUB_OFFLINE
            and os.environ.get("HF_HUB_OFFLINE", "").upper() not in ("1", "ON", "YES", "TRUE")
        ):
            snapshot = pathlib.Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir))
            return _subfolder(snapshot, subfolder)
        raise CheckpointNotFoundError(
            f"{repo_id!r} is not in {where} (revision {revision or 'main'!r}; {type(e).__name__}) and is not a local "
            f"directory. Pass a checkpoint directory, or download it first (e.g. `hf download {repo_id}`, with "
            "HF_HUB_CACHE / HF_HOME set as here); nothing is downloaded unless asked (download=True)"
        ) from None
    return _subfolder(snapshot, subfolder)


def _subfolder(directory: pathlib.Path, subfolder: str | None) -> pathlib.Path:
    if not subfolder:
        return directory
    inner = directory / subfolder
    if not inner.is_dir():
        raise CheckpointNotFoundError(
            f"{str(directory)!r} has no subfolder {subfolder!r}; pass the folder that holds config.json"
        )
    return inner


_NO_SAFETENSORS = (
    "no safetensors checkpoint ({index} or {single}) in {dir}{found}. Only safetensors are loaded (read lazily, "
    "shard by shard, each rank its own tensors)"
)
# A PyTorch (.bin) checkpoint: convert it once; the converter reads each .bin file whole, on one process.
_CONVERT_BIN = (
    "; convert this PyTorch checkpoint to safetensors once, then load OUT_DIR: `hf-pipeline convert {dir} OUT_DIR "
    "--merge` (or hf_pipeline.tools.convert.merge_shards; it reads each .bin file whole, on one process), or with "
    "transformers: `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(OUT_DIR, safe_serialization=True)`"
)


def _check_shards_stay_inside(index_path: pathlib.Path, shards: Iterable[str]) -> None:
    """Refuse an index whose shard names leave its directory (``../x``, ``/abs/x``), as transformers does.

    The index comes with the checkpoint, from anywhere: a name that climbs out would make every rank
    read files the checkpoint does not hold. The names are checked as written, not resolved, since a
    hub cache snapshot's shards are links into its ``blobs/`` folder.
    """
    for shard in dict.fromkeys(shards):
        path = pathlib.PurePath(shard)
        if path.anchor or ".." in path.parts or not path.parts:
            raise CheckpointError(
                f"the index {index_path} names shard {shard!r}, which points outside the checkpoint directory; "
                "a shard must be a file name inside it: fix or re-download the index"
            )


# What tells a file that changed apart from the one first seen: a save that replaces it (a new inode, as
# save_pretrained's rename does) or rewrites it in place (transformers truncates and writes: size, mtime).
FileStamp = tuple[int, int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)


def file_stamp(path: pathlib.Path, stat: os.stat_result | None = None) -> FileStamp | None:
    """``path``'s identity and last change (None when it does not exist); ``stat`` given: that one (an fstat)."""
    try:
        st = stat if stat is not None else path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def changed_while_read(
    directory: pathlib.Path, seen: dict[pathlib.Path, FileStamp | None]
) -> CheckpointChangedError | None:
    """The error to raise when a file in ``seen`` is no longer what was read (None: all unchanged).

    A load that races a save reads files of two checkpoints: a shard missing, a stale index, a file
    shorter than its header says, or worse, no error and a mix of two saves' tensors. Comparing each
    file's stamp from before its read with its stamp now tells that apart from a file damaged at rest.
    """
    for path, before in seen.items():
        now = file_stamp(path)
        if now == before:
            continue
        how = "was removed during the read" if now is None else "appeared during the read" if before is None else (
            "was replaced by another file during the read" if now[:2] != before[:2] else "was rewritten during the "
            "read (its size or modification time changed)"
        )
        return CheckpointChangedError(
            f"the checkpoint {directory} changed while it was read: {path.name} {how}, so what was "
            "read may mix two versions of the checkpoint (a save into it was probably running). Wait for the save "
            "to finish and load again; the files themselves are probably fine"
        )
    return None


@dataclass(frozen=True, kw_only=True)
class CheckpointIndex:
    """Which shard file holds each checkpoint key (from the index JSON or a single file's header)."""

    directory: pathlib.Path
    weight_map: dict[str, str]  # checkpoint key -> shard file name, relative to directory
    # The index file (or single shard) as it was before it was read: a later read compares against it.
    stamps: dict[pathlib.Path, FileStamp | None] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "directory", pathlib.Path(self.directory))

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> CheckpointIndex:
        """Read ``model.safetensors.index.json`` (sharded layout) or the header of ``model.safetensors``.

        Args:
            directory: a checkpoint directory, e.g. from :func:`resolve_checkpoint`.

        Returns:
            The index; no tensor data is read, and of a sharded checkpoint no shard is opened.
        """
        directory = pathlib.Path(directory)
        if not directory.is_dir():
            raise CheckpointNotFoundError(
                f"checkpoint directory {directory} does not exist; pass a directory, or a hub id through "
                "resolve_checkpoint()"
            )
        leftovers = sorted(p.name for p in directory.iterdir() if SAVE_STAGING_PATTERN.fullmatch(p.name))
        if leftovers:
            warnings.warn(
                f"{directory} holds what an interrupted save_pretrained left ({', '.join(leftovers)}); ignoring it: "
                f"the checkpoint is what {INDEX_NAME} lists. The next save into the directory removes it (or delete "
                "it)",
                stacklevel=2,
            )
        index_path = directory / INDEX_NAME
        if is_regular_file(index_path, "the checkpoint index"):
            stamps = {index_path: file_stamp(index_path)}
            weight_map = read_json(index_path, "the checkpoint index", expect=dict, keys=("weight_map",))["weight_map"]
            if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                raise CheckpointError(
                    f"cannot read the index {index_path}: its weight_map is not a mapping of key -> file name; "
                    "re-download it or re-save the checkpoint"
                )
            if not weight_map:
                raise CheckpointError(
                    f"the index {index_path} lists no tensors; re-download it or re-save the checkpoint"
                )
            _check_shards_stay_inside(index_path, weight_map.values())
            first_key: dict[str, str] = {}
            for key, shard in weight_map.items():
                first_key.setdefault(shard, key)
            for shard, key in first_key.items():
                if not is_regular_file(directory / shard, "shard"):
                    changed = changed_while_read(directory, stamps)  # a save replaced the index and its shards
                    if changed is not None:
                        raise changed
                    raise CheckpointError(
                        f"the index {index_path} names shard {shard!r} (holding e.g. {key!r}) but {directory / shard} "
                        "does not exist; the download is incomplete: re-download the checkpoint"
                    )
            return cls(directory=directory, weight_map=dict(weight_map), stamps=stamps)
        single = directory / SINGLE_NAME
        if is_regular_file(single, "the checkpoint's one shard"):
            stamps = {single: file_stamp(single)}
            return cls(directory=directory, weight_map=dict.fromkeys(read_header(single), SINGLE_NAME), stamps=stamps)
        others = sorted(
            p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors", ".ckpt")
        )
        found = f" (found: {', '.join(others[:_MAX_LISTED])})" if others else ""
        message = _NO_SAFETENSORS.format(index=INDEX_NAME, single=SINGLE_NAME, dir=directory, found=found)
        if pytorch_files(directory):
            message += _CONVERT_BIN.format(dir=directory)
        raise CheckpointError(message)

    @classmethod
    def from_pytorch_directory(cls, directory: str | os.PathLike) -> CheckpointIndex:
        """The index of a PyTorch checkpoint (``pytorch_model.bin.index.json`` or ``pytorch_model.bin``).

        Only the converter reads these (each file whole, ``torch.load(weights_only=True)``); the loader
        takes safetensors only. Returns an index whose shards are the ``.bin`` files.
        """
        directory = pathlib.Path(directory)
        index_path = directory / BIN_INDEX_NAME
        if is_regular_file(index_path, "the PyTorch checkpoint index"):
            what = "the PyTorch checkpoint index"
            weight_map = read_json(index_path, what, expect=dict, keys=("weight_map",))["weight_map"]
            if not isinstance(weight_map, dict):
                raise CheckpointError(
                    f"cannot read the index {index_path}: its weight_map is no mapping; re-download it"
                )
            _check_shards_stay_inside(index_path, weight_map.values())
            return cls(directory=directory, weight_map=dict(weight_map))
        single = directory / BIN_NAME
        if not is_regular_file(single, "the PyTorch checkpoint file"):
            raise CheckpointError(f"no PyTorch checkpoint ({BIN_INDEX_NAME} or {BIN_NAME}) in {directory}")
        return cls(directory=directory, weight_map=dict.fromkeys(load_pytorch_file(single), BIN_NAME))

    def keys(self) -> set[str]:
        """Every checkpoint key."""
        return set(self.weight_map)

    def shards_for(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """Group keys by the shard holding them.

        Args:
            keys: checkpoint keys (all must be in the index).

        Returns:
            shard file name -> its keys (in the order given), only for shards holding some of them,
            in shard-name order (``model-00001-of-00003`` first).
        """
        keys = list(dict.fromkeys(keys))
        unknown = [k for k in keys if k not in self.weight_map]
        if unknown:
            raise CheckpointError(f"checkpoint {self.directory} has no key(s) {name_listing(unknown)}")
        groups: dict[str, list[str]] = {}
        for key in keys:
            groups.setdefault(self.weight_map[key], []).append(key)
        return {shard: groups[shard] for shard in sorted(groups)}


def pytorch_files(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a PyTorch (``.bin``) checkpoint in transformers' layout."""
    directory = pathlib.Path(directory)
    return (directory / BIN_INDEX_NAME).is_file() or (directory / BIN_NAME).is_file()


def load_pytorch_file(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of one ``.bin`` file (``weights_only``: no code in the file runs), memory-mapped where torch can.

    Raises:
        CheckpointError: naming the file: not a regular file, truncated, not a torch file, or a pickle that
            would run code (:func:`~hf_pipeline.checked_files.load_torch_data`).
    """
    return load_torch_data(path, "a PyTorch checkpoint file", map_location="cpu", mmap=True)


def checkpoint_nbytes(index: CheckpointIndex) -> int:
    """Total size on disk of the checkpoint's safetensors files (what loading the whole model reads)."""
    return sum((index.directory / shard).stat().st_size for shard in set(index.weight_map.values()))
