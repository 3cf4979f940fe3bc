"""Per-stage checkpoint loading: each rank reads only the safetensors shards, and only the tensors, it owns.

A stage's parameter names equal the checkpoint keys, so loading is: map each wanted name to a key
(trying aliases for tied weights and base-model prefixes), group the keys by shard, check every
shard header we need (size, keys, shapes) *before* reading any data, then open each needed shard
once and read its tensors straight onto the stage device. Shards holding none of the stage's
tensors are never opened, so peak host memory is about one stage, not the whole model.

Example:
    >>> index = CheckpointIndex.from_directory(resolve_checkpoint("org/model"))
    >>> wanted = {"model.layers.3.mlp.up_proj.weight": ((64, 32), torch.bfloat16)}
    >>> tensors, report = load_tensors(index, wanted, device="cuda:1")
    >>> report.files_opened        # ['model-00002-of-00003.safetensors']
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, Sequence

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointNotFoundError",
    "LoadReport",
    "checkpoint_nbytes",
    "load_tensors",
    "resolve_checkpoint",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100_000_000  # safetensors refuses larger headers too; a bigger length field means corruption
_MAX_LISTED = 10  # names shown in a missing/unexpected-key message


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded as asked; the message names the file or key and how to fix it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Neither a local checkpoint directory nor a hub id in the local cache."""


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def resolve_checkpoint(path_or_id: str | os.PathLike, *, revision: str | None = None) -> pathlib.Path:
    """The local directory of a checkpoint, never touching the network.

    Args:
        path_or_id: a local directory in Hugging Face layout, or a hub id ("org/name") that is already
            in the local huggingface_hub cache (``HF_HUB_CACHE`` / ``HF_HOME``).
        revision: branch, tag or commit of a hub id (default "main"); ignored for a local directory.

    Returns:
        The directory holding ``config.json`` and the safetensors files.

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) when it is neither.
    """
    path = pathlib.Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointNotFoundError(f"{str(path)!r} is a file; pass the checkpoint directory that holds it ({path.parent})")
    import huggingface_hub  # local import: only hub ids need it
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    repo_id = str(path_or_id)
    try:
        # local_files_only: the cache is looked up on disk only; downloading is the user's choice, not ours.
        return pathlib.Path(huggingface_hub.snapshot_download(repo_id, revision=revision, local_files_only=True))
    except HFValidationError:
        raise CheckpointNotFoundError(
            f"{repo_id!r} is neither a local directory (no such path) nor a hub id ('org/name'); "
            "pass an existing checkpoint directory or the id of a model in the local Hugging Face cache"
        ) from None
    except Exception as e:  # LocalEntryNotFoundError, IncompleteSnapshotError, ...
        raise CheckpointNotFoundError(
            f"{repo_id!r} is not a local directory, and no snapshot of it (revision {revision or 'main'!r}) is in the local "
            f"Hugging Face cache {constants.HF_HUB_CACHE} ({type(e).__name__}: {e}). Pass a checkpoint directory, or "
            f"download it first (e.g. `hf download {repo_id}`, with HF_HUB_CACHE / HF_HOME set as here); nothing is downloaded here"
        ) from None


