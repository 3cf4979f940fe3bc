"""Per-stage checkpoint loading: each rank reads only the safetensors shards, and only the tensors, it owns.

A stage's parameter names equal the checkpoint keys, so loading is: map each wanted name to a key
(trying aliases for tied weights, base-model prefixes and the key renames transformers applies,
see :func:`checkpoint_key_renames`), group the keys by shard, check every shard header we need
(size, keys, shapes, dtypes, offsets) *before* reading any data, then open each needed shard once
and read each tensor's bytes straight into its destination tensor. Shards holding none of the
stage's tensors are never opened and nothing is memory-mapped, so peak host memory is one stage's
bytes (plus a bounded buffer for casts), not the whole model nor a shard more.

Example:
    >>> index = CheckpointIndex.from_directory(resolve_checkpoint("org/model"))
    >>> wanted = {"model.layers.3.mlp.up_proj.weight": ((64, 32), torch.bfloat16)}
    >>> tensors, report = load_tensors(index, wanted, device="cuda:1")
    >>> report.files_opened        # ['model-00002-of-00003.safetensors']
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import struct
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, Sequence

import torch

from ..errors import CheckpointError, CheckpointNotFoundError
from ..log import progress_bar

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointNotFoundError",
    "LoadReport",
    "BIN_INDEX_NAME",
    "SAVE_STAGING_PATTERN",
    "SAVE_STAGING_PREFIX",
    "checkpoint_key_renames",
    "checkpoint_nbytes",
    "load_pytorch_file",
    "load_tensors",
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
_MAX_HEADER = 100_000_000  # safetensors refuses larger headers too; a bigger length field means corruption
_MAX_LISTED = 10  # names shown in a missing/unexpected-key message


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def resolve_checkpoint(
    path_or_id: str | os.PathLike, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None, subfolder: str = "",
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
        raise CheckpointNotFoundError(f"{str(path)!r} is a file; pass the checkpoint directory that holds it ({path.parent})")
    import huggingface_hub  # local import: only hub ids need it
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    repo_id = str(path_or_id)
    where = f"the local Hugging Face cache {cache_dir or constants.HF_HUB_CACHE}"
    try:
        # local_files_only: the cache is looked up on disk only; downloading is the caller's choice.
        snapshot = pathlib.Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except HFValidationError:
        raise CheckpointNotFoundError(
            f"{repo_id!r} is neither a local directory (no such path) nor a hub id ('org/name'); "
            "pass an existing checkpoint directory or the id of a model in the local Hugging Face cache"
        ) from None
    except Exception as e:  # LocalEntryNotFoundError, IncompleteSnapshotError, ...
        if download and not constants.HF_HUB_OFFLINE and os.environ.get("HF_HUB_OFFLINE", "").upper() not in ("1", "ON", "YES", "TRUE"):
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
        raise CheckpointNotFoundError(f"{str(directory)!r} has no subfolder {subfolder!r}; pass the folder that holds config.json")
    return inner


# safetensors dtype name -> (bits per element, torch dtype name or None where torch has no such type).
_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"), "U8": (8, "uint8"), "I8": (8, "int8"), "I16": (16, "int16"), "U16": (16, "uint16"),
    "F16": (16, "float16"), "BF16": (16, "bfloat16"), "I32": (32, "int32"), "U32": (32, "uint32"), "F32": (32, "float32"),
    "I64": (64, "int64"), "U64": (64, "uint64"), "F64": (64, "float64"), "C64": (64, "complex64"),
    "F8_E4M3": (8, "float8_e4m3fn"), "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"), "F8_E5M2": (8, "float8_e5m2"),
    "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"), "F8_E8M0": (8, "float8_e8m0fnu"),
    # Packed sub-byte formats: no torch dtype holds one element each.
    "F4": (4, None), "F6_E2M3": (6, None), "F6_E3M2": (6, None),
}


@dataclass(frozen=True)
class _ShardHeader:
    data_start: int  # file offset of the data; an entry's data_offsets are relative to it
    entries: dict[str, dict]  # key -> {"dtype", "shape", "data_offsets"}


def _shard_header(path: pathlib.Path) -> _ShardHeader:
    """The header of a safetensors shard, checked as strictly as safetensors checks it, and against the file size.

    safetensors layout: 8-byte little-endian header length N, N bytes of JSON, then the data;
    ``data_offsets`` are relative to the data start, the tensors tile the data without holes or
    overlaps, so a complete file is 8 + N + max(end) bytes. Reading this ourselves is cheap and lets
    us say "truncated" instead of a generic error; since the loader reads tensor bytes at these
    offsets itself, every entry's byte length is checked against its shape and dtype here.
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
        spans = []
        for key, entry in header.items():
            begin, stop = entry["data_offsets"]
            shape, dtype = entry["shape"], entry["dtype"]
            valid = isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape)
            if not (valid and isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop):
                raise ValueError(f"bad entry for {key!r}: {entry}")
            if dtype not in _DTYPES:
                raise ValueError(f"{key!r} has the unknown dtype {dtype!r} (known: {', '.join(_DTYPES)})")
            bits = _DTYPES[dtype][0] * math.prod(shape)
            if bits != 8 * (stop - begin):
                raise ValueError(
                    f"{key!r} ({dtype}, shape {shape}) needs {bits / 8:g} bytes but its data_offsets span {stop - begin}"
                )
            spans.append((begin, stop, key))
        end = 0
        for begin, stop, key in sorted(spans):
            if begin != end:
                raise ValueError(f"the data of {key!r} starts at {begin}, not where the previous tensor ends ({end})")
            end = stop
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
    return _ShardHeader(data_start=8 + n, entries=header)


