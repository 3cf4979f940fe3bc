"""Re-shard a checkpoint: one safetensors file per pipeline stage, and back to standard shards.

A hub checkpoint is sharded by size, so a stage's tensors are usually spread over several shards
and a shard over several stages: every rank opens (and pages in the headers and index of) files
it mostly does not need. :func:`convert_to_stages` rewrites it for one stage plan so that each
stage's tensors sit in their own file, ``model-stage-00002-of-00004.safetensors``; a tensor that
several stages hold (a tied embedding / LM head on the first and last stage, T5's relative
attention bias replicated on stages that start mid-stack) goes into ``model-shared.safetensors``,
and tensors no stage reads (keys the model ignores on load) into ``model-unused.safetensors``.
Loading the converted checkpoint with that plan, each rank opens exactly its own stages' files
(plus the shared file when it holds a shared tensor); the tensors are the same bytes, so the model
is identical. The index stays a normal ``model.safetensors.index.json``: plain transformers loads
the converted checkpoint too. :func:`merge_shards` writes standard size-based shards again (from
either layout; it is also a plain re-shard to another ``max_shard_size``).

Which stage needs which key is computed exactly as the loader does (the same plan, stage modules
and key aliases, see ``model.py``), from the config alone. Tensors are copied one output file at a
time in their stored dtype; the output directory is written under a temporary name and renamed
into place, so it is complete or absent, and the source is never modified.

Example:
    >>> report = convert_to_stages("llama-7b", "llama-7b-4stages", num_stages=4)
    >>> report.stage_files[1]                # ('model-stage-00002-of-00004.safetensors',)
    >>> merge_shards("llama-7b-4stages", "llama-7b-again", max_shard_size="2GB")
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError, ConvertError, InputError
from ..families.recipe import list_recipes
from ..loading.checkpoint_files import (
    BIN_INDEX_NAME,
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointIndex,
    load_pytorch_file,
    pytorch_files,
    resolve_checkpoint,
)
from ..loading.loader import wanted_tensors
from ..loading.safetensors_header import read_header
from ..loading.stages import recipe_front_end
from ..loading.weights import resolve_keys
from ..log import get_logger
from ..planning.options import PipelineOptions, load_config, parse_size
from ..planning.plan import StagePlan

__all__ = [
    "ConvertError",
    "ConvertReport",
    "SHARED_FILE",
    "convert_to_stages",
    "merge_shards",
    "stage_file_name",
    "stage_keys",
]

logger = get_logger(__name__)

SHARED_FILE = "model-shared.safetensors"
UNUSED_FILE = "model-unused.safetensors"
_META_KEY = "hf_pipeline"  # our entry in the index's "metadata" (transformers reads only total_size there)


def stage_file_name(stage: int, num_stages: int) -> str:
    """File name of stage ``stage`` (0-based) of ``num_stages``: ``model-stage-00001-of-00004.safetensors``."""
    return f"model-stage-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


@dataclass(frozen=True, kw_only=True)
class ConvertReport:
    """What a conversion wrote.

    Attributes:
        source: the checkpoint read.
        output: the directory written.
        files: output weight file -> its keys, in write order.
        stage_files: stage index -> the files a rank running that stage opens (its own file, plus
            the shared file when the stage holds a shared tensor); empty for :func:`merge_shards`.
        bytes_written: total tensor bytes written.
    """

    source: pathlib.Path
    output: pathlib.Path
    files: dict[str, list[str]]
    stage_files: dict[int, tuple[str, ...]] = field(default_factory=dict)
    bytes_written: int = 0

    def files_for_rank(self, plan: StagePlan, pp_rank: int) -> list[str]:
        """The files pipeline rank ``pp_rank`` of ``plan`` opens, sorted (as the loader opens them)."""
        return sorted({f for s in plan.stages_for_rank(pp_rank) for f in self.stage_files.get(s.index, ())})


def stage_keys(
    path: str | os.PathLike,
    *,
    num_stages: int,
    virtual_stages: int | None = None,
    schedule: str | None = None,
    split: str | Sequence[str] = "auto",
    auto_class: str | type | None = None,
) -> tuple[StagePlan, dict[int, list[str]]]:
    """The stage plan for ``path`` and, per stage, the checkpoint keys its rank reads (no tensor data read).

    Args:
        path: checkpoint directory (or cached hub id).
        num_stages: total pipeline stages.
        virtual_stages: stages per rank (default: what ``schedule`` needs, 1 or 2).
        schedule: schedule name; it fixes the placement (looped or V) of virtual stages.
        split: as ``from_pretrained``'s ``split``.
        auto_class: class the model is loaded as (default: ``config.architectures[0]``).

    Returns:
        (plan, stage index -> checkpoint keys), the same keys ``from_pretrained(pipeline=True)``
        reads for that stage with the same arguments.
    """
    ckpt = resolve_checkpoint(path)
    config = load_config(ckpt)  # the one config loader
    if config.model_type not in list_recipes():
        raise ConvertError(
            f"no recipe for model_type {config.model_type!r} (recipes: {sorted(list_recipes())}); per-stage files need "
            "the stage plan of a recipe. Add a recipe (model_recipes/*.toml) or keep the checkpoint as it is"
        )
    try:
        options = PipelineOptions.resolve(
            config, auto_class=auto_class, schedule=schedule, virtual_stages=virtual_stages, num_stages=num_stages,
            split=split, split_method="recipe",
        )
    except InputError as e:
        raise ConvertError(str(e)) from None
    maker = recipe_front_end(config, options)
    plan = maker.plan
    index = CheckpointIndex.from_directory(ckpt)
    keys: dict[int, list[str]] = {}
    for spec in plan.stages:
        # The loader's own choice of keys (build.wanted_tensors), so the two cannot drift apart.
        stages = maker.make_stages([spec])
        wanted, aliases, _, _ = wanted_tensors(maker.skeleton, maker.resolved, stages, index, torch.float32)
        keys[spec.index] = list(dict.fromkeys(resolve_keys(index, wanted, aliases).values()))
    return plan, keys


def _check_output(source: pathlib.Path, output: pathlib.Path, overwrite: bool) -> None:
    src, out = source.resolve(), output.resolve()
    if out == src or src in out.parents or out in src.parents:
        raise ConvertError(f"the output {output} must be a new directory outside the source checkpoint {source}")
    if out.exists() and not overwrite:
        raise ConvertError(
            f"the output {output} already exists; remove it, pick another directory or pass overwrite=True "
            "(--overwrite)"
        )
    if not out.parent.is_dir():
        raise ConvertError(f"the parent directory of the output, {out.parent}, does not exist; create it first")


def _weight_file(name: str) -> bool:
    # PyTorch weight files are not carried over either: the output is the safetensors checkpoint.
    return name.endswith((".safetensors", ".bin")) or name in (INDEX_NAME, BIN_INDEX_NAME)


def _source_index(source: pathlib.Path) -> CheckpointIndex:
    """The source's safetensors index, or that of its PyTorch ``.bin`` files when it has no safetensors."""
    if not (source / INDEX_NAME).is_file() and not (source / SINGLE_NAME).is_file() and pytorch_files(source):
        return CheckpointIndex.from_pytorch_directory(source)
    return CheckpointIndex.from_directory(source)


