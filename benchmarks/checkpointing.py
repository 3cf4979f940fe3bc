"""Checkpointing section: activation memory and step time with and without activation checkpointing.

The train section's LLaMA at a long sequence (``ckpt_seq``, 1024 in a full run) on ``world`` ranks
under 1F1B: each rank's peak memory above its resting level during a ``train_step`` (the OS's
high-water mark, reset before the step, large allocations returned to the OS at once so freed
activations leave the count), and the step's time, alternating steps without checkpointing and with
``activation_checkpointing_enable()`` (every layer), the first pair a warm-up. Beside them, the
memory planner's prediction for the same step (``plan_report(..., checkpoint_every_n_layers=1)``):
live activations plus gradients, what the measured peak holds above the resting model (P2P buffers
persist between steps). Results in ``results.json``'s ``checkpointing``; tables here too.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from benchmarks.config import Sizes
from benchmarks.tables import Table, gb
from benchmarks.timing import median, sync
from devtools.host_memory import host_peak_rss, host_rss, reset_host_peak

__all__ = ["TASKS", "launches", "markdown", "summarize"]

LABEL = "checkpointing"


def _ckpt_batch(sizes: dict):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, sizes["vocab"], (sizes["ckpt_batch"], sizes["ckpt_seq"]), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _step(model, batch: dict) -> tuple[float, int]:
    """(seconds, peak bytes above the resting RSS) of one ``train_step``; gradients cleared after."""
    import gc

    gc.collect()
    sync()
    reset_host_peak()
    base = host_rss()
    t = time.perf_counter()
    model.train_step(batch)
    took = time.perf_counter() - t
    peak = host_peak_rss() - base
    for p in model.parameters():
        p.grad = None
    return took, peak


def train_checkpointing(spec: dict, out: dict) -> None:
    """Steps without and with activation checkpointing, alternating; per-rank peak memory and step time."""
    import ctypes

    import torch
    import torch.distributed as dist

    from hf_pipeline import AutoModelForCausalLM

    # Allocations of 64 KiB or more are mapped and unmapped at once (no dynamic threshold), so memory
    # freed in the step leaves the RSS and the high-water mark measures the step's own peak.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    sizes = spec["sizes"]
    model = AutoModelForCausalLM.from_pretrained(
        spec["path"], pipeline=True, device="cpu", dtype=torch.float32, progress=False, schedule="1f1b",
        n_microbatches=sizes["ckpt_microbatches"],
    )
    model.train()
    batch = _ckpt_batch(sizes)
    runs: dict[str, dict[str, list]] = {name: {"seconds": [], "peak": []} for name in ("plain", "checkpointed")}
    for i in range(sizes["ckpt_reps"] + 1):
        for name in runs:
            if name == "plain":
                model.activation_checkpointing_disable()
            else:
                model.activation_checkpointing_enable()
            took, peak = _step(model, batch)
            if i:  # the first pair warms up (torch's shape inference, first allocations)
                runs[name]["seconds"].append(took)
                runs[name]["peak"].append(peak)
    slowest = torch.tensor([max(r["seconds"]) if r["seconds"] else 0.0 for r in runs.values()])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    out.update(rank=dist.get_rank(), runs=runs, step_seconds_max=slowest.tolist())


TASKS = {"train_checkpointing": train_checkpointing}


def launches(sizes: Sizes, ckpts: dict[str, str]) -> dict[int, list[dict]]:
    """The section's one job, on ``world`` ranks."""
    spec = {"task": "train_checkpointing", "label": LABEL, "path": ckpts["train"], "sizes": asdict(sizes)}
    return {sizes.world: [spec]}


def _prediction(sizes: Sizes, path: str) -> list[dict[str, int]]:
    from hf_pipeline.memory.planner import plan_report

    report = plan_report(
        path, stages=sizes.world, schedule="1f1b", dtype="float32", batch=sizes.ckpt_batch, seq=sizes.ckpt_seq,
        n_microbatches=sizes.ckpt_microbatches, checkpoint_every_n_layers=1,
    )
    return [
        {"activations": r.activation_bytes, "checkpointed_activations": r.checkpointed_activation_bytes,
         "grads": r.grad_bytes}
        for r in report.ranks
    ]


def summarize(sizes: Sizes, ckpts: dict[str, str], find) -> dict[str, Any]:
    """``results.json``'s ``checkpointing``: per rank the measured peaks and times beside the prediction."""
    per_rank = find(sizes.world, LABEL)
    if not per_rank or not per_rank[0].get("ok"):
        return {"error": per_rank[0]["error"] if per_rank else "no result"}
    predicted = _prediction(sizes, ckpts["train"])
    ranks = []
    for r, res in enumerate(per_rank):
        row = {"rank": r, **{f"predicted_{k}": v for k, v in predicted[r].items()}}
        for name, run in res["runs"].items():
            row[f"{name}_peak"] = median(run["peak"])
            row[f"{name}_seconds"] = median(run["seconds"])
        ranks.append(row)
    plain, ckpt = per_rank[0]["step_seconds_max"]
    return {
        "seq": sizes.ckpt_seq, "batch": sizes.ckpt_batch, "n_microbatches": sizes.ckpt_microbatches,
        "world": sizes.world, "ranks": ranks, "step_seconds": {"plain": plain, "checkpointed": ckpt},
        "slowdown": ckpt / plain if plain > 0 else None,
    }


def markdown(res: dict[str, Any]) -> list:
    """results.md's checkpointing section."""
    ck = res["checkpointing"]
    blocks: list = ["## Activation checkpointing", ""]
    if "error" in ck:
        return blocks + [f"error: {ck['error']}", ""]
    blocks += [
        f"LLaMA (train section's model), 1F1B on {ck['world']} ranks, batch {ck['batch']} x seq {ck['seq']} in "
        f"{ck['n_microbatches']} microbatches. Peak: the rank's RSS high-water mark above its resting level during "
        "one `train_step` (median of the timed steps); predicted: the memory planner's live activations + gradients.",
        "",
    ]
    table = Table(["rank", "peak, plain", "predicted, plain", "peak, checkpointed", "predicted, checkpointed",
                   "step (s), plain", "step (s), checkpointed"])
    for r in ck["ranks"]:
        table.add(
            str(r["rank"]), gb(r["plain_peak"]), gb(r["predicted_activations"] + r["predicted_grads"]),
            gb(r["checkpointed_peak"]), gb(r["predicted_checkpointed_activations"] + r["predicted_grads"]),
            f"{r['plain_seconds']:.2f}", f"{r['checkpointed_seconds']:.2f}",
        )
    slowdown = "-" if ck["slowdown"] is None else f"{ck['slowdown']:.2f}x"
    return blocks + [table, "", f"Slowest rank's step: checkpointed / plain = {slowdown}.", ""]