def _read_header(path: pathlib.Path) -> dict[str, dict]:
    """The tensor entries of a safetensors header, after checking the file size against it.

    safetensors layout: 8-byte little-endian header length N, N bytes of JSON, then the data;
    ``data_offsets`` are relative to the data start, so a complete file is 8 + N + max(end) bytes.
    Reading this ourselves is cheap and lets us say "truncated" instead of a generic error.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"shard {path.name} in {path.parent} is truncated ({size} bytes, not even a header); re-download or re-save it"
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"shard {path.name} in {path.parent} is truncated or its header is corrupted: the header length field "
                    f"says {n} bytes but the file has {size}; re-download or re-save it"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read shard {path.name} in {path.parent}: {e}") from e
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        header.pop("__metadata__", None)
        end = 0
        for key, entry in header.items():
            begin, stop = entry["data_offsets"]
            valid = isinstance(entry["dtype"], str) and all(isinstance(d, int) for d in entry["shape"]) and 0 <= begin <= stop
            if not valid:
                raise ValueError(f"bad entry for {key!r}: {entry}")
            end = max(end, stop)
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(
            f"shard {path.name} in {path.parent} has a corrupted header ({type(e).__name__}: {e}); re-download or re-save it"
        ) from None
    expected = 8 + n + end
    if size < expected:
        raise CheckpointError(
            f"shard {path.name} in {path.parent} is truncated (expected {expected} bytes, found {size}); "
            "the download or save was probably interrupted: re-download or re-save it"
        )
    if size > expected:
        raise CheckpointError(
            f"shard {path.name} in {path.parent} is corrupted: {size - expected} bytes after the last tensor "
            f"(expected {expected} bytes, found {size}); re-download or re-save it"
        )
    return header


_NO_SAFETENSORS = (
    "no safetensors checkpoint ({index} or {single}) in {dir}{found}. Only safetensors are loaded (read lazily, "
    "shard by shard); convert a PyTorch checkpoint once with transformers: "
    "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True)`"
)


@dataclass(frozen=True, kw_only=True)
class CheckpointIndex:
    """Which shard file holds each checkpoint key (from the index JSON or a single file's header)."""

    directory: pathlib.Path
    weight_map: dict[str, str]  # checkpoint key -> shard file name, relative to directory

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
                f"checkpoint directory {directory} does not exist; pass a directory, or a hub id through resolve_checkpoint()"
            )
        index_path = directory / INDEX_NAME
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                    raise TypeError("weight_map is not a mapping of key -> file name")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(
                    f"cannot read the index {index_path} ({type(e).__name__}: {e}); re-download it or re-save the checkpoint"
                ) from None
            if not weight_map:
                raise CheckpointError(f"the index {index_path} lists no tensors; re-download it or re-save the checkpoint")
            first_key: dict[str, str] = {}
            for key, shard in weight_map.items():
                first_key.setdefault(shard, key)
            for shard, key in first_key.items():
                if not (directory / shard).is_file():
                    raise CheckpointError(
                        f"the index {index_path} names shard {shard!r} (holding e.g. {key!r}) but {directory / shard} "
                        "does not exist; the download is incomplete: re-download the checkpoint"
                    )
            return cls(directory=directory, weight_map=dict(weight_map))
        single = directory / SINGLE_NAME
        if single.is_file():
            return cls(directory=directory, weight_map=dict.fromkeys(_read_header(single), SINGLE_NAME))
        others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors", ".ckpt"))
        found = f" (found: {', '.join(others[:_MAX_LISTED])})" if others else ""
        raise CheckpointError(_NO_SAFETENSORS.format(index=INDEX_NAME, single=SINGLE_NAME, dir=directory, found=found))

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
            raise CheckpointError(f"checkpoint {self.directory} has no key(s) {_listing(unknown)}")
        groups: dict[str, list[str]] = {}
        for key in keys:
            groups.setdefault(self.weight_map[key], []).append(key)
        return {shard: groups[shard] for shard in sorted(groups)}


def checkpoint_nbytes(index: CheckpointIndex) -> int:
    """Total size on disk of the checkpoint's safetensors files (what loading the whole model reads)."""
    return sum((index.directory / shard).stat().st_size for shard in set(index.weight_map.values()))


@dataclass(kw_only=True)
class LoadReport:
    """What :func:`load_tensors` actually read, for tests and logs."""

    files_opened: list[str] = field(default_factory=list)  # shard file names, in the order opened
    keys_read: list[str] = field(default_factory=list)  # checkpoint keys, each once
    bytes_read: int = 0  # stored bytes (before any dtype cast) of the tensors read


