"""LoRA section, tables side: per-rank memory of a LoRA step against a full fine-tune."""

from __future__ import annotations

from typing import Any

from benchmarks.tables import Table, gb, pct

__all__ = ["markdown"]


def _table(lo: dict) -> Table:
    t = Table(["rank", "trainable (full / LoRA)", "optimizer state (full / LoRA)", "step peak above the model, full",
               "step peak, LoRA", "LoRA / full"])
    for r in lo["ranks"]:
        f, a = r["full"], r["lora"]
        t.add(str(r["rank"]), f"{f['trainable']:,} / {a['trainable']:,}", f"{gb(f['optimizer_bytes'])} / "
              f"{gb(a['optimizer_bytes'])}", gb(f["step_peak"]), gb(a["step_peak"]), pct(r["step_peak_ratio"]))
    return t


def markdown(res: dict[str, Any]) -> list:
    lo = res.get("lora")
    if not lo or not lo.get("ranks"):
        return []
    return [
        "## LoRA: per-rank memory of a training step", "",
        f"The train section's model on {lo['world']} ranks (1F1B), {lo['steps']} steps of ``train_step`` + AdamW: "
        f"every parameter trained, against a LoRA adapter (r={lo['rank_r']}, {', '.join(lo['targets'])}; "
        "AdamW over the adapter only). Step peak: the peak RSS of the steps above the loaded model's (gradients, "
        "optimizer state, activations).", "",
        _table(lo), "",
    ]

