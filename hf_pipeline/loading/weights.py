"""Per-stage checkpoint loading: each rank reads only the safetensors shards, and only the tensors, it owns.

A stage's parameter names equal the checkpoint keys, so loading is: map each wanted name to a key
(trying aliases for tied weights, base-model prefixes and the key renames transformers applies,
see :func:`~.key_renames.checkpoint_key_renames`), group the keys by shard, check every shard header we need
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

import dataclasses
import math
import pathlib
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

import torch

from ..checked_files import is_regular_file, open_regular
from ..errors import CheckpointError, InternalError
from ..log import progress_bar
from .checkpoint_files import CheckpointIndex, FileStamp, changed_while_read, file_stamp, name_listing
from .safetensors_header import SAFETENSORS_DTYPES, read_shard_header, slice_byte_ranges

__all__ = ["LoadReport", "chunk_bounds", "load_tensors", "resolve_keys"]


@dataclass(kw_only=True)
class LoadReport:
    """What :func:`load_tensors` actually read, for tests and logs."""

    files_opened: list[str] = field(default_factory=list)  # shard file names, in the order opened
    keys_read: list[str] = field(default_factory=list)  # checkpoint keys, each once
    bytes_read: int = 0  # stored bytes (before any dtype cast) of the tensors read
    # Names missing from the checkpoint, initialised as transformers does.
    initialized: list[str] = field(default_factory=list)
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
            f"{name_listing(missing)}. Does the config match the checkpoint (number of layers, tie_word_embeddings, "
            "model class / base_model_prefix)?"
        )
    return source


_IGNORE_HINT = "if these keys are harmless, pass their patterns in ignore_unexpected"


def _check_unexpected(
    index: CheckpointIndex, expected: Collection[str], ignore: Collection[str], hint: str = _IGNORE_HINT
) -> None:
    expected = set(expected)
    patterns = [re.compile(p) for p in ignore]
    # re.search, as transformers applies _keys_to_ignore_on_load_unexpected.
    extra = sorted(k for k in index.weight_map if k not in expected and not any(p.search(k) for p in patterns))
    if extra:
        raise CheckpointError(
            f"checkpoint {index.directory} holds {len(extra)} tensor(s) the model does not have: "
            f"{name_listing(extra)}. The config probably does not match the checkpoint (fewer layers, another "
            f"architecture or model class); {hint}"
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
    parts: Mapping[str, tuple[int, ...]] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Read one stage's tensors, opening only the shards that hold them.

    Args:
        index: the checkpoint's :class:`CheckpointIndex`.
        wanted: stage name -> (expected shape, target dtype). Floating tensors are cast to a floating
            target; integer/bool tensors keep their stored dtype unless the target is also non-floating.
        aliases: stage name -> checkpoint keys tried in order when the name itself is not stored (tied
            weights: ``lm_head.weight`` -> ``transformer.wte.weight``; base-model prefixes; ``LayerNorm.gamma``).
        device: where the tensors go. Each tensor's bytes are read into its final buffer (through a
            small bounce buffer when it is cast or goes to an accelerator).
        expected_keys: every key the whole model may hold (all stages and aliases). Checkpoint keys
            outside it raise, checked from the index alone. None skips the check.
        ignore_unexpected: regex patterns (``re.search``) of checkpoint keys never reported as unexpected.
        progress: show a tqdm bar over bytes (set it on one rank only); ``transformers.logging.disable_progress_bar()``
            and ``HF_HUB_DISABLE_PROGRESS_BARS`` hide it too.
        floating: names that must be stored as floating point (the model's float parameters): an integer
            or bool tensor for one of them raises, naming the key and the shard, instead of being kept as is.
        unexpected_hint: what the unexpected-keys error advises (default: ``ignore_unexpected``).
        parts: stage name -> ``(dim, index, count)``: only part ``index`` of ``count`` along ``dim`` as torch.chunk
            cuts (a tp / fsdp rank's slice); ``(dim, index, count, packs)``: that part of each of ``packs`` equal
            blocks side by side (a packed tensor); a tuple of parts: each of the one before (FSDP over tp);
            the header is checked against the whole shape.
        into: stage name -> a tensor of the shape and dtype read, filled in place (FSDP's local shards).

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
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # Every file read, as it was before its read (the index: before from_directory read it). A save
    # landing meanwhile shows up as a missing shard, a stale index or a short file, or as no error at
    # all and a mix of two saves' tensors: the stamps tell "changed under the reader" from "damaged".
    seen = dict(index.stamps)
    try:
        # Pass 1, headers only: shapes, sizes, dtypes and stale indexes fail here, before gigabytes are read.
        started = time.perf_counter()
        floating = set(floating)
        plans = {
            s: _plan_shard(index, s, keys, by_key, wanted, floating, parts or {}, seen=seen)
            for s, keys in groups.items()
        }
        headers_done = time.perf_counter()
        out, report = _read_shards(index, plans, by_key, device=device, progress=progress, into=into or {})
    except CheckpointError as e:
        changed = changed_while_read(index.directory, seen)
        if changed is not None:
            raise changed from e
        raise
    changed = changed_while_read(index.directory, seen)
    if changed is not None:
        raise changed
    report.seconds = {"headers": headers_done - started, "read": time.perf_counter() - headers_done}
    return out, report


def _read_shards(
    index: CheckpointIndex, plans: Mapping[str, list[_TensorPlan]], by_key: Mapping[str, list[str]], *,
    device: torch.device, progress: bool, into: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Pass 2: open each planned shard once and read its tensors in file order (stage name -> tensor),
    into the ``into`` tensor of one of a key's names where there is one."""
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
                        dests = [into[n] for n in by_key[key] if n in into]
                        tensor = reader.read(f, t, into=dests[0] if dests else None)
                        for dest in dests[1:]:
                            if dest is not tensor:
                                dest.copy_(tensor)  # names of one key with destinations of their own
                        for name in by_key[key]:
                            out[name] = into.get(name, tensor)
                        report.keys_read.append(key)
                        report.bytes_read += t.nbytes
                        bar.update(t.nbytes)
            except OSError as e:
                where = f"reading {key!r} from" if key is not None else "opening"
                raise CheckpointError(
                    f"error {where} shard {shard!r} in {index.directory}: {type(e).__name__}: {e}"
                ) from e
            except _ShortRead as e:
                raise CheckpointError(
                    f"shard {shard!r} in {index.directory} ended while reading {key!r} ({e}), before where its header "
                    "says, though the file did not change during the read: the disk or filesystem returned less than "
                    "it holds; check it, then re-download or re-save the shard"
                ) from None
    return out, report


