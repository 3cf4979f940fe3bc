"""Serve section, results side: per contender throughput, latency percentiles, tokens against the served
pipeline's (``results.json``'s ``serve``). Its tables are in :mod:`benchmarks.serve_tables`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from benchmarks.config import Sizes
from benchmarks.serve import CONTENDERS, STREAM_SEED, request_stream

__all__ = ["EXACT", "summarize"]

# Contenders whose greedy tokens must equal the served pipeline's, request by request (transformers'
# native pipeline is compared and reported, not required: its padded rows are its own business).
EXACT = ("static", "served_v", "hf_continuous")


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (linear between the nearest ranks, as numpy's default)."""
    import numpy

    return float(numpy.percentile(xs, q))


def _stats(records: list[dict]) -> dict[str, Any]:
    """Throughput over the stream (from the first arrival to the last token) and the percentiles."""
    latency = [r["done"] - r["arrival"] for r in records]
    ttft = [r["first"] - r["arrival"] for r in records]
    tokens = sum(len(r["tokens"]) for r in records)
    span = max(r["done"] for r in records)
    return {
        "tokens": tokens, "seconds": span, "tokens_per_s": tokens / span,
        "latency_p50": percentile(latency, 50), "latency_p99": percentile(latency, 99),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "latencies": latency,
    }


def _contender(results: list[dict]) -> tuple[dict[str, Any], list[list[int]] | None]:
    """One contender's row (or its error) and its per-request tokens."""
    failed = [r for r in results if not r.get("ok")]
    if not results or failed:
        return {"error": failed[0]["error"] if failed else "did not run"}, None
    main = next(r for r in results if r.get("records"))
    row = _stats(main["records"])
    row["batching"] = main.get("batching")
    row["task_seconds"] = max(r["wall_seconds"] for r in results)  # loading, warm-up and the stream
    return row, [r["tokens"] for r in main["records"]]


def summarize(sizes: Sizes, find) -> dict[str, Any]:
    """results.json's ``serve``: the stream, each contender's figures and ratios against the served
    pipeline, and ``mismatches`` (wrong token counts, or tokens that differ where they must not)."""
    stream = request_stream(asdict(sizes))
    want = [r["max_new_tokens"] for r in stream]
    rows, tokens, mismatches = {}, {}, []
    for key, label in CONTENDERS.items():
        rows[key], tokens[key] = _contender(find(1 if key == "hf_continuous" else sizes.world, label))
        if tokens[key] is not None and [len(t) for t in tokens[key]] != want:
            mismatches.append(f"{label}: generated token counts differ from the requests' max_new_tokens")
    served = rows["served"]
    for key, row in rows.items():
        if "error" in row or "error" in served:
            continue
        equal = [a == b for a, b in zip(tokens[key], tokens["served"])]
        row["tokens_equal_served"] = sum(equal)
        row["throughput_vs_served"] = row["tokens_per_s"] / served["tokens_per_s"]
        for k in ("latency_p50", "latency_p99", "ttft_p50"):
            row[f"{k}_vs_served"] = row[k] / served[k]
        if key in EXACT and not all(equal):
            mismatches.append(f"{CONTENDERS[key]}: greedy tokens differ from the served pipeline's in "
                              f"{len(equal) - sum(equal)} of {len(equal)} requests")
    return {
        "world": sizes.world, "requests": len(stream), "seed": STREAM_SEED, "rate": sizes.serve_rate,
        "prompt_len": list(sizes.serve_prompt_len), "new_tokens": list(sizes.serve_new_tokens),
        "max_batch": sizes.serve_batch, "stream_seconds": stream[-1]["arrival"], "requested_tokens": sum(want),
        "contenders": rows, "mismatches": mismatches,
    }