def read_header(path: pathlib.Path) -> dict[str, dict]:
    """The tensor entries of a safetensors header (see :func:`_shard_header`)."""
    return _shard_header(path).entries


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
        leftovers = sorted(p.name for p in directory.iterdir() if SAVE_STAGING_PATTERN.fullmatch(p.name))
        if leftovers:
            warnings.warn(
                f"{directory} holds what an interrupted save_pretrained left ({', '.join(leftovers)}); ignoring it: the "
                f"checkpoint is what {INDEX_NAME} lists. The next save into the directory removes it (or delete it)",
                stacklevel=2,
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
            return cls(directory=directory, weight_map=dict.fromkeys(read_header(single), SINGLE_NAME))
        others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors", ".ckpt"))
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
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"cannot read the index {index_path} ({type(e).__name__}: {e}); re-download it") from None
            return cls(directory=directory, weight_map=dict(weight_map))
        single = directory / BIN_NAME
        if not single.is_file():
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
            raise CheckpointError(f"checkpoint {self.directory} has no key(s) {_listing(unknown)}")
        groups: dict[str, list[str]] = {}
        for key in keys:
            groups.setdefault(self.weight_map[key], []).append(key)
        return {shard: groups[shard] for shard in sorted(groups)}


def pytorch_files(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a PyTorch (``.bin``) checkpoint in transformers' layout."""
    directory = pathlib.Path(directory)
    return (directory / BIN_INDEX_NAME).is_file() or (directory / BIN_NAME).is_file()


def load_pytorch_file(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of one ``.bin`` file (``weights_only``: no code in the file runs), memory-mapped where torch can."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # the legacy (pre-zip) format cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, OSError, ...: name the file
        raise CheckpointError(f"cannot read the PyTorch checkpoint file {path} ({type(e).__name__}: {e})") from e


def checkpoint_nbytes(index: CheckpointIndex) -> int:
    """Total size on disk of the checkpoint's safetensors files (what loading the whole model reads)."""
    return sum((index.directory / shard).stat().st_size for shard in set(index.weight_map.values()))


# What transformers' "legacy" conversion mapping renames (older checkpoints), for a transformers
# whose from_pretrained has no rename mechanism to ask.
_LEGACY_RENAMES = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))


