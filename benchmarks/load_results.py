"""Load section, results side: the per-rank results summed up (``results.json``'s ``load``).

Its tables are in :mod:`benchmarks.load_tables`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from benchmarks.config import Sizes
from benchmarks.load import MOE_LOADS
from hf_pipeline.loading.checkpoint_files import CheckpointIndex, checkpoint_nbytes

__all__ = ["summarize"]


def _world_row(ours: list[dict], hf: list[dict], tensor_bytes: int) -> dict[str, Any]:
    """One world size's figures from its ranks' ``load_ours`` and ``load_hf`` results."""
    cold_ratios = [t["cold_load_over_read"] for t in ours]
    return {
        "ours_peak_rss": [t["peak_rss"] for t in ours], "ours_stage_bytes": [t["stage_bytes"] for t in ours],
        "ours_bytes_read": [t["bytes_read"] for t in ours], "ours_files_opened": [t["files_opened"] for t in ours],
        "hf_peak_rss": [t["peak_rss"] for t in hf], "hf_model_bytes": [t["model_bytes"] for t in hf],
        "peak_over_stage": max(t["peak_rss"] / t["stage_bytes"] for t in ours),
        "bytes_read_over_checkpoint": sum(t["bytes_read"] for t in ours) / tensor_bytes,
        "hf_bytes_read_over_checkpoint": sum(t["model_bytes"] for t in hf) / tensor_bytes,
        "hf_peak_over_ours": max(t["peak_rss"] for t in hf) / max(t["peak_rss"] for t in ours),
        "peak_resettable": all(t["resettable"] for t in ours + hf),
        # wall time of each rank's load against plainly reading its byte ranges (max over ranks)
        "load_seconds": [t["load_seconds"] for t in ours], "read_seconds": [t["read_seconds"] for t in ours],
        "load_over_read_per_rank": [t["load_over_read"] for t in ours],  # median of that rank's pair ratios
        "load_over_read": max(t["load_over_read"] for t in ours),
        "cold_load_seconds": [t["cold_load_seconds"] for t in ours],
        "cold_read_seconds": [t["cold_read_seconds"] for t in ours],
        "cold_load_over_read": max(cold_ratios) if all(cold_ratios) else None,
        "phases": [t["phases"] for t in ours],  # each rank's first load, by phase (LoadReport.seconds)
    }


def _moe(sizes: Sizes, ckpts: dict[str, str], find) -> dict[str, Any]:
    """The mixture of experts' loads: per mesh of :data:`~benchmarks.load.MOE_LOADS` run, each rank's peak RSS,
    bytes kept and bytes read, and the worst rank's peak / kept and read / kept (or the error)."""
    index = json.loads(pathlib.Path(ckpts["moe"], "model.safetensors.index.json").read_text())
    out: dict[str, Any] = {"tensor_bytes": index["metadata"]["total_size"], "meshes": []}
    for name, p, kwargs in MOE_LOADS:
        if p not in sizes.load_ranks:
            continue
        ranks = find(p, f"load moe {name}")
        row: dict[str, Any] = {"mesh": name, "ranks_count": p, "kwargs": kwargs}
        if not ranks or not all(r.get("ok") for r in ranks):
            row["error"] = "; ".join(r.get("error", "") for r in ranks if not r.get("ok")) or "no ranks"
        else:
            row["ranks"] = [{k: r[k] for k in ("peak_rss", "kept_bytes", "bytes_read", "stages", "resettable")}
                            for r in ranks]
            row["peak_over_kept"] = max(r["peak_rss"] / r["kept_bytes"] for r in ranks)
            row["read_over_kept"] = max(r["bytes_read"] / r["kept_bytes"] for r in ranks)
        out["meshes"].append(row)
    return out


def summarize(sizes: Sizes, ckpts: dict[str, str], find) -> dict[str, Any]:
    """``results.json``'s ``load``: the checkpoint's size, and per world size :func:`_world_row` (or its error).

    ``find(world, label)`` returns every rank's result of the task ``label`` in the launch of ``world``. The
    mixture of experts' loads go under ``moe`` (:func:`_moe`).
    """
    ckpt_bytes = checkpoint_nbytes(CheckpointIndex.from_directory(ckpts["load"]))
    index = json.loads(pathlib.Path(ckpts["load"], "model.safetensors.index.json").read_text())
    tensor_bytes = index["metadata"]["total_size"]
    shards = len(set(index["weight_map"].values()))
    load = {"checkpoint_bytes": ckpt_bytes, "tensor_bytes": tensor_bytes, "shards": shards, "by_world": {},
            "moe": _moe(sizes, ckpts, find)}
    for p in sizes.load_ranks:
        ours, hf = find(p, f"load hf_pipeline p={p}"), find(p, f"load transformers p={p}")
        if not all(t.get("ok") for t in ours + hf):
            load["by_world"][str(p)] = {"error": "; ".join(t.get("error", "") for t in ours + hf if not t.get("ok"))}
            continue
        load["by_world"][str(p)] = _world_row(ours, hf, tensor_bytes)
    return load
