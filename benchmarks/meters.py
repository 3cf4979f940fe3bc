"""What a load costs the machine: peak RSS (page-cache pages included), the page cache dropped, plain reads.

The load section reads these against hf_pipeline's and transformers' loaders: the least any loader
of the same tensors does (:func:`plain_read` of :func:`byte_ranges`), and the OS's own high-water
mark of the memory a load needed (:class:`PeakMeter`).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import time

from devtools.host_memory import host_peak_rss, host_rss, reset_host_peak

__all__ = ["PeakMeter", "byte_ranges", "drop_page_cache", "kept", "plain_read", "touch"]


def touch(params) -> None:
    """Read every parameter once, as a first forward would."""
    # transformers maps same-dtype safetensors weights lazily (views of the file mapping): their pages
    # are read, and count as resident, only when first used. Reading every weight once, as the first
    # forward would, makes both loaders' numbers mean "the weights are in memory".
    import torch

    with torch.no_grad():
        for p in params:
            p.sum()


def kept(model) -> tuple[int, int]:
    """(parameters, bytes) a loaded pipeline keeps on this rank: the local part of a sharded one."""
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in model.checkpoint_named_parameters()]
    return sum(t.numel() for t in local), sum(t.numel() * t.element_size() for t in local)


class PeakMeter:
    """Peak RSS above the RSS at entry, as the OS counts it (mapped file pages included).

    After the ``with`` block: ``peak`` (bytes above ``base``), ``base`` (the RSS at entry) and
    ``resettable`` (whether the OS's high-water mark could be reset at entry).
    """

    def __enter__(self):
        gc.collect()
        self.resettable = reset_host_peak()
        self.base = host_rss()
        return self

    def __exit__(self, *exc):
        self.peak = host_peak_rss() - self.base


def byte_ranges(directory: str, keys: list[str]) -> dict[str, list[tuple[int, int]]]:
    """file -> sorted (offset, length) of ``keys``' stored bytes, from the safetensors headers."""
    index = json.loads(pathlib.Path(directory, "model.safetensors.index.json").read_text())
    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(index["weight_map"][key], []).append(key)
    ranges = {}
    for fname, names in by_file.items():
        with open(pathlib.Path(directory, fname), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        spans = ((header[k]["data_offsets"][0], header[k]["data_offsets"][1]) for k in names)
        ranges[fname] = sorted((8 + n + start, end - start) for start, end in spans)
    return ranges


def plain_read(directory: str, ranges: dict[str, list[tuple[int, int]]]) -> float:
    """Seconds to read these byte ranges into fresh memory, one file after another: the least any
    loader of the same tensors does (open, read into memory it allocates), nothing parsed or built.

    Fresh means never touched: anonymous mappings, so every page is faulted in and zeroed by the OS
    as a loader's new tensors are. (Buffers from the allocator would reuse the pages the model just
    freed, already mapped, and read several times faster than any first load can.)"""
    import mmap

    t = time.perf_counter()
    kept = []
    for fname, spans in ranges.items():
        with open(pathlib.Path(directory, fname), "rb", buffering=0) as f:
            for offset, length in spans:
                buf = mmap.mmap(-1, length)
                f.seek(offset)
                view, done = memoryview(buf), 0
                while done < length:
                    done += f.readinto(view[done:])
                view.release()
                kept.append(buf)  # held until the end, as a loader holds its tensors
    took = time.perf_counter() - t
    for buf in kept:
        buf.close()
    return took


def drop_page_cache() -> bool:
    """Empty the OS page cache (needs root; False where the machine does not allow it)."""
    try:
        os.sync()
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False