def checkpoint_key_renames(model, keys: Iterable[str]) -> dict[str, str]:
    """Checkpoint keys that transformers' ``from_pretrained`` loads under another name: key -> model name.

    transformers renames checkpoint keys before matching them to the model: the model class's and
    its sub-models' registered conversion mapping plus the "legacy" renames that every model gets
    (``LayerNorm.gamma``/``beta`` -> ``weight``/``bias``, ``weight_g``/``weight_v`` -> weight-norm
    parametrizations, GPT-NeoX's ``embed_out`` -> ``lm_head``, ...). The renames come from
    transformers itself (``get_model_conversion_mapping`` + ``rename_source_key``), so a checkpoint
    it accepts is accepted here. Only pure renames apply: conversions that merge or split tensors
    (fused MoE experts, fused qkv) change the data and are not done by the per-stage loader. The
    base-model prefix is left alone: the loader's prefix aliases handle it.

    Args:
        model: the (meta-device) transformers model the checkpoint is loaded into.
        keys: the checkpoint's keys.

    Returns:
        Only the keys a rename changes.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings applied only the legacy renames
        return {k: _legacy_rename(k) for k in keys if _legacy_rename(k) != k}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    out = {}
    for key in keys:
        renamed, _ = rename_source_key(key, renamings, [])
        if renamed != key:
            out[key] = renamed
    return out


def _legacy_rename(key: str) -> str:
    for old, new in _LEGACY_RENAMES:
        key = key.replace(old, new)
    return key


@dataclass(kw_only=True)
class LoadReport:
    """What :func:`load_tensors` actually read, for tests and logs."""

    files_opened: list[str] = field(default_factory=list)  # shard file names, in the order opened
    keys_read: list[str] = field(default_factory=list)  # checkpoint keys, each once
    bytes_read: int = 0  # stored bytes (before any dtype cast) of the tensors read
    initialized: list[str] = field(default_factory=list)  # names missing from the checkpoint, initialised as transformers does
    # Wall seconds by phase of the load ("headers", "read" here; the loader adds its own phases).
    seconds: dict[str, float] = field(default_factory=dict)


def resolve_keys(index: CheckpointIndex, wanted: Mapping, aliases: Mapping[str, Sequence[str]]) -> dict[str, str]:
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


_IGNORE_HINT = "if these keys are harmless, pass their patterns in ignore_unexpected"


def _check_unexpected(index: CheckpointIndex, expected: Collection[str], ignore: Collection[str], hint: str = _IGNORE_HINT) -> None:
    expected = set(expected)
    patterns = [re.compile(p) for p in ignore]
    # re.search, as transformers applies _keys_to_ignore_on_load_unexpected.
    extra = sorted(k for k in index.weight_map if k not in expected and not any(p.search(k) for p in patterns))
    if extra:
        raise CheckpointError(
            f"checkpoint {index.directory} holds {len(extra)} tensor(s) the model does not have: {_listing(extra)}. "
            f"The config probably does not match the checkpoint (fewer layers, another architecture or model class); {hint}"
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
    floating: Collection[str] = (),
    unexpected_hint: str = _IGNORE_HINT,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Read one stage's tensors, opening only the shards that hold them.

    Args:
        index: the checkpoint's :class:`CheckpointIndex`.
        wanted: stage name -> (expected shape, target dtype). Floating tensors are cast to a floating
            target; integer/bool tensors keep their stored dtype unless the target is also non-floating.
        aliases: stage name -> checkpoint keys tried in order when the name itself is not stored
            (tied weights: ``lm_head.weight`` -> ``transformer.wte.weight``; base-model prefixes;
            legacy names such as ``LayerNorm.gamma``).
        device: where the tensors go. Each tensor's bytes are read from the file into its final
            buffer (through a small bounce buffer when it is cast or goes to an accelerator).
        expected_keys: every key the whole model may hold (all stages and aliases). Checkpoint keys
            outside it raise, checked from the index alone. None skips the check.
        ignore_unexpected: regex patterns (``re.search``) of checkpoint keys never reported as unexpected.
        progress: show a tqdm bar over bytes (set it on one rank only); ``transformers.logging.disable_progress_bar()``
            and ``HF_HUB_DISABLE_PROGRESS_BARS`` hide it too.
        floating: names that must be stored as floating point (the model's float parameters): an
            integer or bool tensor for one of them raises, naming the key and the shard, instead of
            being kept in its stored dtype.
        unexpected_hint: what the unexpected-keys error advises (default: ``ignore_unexpected``).

    Returns:
        (stage name -> tensor, :class:`LoadReport`). Names served by one checkpoint key share one tensor.

    Raises:
        CheckpointError: naming the key or file, for missing, unexpected or mis-shaped tensors and
            missing, truncated or corrupted shards. Everything is checked before any tensor data is read.
    """
    aliases = aliases or {}
    source = resolve_keys(index, wanted, aliases)
    if expected_keys is not None:
        _check_unexpected(index, expected_keys, ignore_unexpected, unexpected_hint)
    groups = index.shards_for(source.values())
    by_key: dict[str, list[str]] = {}
    for name, key in source.items():
        by_key.setdefault(key, []).append(name)

    # Pass 1, headers only: shapes, sizes, dtypes and stale indexes fail here, before gigabytes are read.
    started = time.perf_counter()
    floating = set(floating)
    plans = {shard: _plan_shard(index, shard, keys, by_key, wanted, floating) for shard, keys in groups.items()}
    headers_done = time.perf_counter()

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    report = LoadReport()
    out: dict[str, torch.Tensor] = {}
    reader = _TensorReader(device)
    total = sum(t.nbytes for plan in plans.values() for t in plan)
    bar = progress_bar(total=total, unit="B", unit_scale=True, desc="Loading weights", enabled=progress)
    with bar:
        for shard, plan in plans.items():
            path = index.directory / shard
            report.files_opened.append(shard)
            bar.set_postfix_str(shard, refresh=False)
            key = None
            try:
                with _open_shard(path) as f:
                    for t in plan:
                        key = t.key
                        tensor = reader.read(f, t)
                        for name in by_key[key]:
                            out[name] = tensor
                        report.keys_read.append(key)
                        report.bytes_read += t.nbytes
                        bar.update(t.nbytes)
            except OSError as e:
                where = f"reading {key!r} from" if key is not None else "opening"
                raise CheckpointError(f"error {where} shard {shard!r} in {index.directory}: {type(e).__name__}: {e}") from e
            except _ShortRead as e:
                raise CheckpointError(
                    f"shard {shard!r} in {index.directory} ended while reading {key!r} ({e}): the file was truncated "
                    "after its header was checked (is it being overwritten?); re-download or re-save it"
                ) from None
    report.seconds = {"headers": headers_done - started, "read": time.perf_counter() - headers_done}
    return out, report