@dataclass(frozen=True)
class _TensorPlan:
    key: str
    offset: int  # absolute file offset of the tensor's first byte
    nbytes: int  # stored bytes
    shape: tuple[int, ...]
    stored: torch.dtype
    target: torch.dtype
    # (dim, ((first, length), ...)): keep only these ranges along dim (one per block of a packed tensor)
    part: tuple[int, tuple[tuple[int, int], ...]] | None = None


def chunk_bounds(size: int, index: int, count: int) -> tuple[int, int]:
    """``(first, length)`` of part ``index`` of ``count`` of ``size`` rows, split as ``torch.chunk`` (and
    FSDP2) split them: ``ceil(size / count)`` rows each, the last parts shorter or empty."""
    step = -(-size // count)
    first = min(index * step, size)
    return first, min(step, size - first)


def _part_plan(t: _TensorPlan, part: tuple) -> _TensorPlan:
    """``t`` narrowed to part ``index`` of ``count`` along ``dim`` (of each of its ``packs`` blocks when the
    part says ``(dim, index, count, packs)``): along dim 0 one part is a contiguous byte range; otherwise the
    reader reads the slice's byte ranges in each outer row (``slice_byte_ranges``). Either way ``nbytes``
    becomes the bytes read, so the report counts what a rank read, not the whole tensor. A composed part (a
    tuple of parts: FSDP's dim-0 chunk of a tp slice) narrows in turn."""
    if part and isinstance(part[0], tuple):
        for step in part:
            t = _part_plan(t, step)
        return t
    dim, index, count, *rest = part
    packs = rest[0] if rest else 1
    block = t.shape[dim] // packs
    first, length = chunk_bounds(block, index, count)
    if dim > 0 or packs > 1:
        if t.part is not None:
            raise InternalError(f"{t.key!r}: a second slice {part} along a dim > 0 of the slice {t.part}")
        per_index = t.nbytes // t.shape[dim] if t.shape[dim] else 0  # bytes of one index along dim, all outer rows
        ranges = tuple((p * block + first, length) for p in range(packs))
        return dataclasses.replace(t, part=(dim, ranges), nbytes=packs * length * per_index)
    # Dim 0: the offset moves by whole stored rows; a row read holds only a slice's columns, if one was taken.
    stored_row = math.prod(t.shape[1:]) * t.stored.itemsize
    read_row = t.nbytes // t.shape[0] if t.shape[0] else 0
    return dataclasses.replace(
        t, offset=t.offset + first * stored_row, nbytes=length * read_row, shape=(length, *t.shape[1:])
    )


def _read_shape(t: _TensorPlan) -> tuple[int, ...]:
    """The shape of what is read of ``t``: its (dim-0 narrowed) shape, less what its slice leaves out."""
    if t.part is None:
        return t.shape
    dim, ranges = t.part
    return (*t.shape[:dim], sum(n for _, n in ranges), *t.shape[dim + 1 :])


def _plan_shard(
    index: CheckpointIndex, shard: str, keys: list[str], by_key: Mapping[str, list[str]], wanted: Mapping,
    floating: Collection[str] = (),
    parts: Mapping[str, tuple[int, ...]] = {},  # noqa: B006 - read only
    *, seen: dict[pathlib.Path, FileStamp | None] | None = None,
) -> list[_TensorPlan]:
    """Check one shard's header against what is wanted from it; what to read, in file order.

    ``seen`` gets the shard's stamp from before its header is read (a single-file checkpoint keeps the index's).
    """
    path = index.directory / shard
    if seen is not None:
        seen.setdefault(path, file_stamp(path))
    if not is_regular_file(path, "shard"):
        raise CheckpointError(
            f"shard {shard!r} (holding {keys[0]!r}) is missing from {index.directory}; re-download the checkpoint"
        )
    header = read_shard_header(path)
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
                    f"{key!r}{via} in shard {shard!r} of {index.directory} has shape {list(stored_shape)} but the "
                    f"model expects {list(shape)}; the config (hidden_size, vocab_size, heads, ...) does not match the "
                    "checkpoint"
                )
        torch_name = SAFETENSORS_DTYPES[entry["dtype"]][1]
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
                f"{key!r}{via} in shard {shard!r} of {index.directory} is stored as {entry['dtype']} (integers) but "
                f"the model's parameter is floating point ({target}); the checkpoint is quantized or damaged: re-save "
                "it with floating-point weights (or dequantize it first)"
            )
        # As before: floating tensors take a floating target, integer/bool ones a non-floating one only.
        if stored_dtype.is_floating_point != target.is_floating_point:
            target = stored_dtype
        begin, stop = entry["data_offsets"]
        plan = _TensorPlan(key, header.data_start + begin, stop - begin, stored_shape, stored_dtype, target)
        part = parts.get(by_key[key][0])
        plans.append(plan if part is None else _part_plan(plan, part))
    # File order: one forward sweep through the shard.
    return sorted(plans, key=lambda t: t.offset)


