"""The safetensors header of one shard, read and checked before any tensor data is.

safetensors layout: 8-byte little-endian header length N, N bytes of JSON, then the data. The
loader reads tensor bytes at the header's offsets itself (see :mod:`.weights`), so every entry is
checked here (dtype, shape, byte length, tiling of the data, file size) and a damaged file is named
as truncated or corrupted before gigabytes are read; a FIFO, device or directory in a shard's place is
refused, never opened for a blocking read.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..checked_files import open_regular
from ..errors import CheckpointError

__all__ = ["SAFETENSORS_DTYPES", "ShardHeader", "read_header", "read_shard_header", "slice_byte_ranges"]

_MAX_HEADER = 100_000_000  # safetensors refuses larger headers too; a bigger length field means corruption

# safetensors dtype name -> (bits per element, torch dtype name or None where torch has no such type).
SAFETENSORS_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"),
    "U8": (8, "uint8"),
    "I8": (8, "int8"),
    "I16": (16, "int16"),
    "U16": (16, "uint16"),
    "F16": (16, "float16"),
    "BF16": (16, "bfloat16"),
    "I32": (32, "int32"),
    "U32": (32, "uint32"),
    "F32": (32, "float32"),
    "I64": (64, "int64"),
    "U64": (64, "uint64"),
    "F64": (64, "float64"),
    "C64": (64, "complex64"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    # Packed sub-byte formats: no torch dtype holds one element each.
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
}


@dataclass(frozen=True)
class ShardHeader:
    """A checked shard header: where the data starts and each tensor's entry."""

    data_start: int  # file offset of the data; an entry's data_offsets are relative to it
    entries: dict[str, dict]  # key -> {"dtype", "shape", "data_offsets"}


def read_shard_header(path: pathlib.Path, what: str = "shard") -> ShardHeader:
    """The header of a safetensors shard, checked as strictly as safetensors checks it, and against the file size.

    safetensors layout: 8-byte little-endian header length N, N bytes of JSON, then the data;
    ``data_offsets`` are relative to the data start, the tensors tile the data without holes or
    overlaps, so a complete file is 8 + N + max(end) bytes. Reading this ourselves is cheap and lets
    us say "truncated" instead of a generic error; since the loader reads tensor bytes at these
    offsets itself, every entry's byte length is checked against its shape and dtype here. Only a
    regular file is read (:func:`~hf_pipeline.checked_files.open_regular`: a FIFO or a device is refused).

    Args:
        path: the safetensors file.
        what: what it is, for the errors (``"the RNG state"``; default ``"shard"``).
    """
    name = f"{what} {path.name} in {path.parent}"
    with open_regular(path, f"{what} of the checkpoint") as f:
        try:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{name} is truncated ({size} bytes, not even a header); re-download or re-save it"
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{name} is truncated or its header is corrupted: the header length field says {n} bytes but "
                    f"the file has {size}; re-download or re-save it"
                )
            raw = f.read(n)
        except OSError as e:
            raise CheckpointError(f"cannot read {name}: {e}") from e
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise CheckpointError("the header is not a JSON object")
        header.pop("__metadata__", None)
        end = _data_end(header)
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(
            f"{name} has a corrupted header ({type(e).__name__}: {e}): it is not a safetensors file hf_pipeline / "
            "transformers wrote, or is damaged; re-download or re-save it"
        ) from None
    expected = 8 + n + end
    if size < expected:
        raise CheckpointError(
            f"{name} is truncated (expected {expected} bytes, found {size}); "
            "the download or save was probably interrupted: re-download or re-save it"
        )
    if size > expected:
        raise CheckpointError(
            f"{name} is corrupted: {size - expected} bytes after the last tensor "
            f"(expected {expected} bytes, found {size}); re-download or re-save it"
        )
    return ShardHeader(data_start=8 + n, entries=header)


def _data_end(entries: dict[str, dict]) -> int:
    """Where the entries' data ends; raises (wrapped by the caller) for a bad entry or a gap between tensors."""
    spans = []
    for key, entry in entries.items():
        begin, stop = entry["data_offsets"]
        shape, dtype = entry["shape"], entry["dtype"]
        valid = isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape)
        if not (valid and isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop):
            raise CheckpointError(f"bad entry for {key!r}: {entry}")
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{key!r} has the unknown dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})"
            )
        bits = SAFETENSORS_DTYPES[dtype][0] * math.prod(shape)
        if bits != 8 * (stop - begin):
            raise CheckpointError(
                f"{key!r} ({dtype}, shape {shape}) needs {bits / 8:g} bytes but its data_offsets span {stop - begin}"
            )
        spans.append((begin, stop, key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise CheckpointError(
                f"the data of {key!r} starts at {begin}, not where the previous tensor ends ({end})"
            )
        end = stop
    return end


def read_header(path: pathlib.Path) -> dict[str, dict]:
    """The tensor entries of a safetensors header (see :func:`read_shard_header`)."""
    return read_shard_header(path).entries


def slice_byte_ranges(
    offset: int, shape: Sequence[int], itemsize: int, dim: int, ranges: Sequence[tuple[int, int]]
) -> Iterator[tuple[int, int]]:
    """Where a slice of a stored (row-major) tensor lies in its file, so that only its bytes are read.

    Args:
        offset: file offset of the tensor's first byte; ``shape``, ``itemsize``: as stored.
        dim, ranges: keep indices ``first .. first + length - 1`` along ``dim`` for each ``(first, length)``.

    Returns:
        ``(file offset, byte count)`` pairs in file order, adjacent ones joined. Their concatenation is the
        slice laid out contiguously: for each index of the dims before ``dim``, each range in turn.
    """
    inner = math.prod(shape[dim + 1 :]) * itemsize  # bytes of one index along dim within one outer row
    row = shape[dim] * inner
    start = end = -1
    for o in range(math.prod(shape[:dim])):
        for first, length in ranges:
            if not length or not inner:
                continue
            begin = offset + o * row + first * inner
            if begin != end:
                if end > start:
                    yield start, end - start
                start = begin
            end = begin + length * inner
    if end > start:
        yield start, end - start