@dataclass(frozen=True)
class _TensorPlan:
    key: str
    offset: int  # absolute file offset of the tensor's first byte
    nbytes: int  # stored bytes
    shape: tuple[int, ...]
    stored: torch.dtype
    target: torch.dtype


def _plan_shard(
    index: CheckpointIndex, shard: str, keys: list[str], by_key: Mapping[str, list[str]], wanted: Mapping,
    floating: Collection[str] = (),
) -> list[_TensorPlan]:
    """Check one shard's header against what is wanted from it; what to read, in file order."""
    path = index.directory / shard
    if not path.is_file():
        raise CheckpointError(f"shard {shard!r} (holding {keys[0]!r}) is missing from {index.directory}; re-download the checkpoint")
    header = _shard_header(path)
    plans = []
    for key in keys:
        if key not in header.entries:
            raise CheckpointError(
                f"the index of {index.directory} puts {key!r} in shard {shard!r}, but that shard does not hold it; "
                "the index is stale: re-download or re-save the checkpoint"
            )
        entry = header.entries[key]
        stored_shape = tuple(entry["shape"])
        for name in by_key[key]:
            shape = tuple(wanted[name][0])
            if stored_shape != shape:
                via = "" if name == key else f" (read as {name!r})"
                raise CheckpointError(
                    f"{key!r}{via} in shard {shard!r} of {index.directory} has shape {list(stored_shape)} but the model expects "
                    f"{list(shape)}; the config (hidden_size, vocab_size, heads, ...) does not match the checkpoint"
                )
        torch_name = _DTYPES[entry["dtype"]][1]
        stored_dtype = getattr(torch, torch_name, None) if torch_name else None
        if not isinstance(stored_dtype, torch.dtype):
            raise CheckpointError(
                f"{key!r} in shard {shard!r} of {index.directory} is stored as {entry['dtype']}, which torch "
                f"{torch.__version__} has no dtype for; dequantize or re-save the checkpoint in a torch dtype"
            )
        target = wanted[by_key[key][0]][1]
        if not stored_dtype.is_floating_point and any(name in floating for name in by_key[key]):
            name = next(name for name in by_key[key] if name in floating)
            via = "" if name == key else f" (read as {name!r})"
            raise CheckpointError(
                f"{key!r}{via} in shard {shard!r} of {index.directory} is stored as {entry['dtype']} (integers) but the "
                f"model's parameter is floating point ({target}); the checkpoint is quantized or damaged: re-save it with "
                "floating-point weights (or dequantize it first)"
            )
        # As before: floating tensors take a floating target, integer/bool ones a non-floating one only.
        if stored_dtype.is_floating_point != target.is_floating_point:
            target = stored_dtype
        begin, stop = entry["data_offsets"]
        plans.append(_TensorPlan(key, header.data_start + begin, stop - begin, stored_shape, stored_dtype, target))
    # File order: one forward sweep through the shard.
    return sorted(plans, key=lambda t: t.offset)


