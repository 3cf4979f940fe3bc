"""LoRA section, results side: per rank, the full fine-tune's and the LoRA step's memory, side by side."""

from __future__ import annotations

from typing import Any

from benchmarks.config import Sizes
from benchmarks.lora import LORA_RANK, LORA_TARGETS, STEPS

__all__ = ["summarize"]


def summarize(sizes: Sizes, find) -> dict[str, Any]:
    """results.json's ``lora``: per rank, both modes' figures and the step peak's ratio (LoRA / full)."""
    full, lora = find(sizes.world, "lora full"), find(sizes.world, "lora lora")
    ranks = []
    for f, lo in zip(full, lora):
        if not (f.get("ok") and lo.get("ok")):
            continue
        ranks.append({
            "rank": f["rank"], "full": {k: f[k] for k in ("model_bytes", "step_peak", "trainable", "optimizer_bytes")},
            "lora": {k: lo[k] for k in ("model_bytes", "step_peak", "trainable", "optimizer_bytes")},
            "local_params": f["local_params"],
            "step_peak_ratio": lo["step_peak"] / f["step_peak"] if f["step_peak"] else None,
            "resettable": f["resettable"] and lo["resettable"],
        })
    return {"world": sizes.world, "rank_r": LORA_RANK, "targets": LORA_TARGETS, "steps": STEPS, "ranks": ranks}