def _resolve_keys(index: CheckpointIndex, wanted: Mapping, aliases: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Stage name -> checkpoint key: the name itself, else the first alias the checkpoint holds."""
    have = index.weight_map
    source: dict[str, str] = {}
    missing: list[str] = []
    for name in wanted:
        key = next((k for k in (name, *aliases.get(name, ())) if k in have), None)
        if key is None:
            tried = list(aliases.get(name, ()))
            missing.append(name + (f" (also tried {', '.join(tried)})" if tried else ""))
        else:
            source[name] = key
    if missing:
        raise CheckpointError(
            f"checkpoint {index.directory} has no tensor for {len(missing)} of this stage's parameters/buffers: "
            f"{_listing(missing)}. Does the config match the checkpoint (number of layers, tie_word_embeddings, "
            "model class / base_model_prefix)?"
        )
    return source


def _check_unexpected(index: CheckpointIndex, expected: Collection[str], ignore: Collection[str]) -> None:
    expected = set(expected)
    patterns = [re.compile(p) for p in ignore]
    # re.search, as transformers applies _keys_to_ignore_on_load_unexpected.
    extra = sorted(k for k in index.weight_map if k not in expected and not any(p.search(k) for p in patterns))
    if extra:
        raise CheckpointError(
            f"checkpoint {index.directory} holds {len(extra)} tensor(s) the model does not have: {_listing(extra)}. "
            "The config probably does not match the checkpoint (fewer layers, another architecture or model class); "
            "if these keys are harmless, pass their patterns in ignore_unexpected"
        )


def load_tensors(
    index: CheckpointIndex,
    wanted: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    aliases: Mapping[str, Sequence[str]] | None = None,
    device: torch.device | str = "cpu",
    expected_keys: Collection[str] | None = None,
    ignore_unexpected: Collection[str] = (),
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Read one stage's tensors, opening only the shards that hold them.

    Args:
        index: the checkpoint's :class:`CheckpointIndex`.
        wanted: stage name -> (expected shape, target dtype). Floating tensors are cast to a floating
            target; integer/bool tensors keep their stored dtype unless the target is also non-floating.
        aliases: stage name -> checkpoint keys tried in order when the name itself is not stored
            (tied weights: ``lm_head.weight`` -> ``transformer.wte.weight``; base-model prefixes).
        device: where the tensors go; safetensors reads them straight there.
        expected_keys: every key the whole model may hold (all stages and aliases). Checkpoint keys
            outside it raise, checked from the index alone. None skips the check.
        ignore_unexpected: regex patterns (``re.search``) of checkpoint keys never reported as unexpected.
        progress: show a tqdm bar over bytes (set it on one rank only).

    Returns:
        (stage name -> tensor, :class:`LoadReport`). Names served by one checkpoint key share one tensor.

    Raises:
        CheckpointError: naming the key or file, for missing, unexpected or mis-shaped tensors and
            missing, truncated or corrupted shards. Everything is checked before any tensor data is read.
    """
    aliases = aliases or {}
    source = _resolve_keys(index, wanted, aliases)
    if expected_keys is not None:
        _check_unexpected(index, expected_keys, ignore_unexpected)
    groups = index.shards_for(source.values())
    by_key: dict[str, list[str]] = {}
    for name, key in source.items():
        by_key.setdefault(key, []).append(name)

    # Pass 1, headers only: shapes, sizes and stale indexes fail here, before gigabytes are read.
    plans = {shard: _plan_shard(index, shard, keys, by_key, wanted) for shard, keys in groups.items()}

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # safetensors' "cuda" would mean cuda:0
    report = LoadReport()
    out: dict[str, torch.Tensor] = {}
    total = sum(nbytes for plan in plans.values() for _, nbytes in plan)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights", disable=not progress)
    with bar:
        for shard, plan in plans.items():
            path = index.directory / shard
            report.files_opened.append(shard)
            bar.set_postfix_str(shard, refresh=False)
            key = None
            try:
                with safe_open(path, framework="pt", device=str(device)) as f:
                    for key, nbytes in plan:
                        tensor = _convert(f.get_tensor(key), wanted[by_key[key][0]][1], device)
                        for name in by_key[key]:
                            out[name] = tensor
                        report.keys_read.append(key)
                        report.bytes_read += nbytes
                        bar.update(nbytes)
            except torch.OutOfMemoryError:
                raise  # not the checkpoint's fault
            except Exception as e:  # SafetensorError, OSError, RuntimeError: wrap them all with the file name
                where = f"reading {key!r} from" if key is not None else "opening"
                raise CheckpointError(
                    f"error {where} shard {shard!r} in {index.directory}: {type(e).__name__}: {e}. "
                    "The file is probably corrupted; re-download or re-save it"
                ) from e
    return out, report


def _plan_shard(
    index: CheckpointIndex, shard: str, keys: list[str], by_key: Mapping[str, list[str]], wanted: Mapping
) -> list[tuple[str, int]]:
    """Check one shard's header against what is wanted from it; (key, stored bytes) in file order."""
    path = index.directory / shard
    if not path.is_file():
        raise CheckpointError(f"shard {shard!r} (holding {keys[0]!r}) is missing from {index.directory}; re-download the checkpoint")
    header = _read_header(path)
    for key in keys:
        if key not in header:
            raise CheckpointError(
                f"the index of {index.directory} puts {key!r} in shard {shard!r}, but that shard does not hold it; "
                "the index is stale: re-download or re-save the checkpoint"
            )
        stored = tuple(header[key]["shape"])
        for name in by_key[key]:
            shape = tuple(wanted[name][0])
            if stored != shape:
                via = "" if name == key else f" (read as {name!r})"
                raise CheckpointError(
                    f"{key!r}{via} in shard {shard!r} of {index.directory} has shape {list(stored)} but the model expects "
                    f"{list(shape)}; the config (hidden_size, vocab_size, heads, ...) does not match the checkpoint"
                )
    # File order: sequential reads of the mapped shard.
    keys = sorted(keys, key=lambda k: header[k]["data_offsets"][0])
    return [(k, header[k]["data_offsets"][1] - header[k]["data_offsets"][0]) for k in keys]


def _convert(raw: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = raw.to(dtype) if raw.is_floating_point() == dtype.is_floating_point else raw
    # On CPU safetensors returns views of one mmap of the whole shard: a tensor kept as a view would
    # keep the file mapped (and crash with SIGBUS if the checkpoint is overwritten), so copy it out.
    if device.type == "cpu" and tensor.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
        tensor = tensor.clone()
    return tensor