def _open_shard(path: pathlib.Path):
    # Unbuffered: readinto() then goes straight from the page cache into the destination tensor. A regular
    # file only: a FIFO put in the shard's place after its header was read must not block the read.
    return open_regular(path, "shard", buffering=0)


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

    def read(self, f, t: _TensorPlan, *, into: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``t`` from the open shard ``f``: a new tensor, or ``into`` filled in place (its shape and
        dtype those read, on this reader's device)."""
        if into is not None:
            wrong = (tuple(into.shape), into.dtype, into.device) != (_read_shape(t), t.target, self.device)
            if wrong or into.requires_grad or not into.is_contiguous():
                raise InternalError(
                    f"{t.key!r}: destination {tuple(into.shape)} {into.dtype} on {into.device} (contiguous "
                    f"{into.is_contiguous()}, requires_grad {into.requires_grad}), read {_read_shape(t)} {t.target} "
                    f"on {self.device}: pass a detached contiguous tensor"
                )
        out = torch.empty(_read_shape(t), dtype=t.target, device=self.device) if into is None else into
        if t.part is None:  # the whole tensor (or a dim-0 part: its plan already narrowed): one byte range
            ranges = [(t.offset, t.nbytes)] if t.nbytes else []
        else:  # a slice along a dim > 0 (tensor parallelism), or a packed tensor's blocks: only their bytes
            dim, kept = t.part
            ranges = slice_byte_ranges(t.offset, t.shape, t.stored.itemsize, dim, kept)
        if self.device.type == "cpu" and t.target == t.stored:  # straight into the result
            dest, at = _as_bytes(out), 0
            for offset, n in ranges:
                _readinto(f, offset, dest[at : at + n])
                at += n
            return _from_little_endian(out)
        self._read_cast(f, t, ranges, out)
        return out

    def _read_cast(self, f, t: _TensorPlan, ranges, out: torch.Tensor) -> None:
        """Fill ``out`` (cast, or on an accelerator) with the bytes of ``ranges`` through the bounce buffer,
        several ranges or one range's pieces at a time, so the extra memory stays one chunk."""
        size = t.stored.itemsize
        bounce = self._bounce_buffer()
        capacity = len(bounce) // size * size  # whole elements; every range is whole elements too
        view, flat = _as_bytes(bounce), out.view(-1)
        filled = done = 0  # bytes in the bounce buffer; elements of out written

        def flush() -> None:
            nonlocal filled, done
            n = filled // size
            flat[done : done + n].copy_(_from_little_endian(bounce[:filled].view(t.stored)))
            done, filled = done + n, 0

        for offset, n in ranges:
            while n:
                take = min(n, capacity - filled)
                _readinto(f, offset, view[filled : filled + take])
                filled, offset, n = filled + take, offset + take, n - take
                if filled == capacity:
                    flush()
        if filled:
            flush()


_CHUNK = 16 << 20  # bytes per cast / transfer step: small next to any stage, large enough for full-speed reads


def _from_little_endian(tensor: torch.Tensor) -> torch.Tensor:
    # safetensors stores little-endian data; only a big-endian host has to swap it.
    if sys.byteorder == "little" or tensor.element_size() == 1:
        return tensor
    swapped = tensor.view(-1).view(torch.uint8).view(-1, tensor.element_size()).flip(-1)
    return tensor.copy_(swapped.contiguous().view(tensor.dtype).view(tensor.shape))