def _open_shard(path: pathlib.Path):
    # Unbuffered: readinto() then goes straight from the page cache into the destination tensor.
    return open(path, "rb", buffering=0)


class _ShortRead(Exception):
    """The file ended before a tensor's bytes did (it changed after its header was checked)."""


def _readinto(f, offset: int, buffer: memoryview) -> None:
    f.seek(offset)
    done = 0
    while done < len(buffer):
        n = f.readinto(buffer[done:])
        if not n:
            raise _ShortRead(f"{done} of {len(buffer)} bytes at offset {offset}")
        done += n


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


class _TensorReader:
    """Reads safetensors entries from an open shard into newly allocated tensors on ``device``.

    Why not safetensors' own API: on CPU ``safe_open`` memory-maps the whole shard and
    ``get_tensor`` returns views of that mapping. Keeping a view keeps the file mapped (and a
    rewritten checkpoint then crashes with SIGBUS), so each tensor had to be cloned out, and every
    page read through the mapping stays resident, and counted in the process's RSS, until the
    shard is closed: peak memory was the stage *plus* up to a whole shard (or the largest tensor).
    ``safetensors.torch.load`` reads the whole file into memory instead. Reading each tensor's
    bytes at its header offset into its final buffer holds every byte once; the page cache is
    the kernel's, not the process's, and nothing stays mapped.

    A tensor that keeps its stored dtype on CPU is read in place. A cast or a device transfer goes
    through one reusable bounce buffer of ``_CHUNK`` bytes (pinned for CUDA), so the extra memory is
    bounded whatever the tensor size.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._bounce: torch.Tensor | None = None

    def _bounce_buffer(self) -> torch.Tensor:
        if self._bounce is None:
            pin = self.device.type == "cuda"
            self._bounce = torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=pin)
        return self._bounce

    def read(self, f, t: _TensorPlan) -> torch.Tensor:
        if self.device.type == "cpu" and t.target == t.stored:
            out = torch.empty(t.shape, dtype=t.stored)
            if t.nbytes:
                _readinto(f, t.offset, _as_bytes(out))
            return _from_little_endian(out)
        out = torch.empty(t.shape, dtype=t.target, device=self.device)
        flat = out.view(-1)
        size = t.stored.itemsize
        bounce = self._bounce_buffer()
        per = len(bounce) // size  # whole elements per chunk
        for first in range(0, flat.numel(), per):
            n = min(per, flat.numel() - first)
            chunk = bounce[: n * size]
            _readinto(f, t.offset + first * size, _as_bytes(chunk))
            flat[first : first + n].copy_(_from_little_endian(chunk.view(t.stored)))
        return out


_CHUNK = 16 << 20  # bytes per cast / transfer step: small next to any stage, large enough for full-speed reads


def _from_little_endian(tensor: torch.Tensor) -> torch.Tensor:
    # safetensors stores little-endian data; only a big-endian host has to swap it.
    if sys.byteorder == "little" or tensor.element_size() == 1:
        return tensor
    swapped = tensor.view(-1).view(torch.uint8).view(-1, tensor.element_size()).flip(-1)
    return tensor.copy_(swapped.contiguous().view(tensor.dtype).view(tensor.shape))