def _is_pytorch(shard: str) -> bool:
    return shard.endswith(".bin")


class _Writer:
    """Copies tensors from the source shards into new files, one output file at a time."""

    def __init__(self, index: CheckpointIndex, directory: pathlib.Path):
        self.index = index
        self.directory = directory
        self.files: dict[str, list[str]] = {}
        self.bytes = 0
        self._pytorch: tuple[str, dict[str, torch.Tensor]] | None = None  # the .bin file read last, whole

    def _pytorch_file(self, shard: str) -> dict[str, torch.Tensor]:
        if self._pytorch is None or self._pytorch[0] != shard:
            self._pytorch = None
            self._pytorch = (shard, load_pytorch_file(self.index.directory / shard))
        return self._pytorch[1]

    def write(self, name: str, keys: Sequence[str]) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for shard, shard_keys in self.index.shards_for(keys).items():
            if _is_pytorch(shard):
                state = self._pytorch_file(shard)
                for key in shard_keys:
                    if key not in state:
                        raise CheckpointError(
                            f"{self.index.directory / shard} does not hold {key!r}, which its index names; "
                            "re-download it"
                        )
                    tensors[key] = state[key]
                continue
            try:
                with safe_open(self.index.directory / shard, framework="pt") as f:
                    for key in shard_keys:
                        tensors[key] = f.get_tensor(key)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - SafetensorError / OSError: name the file
                raise CheckpointError(
                    f"cannot read shard {shard!r} of {self.index.directory}: {type(e).__name__}: {e}"
                ) from e
        ordered = {}
        seen: set[int] = set()
        for k in keys:
            t = tensors[k].contiguous()
            # Tensors of a .bin file may share storage (tied weights); each safetensors entry owns its bytes.
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            ordered[k] = t.clone() if ptr in seen else t
            if ptr is not None:
                seen.add(ptr)
        save_file(ordered, self.directory / name, metadata={"format": "pt"})
        self.files[name] = list(keys)
        self.bytes += sum(t.numel() * t.element_size() for t in ordered.values())


