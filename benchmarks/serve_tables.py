"""Serve section, tables side: one request stream through five servers, each against the served pipeline."""

from __future__ import annotations

from typing import Any

from benchmarks import serve_capacity
from benchmarks.tables import Table

__all__ = ["markdown"]

NAMES = {
    "served": "hf_pipeline Engine, default batching",
    "static": "hf_pipeline Engine, static batches",
    "served_v": "hf_pipeline Engine, default batching, loaded for zbv-zero-bubble (2 stages per rank in a V)",
    "hf_continuous": "transformers continuous batching, 1 process",
    "hf_native_pp": "transformers native pipeline (pp_size), static batches",
}


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _table(sv: dict) -> Table:
    t = Table(["contender", "ranks", "batching", "tokens/s", "vs served", "p50 latency", "vs served", "p99 latency",
               "vs served", "p50 time to first token", "vs served", "tokens equal served"])
    for key, row in sv["contenders"].items():
        ranks = "1" if key == "hf_continuous" else str(sv["world"])
        if "error" in row:
            t.add(NAMES[key], ranks, None, f"did not run: {row['error']}", None, None, None, None, None, None, None,
                  None)
            continue
        t.add(NAMES[key], ranks, row.get("batching"), f"{row['tokens_per_s']:.1f}", _x(row.get("throughput_vs_served")),
              f"{row['latency_p50']:.2f} s", _x(row.get("latency_p50_vs_served")), f"{row['latency_p99']:.2f} s",
              _x(row.get("latency_p99_vs_served")), f"{row['ttft_p50']:.2f} s", _x(row.get("ttft_p50_vs_served")),
              f"{row.get('tokens_equal_served', '-')} / {sv['requests']}")
    return t


def markdown(res: dict[str, Any]) -> list:
    sv = res.get("serve")
    if not sv:
        return []
    lines = [
        "## Serve: one request stream through five servers", "",
        f"{sv['requests']} greedy requests (seed {sv['seed']}): prompts of {sv['prompt_len'][0]}-{sv['prompt_len'][1]} "
        f"tokens, {sv['new_tokens'][0]}-{sv['new_tokens'][1]} new tokens each ({sv['requested_tokens']} in all), "
        f"Poisson arrivals at {sv['rate']:g} requests/s (the last at {sv['stream_seconds']:.1f} s); at most "
        f"{sv['max_batch']} rows per batch; the train section's model. Each server gets one warm-up request, then "
        "the stream at its arrival times. Throughput: generated tokens over the time from the first arrival to "
        "the last token; latency: a request's arrival to its last token (queueing included); time to first token "
        "likewise. Ratios against the served pipeline: above 1 is more tokens/s, or a longer wait. Tokens equal "
        "served: requests whose greedy tokens are the served pipeline's (required of the static Engine, of the V "
        "layout and of transformers' continuous batching; reported for transformers' native pipeline).", "",
        _table(sv), "",
    ]
    lines += serve_capacity.markdown(sv)
    if sv.get("mismatches"):
        lines += ["Mismatches (the speed figures above are not comparable):", ""] + [
            f"- {m}" for m in sv["mismatches"]] + [""]
    return lines