def _readable_roots(source: pathlib.Path) -> list[pathlib.Path]:
    """Where the files copied from ``source`` may really be: inside it, and for a hub cache snapshot
    (``models--org--name/snapshots/<revision>``, whose files are links to ``../../blobs/``) its blobs."""
    root = source.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def _outside(path: pathlib.Path, roots: list[pathlib.Path]) -> bool:
    """A link (or special file) whose content lies outside the checkpoint: not copied."""
    if not path.is_symlink() and (path.is_file() or path.is_dir()):
        return False
    real = path.resolve()
    inside = any(real == r or r in real.parents for r in roots)
    return not (inside and (real.is_file() or real.is_dir()))


def _copy_other_files(source: pathlib.Path, tmp: pathlib.Path) -> None:
    """Copy the source's non-weight files (tokenizer, README, ...) into the output, only what lies inside it.

    A symbolic link pointing out of the checkpoint (``README.md -> /etc/passwd``) and anything that
    is no regular file or directory (a FIFO would block the copy) is skipped with a warning: the
    output holds the checkpoint's own files, never content from elsewhere on the machine.
    """
    roots = _readable_roots(source)

    def skipped(directory: str, names: list[str]) -> set[str]:
        out = {n for n in names if _outside(pathlib.Path(directory) / n, roots)}
        for n in sorted(out):
            where = pathlib.Path(directory) / n
            logger.warning("not copying %s: it is a link to outside the checkpoint, or no regular file", where)
        return out

    items = [item for item in sorted(source.iterdir()) if not _weight_file(item.name)]
    for name in skipped(str(source), [item.name for item in items]):
        items.remove(source / name)
    for item in items:
        if item.is_dir():
            shutil.copytree(item, tmp / item.name, ignore=skipped)
        else:
            shutil.copy2(item, tmp / item.name)


def _finish(tmp: pathlib.Path, source: pathlib.Path, output: pathlib.Path, weight_map: dict[str, str] | None,
            total: int, extra: dict | None) -> None:
    _copy_other_files(source, tmp)
    if weight_map is not None:
        metadata: dict[str, Any] = {"total_size": total}
        if extra:
            metadata[_META_KEY] = extra
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    # Atomic replace: the new directory appears complete; an old one is moved aside, then removed.
    old = None
    if output.exists():
        old = pathlib.Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        os.rename(output, old / output.name)
    os.rename(tmp, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert_to_stages(
    path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    num_stages: int,
    virtual_stages: int | None = None,
    schedule: str | None = None,
    split: str | Sequence[str] = "auto",
    auto_class: str | type | None = None,
    overwrite: bool = False,
) -> ConvertReport:
    """Write ``path`` to ``output`` with one safetensors file per stage of the given plan.

    Args:
        path: the source checkpoint directory (never modified).
        output: a new directory (written atomically; ``overwrite=True`` replaces an existing one).
        num_stages, virtual_stages, schedule, split, auto_class: the plan, as for
            ``from_pretrained(pipeline=True, ...)``; load with the same values to open only own files.
        overwrite: replace ``output`` if it exists.

    Returns:
        A :class:`ConvertReport`; ``stage_files[i]`` are the files stage ``i``'s rank opens.

    Example:
        >>> convert_to_stages(ckpt, out, num_stages=2).stage_files
        {0: ('model-stage-00001-of-00002.safetensors',), 1: ('model-stage-00002-of-00002.safetensors',)}
    """
    source = resolve_checkpoint(path)
    output = pathlib.Path(output)
    _check_output(source, output, overwrite)
    plan, keys = stage_keys(source, num_stages=num_stages, virtual_stages=virtual_stages, schedule=schedule,
                            split=split, auto_class=auto_class)
    index = CheckpointIndex.from_directory(source)
    holders: dict[str, list[int]] = {}
    for stage, stage_key_list in keys.items():
        for key in stage_key_list:
            holders.setdefault(key, []).append(stage)
    n = plan.num_stages
    # Keys in the source's order (state-dict order for transformers checkpoints) within each file.
    per_file: dict[str, list[str]] = {}
    for key in _source_order(index):
        owners = holders.get(key, [])
        name = stage_file_name(owners[0], n) if len(owners) == 1 else SHARED_FILE if owners else UNUSED_FILE
        per_file.setdefault(name, []).append(key)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.resolve().parent))
    try:
        writer = _Writer(index, tmp)
        for name in sorted(per_file):
            writer.write(name, per_file[name])
        stage_files: dict[int, tuple[str, ...]] = {}
        for s in range(n):
            opened = {stage_file_name(s, n)} & set(per_file)  # a stage holding only shared tensors has no file
            if any(len(holders[k]) > 1 for k in keys[s]):
                opened.add(SHARED_FILE)
            stage_files[s] = tuple(sorted(opened))
        extra = {
            "layout": "per-stage", "num_stages": n, "virtual_stages": plan.virtual_stages, "pp_size": plan.pp_size,
            "placement": plan.layout, "split": list(plan.split_points),
            "stage_files": {str(s): list(f) for s, f in stage_files.items()},
        }
        weight_map = {k: name for name, ks in per_file.items() for k in ks}
        _finish(tmp, source, output, weight_map, writer.bytes, extra)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return ConvertReport(source=source, output=output, files=writer.files, stage_files=stage_files,
                         bytes_written=writer.bytes)


def merge_shards(
    path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> ConvertReport:
    """Write ``path`` (per-stage or any other layout) to ``output`` as standard size-based shards.

    The layout is transformers' own: ``model.safetensors`` when everything fits in one shard, else
    ``model-00001-of-0000N.safetensors`` with an index; tensors keep their order and dtype, and no
    tensor is split (a tensor larger than ``max_shard_size`` gets a shard of its own).

    Args:
        path: the source checkpoint directory (never modified).
        output: a new directory (written atomically).
        max_shard_size: bytes per shard, or a string like ``"2GB"``.
        overwrite: replace ``output`` if it exists.

    Returns:
        A :class:`ConvertReport` (``stage_files`` empty).
    """
    source = resolve_checkpoint(path)
    output = pathlib.Path(output)
    try:
        limit = parse_size(max_shard_size, what="max_shard_size")
    except InputError as e:
        raise ConvertError(str(e)) from None
    _check_output(source, output, overwrite)
    index = _source_index(source)  # a PyTorch (.bin) checkpoint becomes safetensors here
    order = _source_order(index)
    sizes = _tensor_sizes(index)
    groups: list[list[str]] = [[]]
    used = 0
    for key in order:
        if groups[-1] and used + sizes[key] > limit:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += sizes[key]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.resolve().parent))
    try:
        writer = _Writer(index, tmp)
        if len(groups) == 1:
            writer.write(SINGLE_NAME, groups[0])
            weight_map = None
        else:
            names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
            for name, keys in zip(names, groups):
                writer.write(name, keys)
            weight_map = {k: name for name, keys in zip(names, groups) for k in keys}
        _finish(tmp, source, output, weight_map, writer.bytes, None)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return ConvertReport(source=source, output=output, files=writer.files, bytes_written=writer.bytes)


def _headers(index: CheckpointIndex) -> dict[str, dict]:
    return {shard: read_header(index.directory / shard) for shard in sorted(set(index.weight_map.values()))}


def _tensor_sizes(index: CheckpointIndex) -> dict[str, int]:
    if any(_is_pytorch(shard) for shard in index.weight_map.values()):
        return {k: t.numel() * t.element_size() for k, t in _pytorch_tensors(index).items()}
    sizes: dict[str, int] = {}
    for shard, header in _headers(index).items():
        for key, entry in header.items():
            if index.weight_map.get(key) == shard:
                begin, end = entry["data_offsets"]
                sizes[key] = end - begin
    missing = [k for k in index.weight_map if k not in sizes]
    if missing:
        raise CheckpointError(
            f"the index of {index.directory} names keys its shards do not hold: {missing[:5]}; re-save the checkpoint"
        )
    return sizes


def _source_order(index: CheckpointIndex) -> list[str]:
    """Keys in model order: per-stage files first by stage, then each file's own (data offset) order."""
    if any(_is_pytorch(shard) for shard in index.weight_map.values()):
        return list(_pytorch_tensors(index))  # file by file, each in its saved (state-dict) order
    order: list[str] = []
    for shard, header in _headers(index).items():
        keys = [k for k in header if index.weight_map.get(k) == shard]
        order += sorted(keys, key=lambda k: header[k]["data_offsets"][0])
    return order


def _pytorch_tensors(index: CheckpointIndex) -> dict[str, torch.Tensor]:
    """Every indexed key of a PyTorch checkpoint, file by file in name order (memory-mapped, not copied)."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.weight_map.values())):
        state = load_pytorch_file(index.directory / shard)
        out.update({k: v for k, v in state.items() if index.weight_map.get(k) == shard})
    missing = [k for k in index.weight_map if k not in out]
    if missing:
        raise CheckpointError(
            f"the index of {index.directory} names keys its .bin files do not hold: {missing[:5]}; "
            "re-save the checkpoint"
        )
    return out
