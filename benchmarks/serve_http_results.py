"""Serve-http section, results side: a contender's figures from guidellm's JSON reports, and the ratios.

A contender measured by one guidellm run has one report; the 2-way limit has two, run side by side. From
them: output tokens/s and requests/s (guidellm's own means, summed over the reports), time to first token
p50 / p90 and inter-token latency p50 (over every successful request of the reports, per-request values as
guidellm records them), errors (errored and incomplete requests), and each request's output text by prompt,
so the greedy outputs of two contenders can be compared (up to a last incomplete character: :func:`_text`).
Its tables are in :mod:`benchmarks.serve_http_tables`.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["contender_row", "ratios"]


def _percentile(xs: list[float], q: float) -> float | None:
    import numpy

    return float(numpy.percentile(xs, q)) if xs else None


def _mean(report: dict, metric: str) -> float:
    (bench,) = report["benchmarks"]
    return float(bench["metrics"][metric]["successful"]["mean"])


def contender_row(reports: list[dict]) -> dict[str, Any]:
    """One contender's row from its guidellm reports (one each from runs side by side)."""
    ok: list[dict] = []
    errors = 0
    for report in reports:
        (bench,) = report["benchmarks"]
        requests = bench["requests"]
        ok += requests["successful"] or []
        errors += len(requests["errored"] or []) + len(requests["incomplete"] or [])
    outputs = {json.loads(r["request_args"])["body"]["prompt"]: r["output"] for r in ok}
    return {
        "output_tokens_per_s": sum(_mean(r, "output_tokens_per_second") for r in reports),
        "requests_per_s": sum(_mean(r, "requests_per_second") for r in reports),
        "ttft_p50_ms": _percentile([r["time_to_first_token_ms"] for r in ok], 50),
        "ttft_p90_ms": _percentile([r["time_to_first_token_ms"] for r in ok], 90),
        "itl_p50_ms": _percentile([r["inter_token_latency_ms"] for r in ok if r["inter_token_latency_ms"]], 50),
        "output_tokens": sum(r["output_tokens"] for r in ok), "successful": len(ok), "errors": errors,
        "runs": len(reports), "outputs": outputs,
    }


def _text(output: str | None) -> str | None:
    # A last incomplete character (decoded as U+FFFD) is not compared: transformers serve streams through
    # tokenizers' DecodeStream, which holds back the bytes of an unfinished character and never sends them when
    # the request ends, so its text drops what hf-pipeline serve (and decoding the tokens) ends with. Random-
    # weight models end a fixed-length completion mid-character often (1 in 32 of the decode-heavy prompts).
    return None if output is None else output.rstrip("\ufffd")


def _equal(a: dict, b: dict) -> int:
    return sum(1 for prompt, text in a["outputs"].items() if _text(b["outputs"].get(prompt)) == _text(text))


def ratios(rows: dict[str, dict]) -> dict[str, Any]:
    """The served pipeline against the limit and against one transformers process at one concurrency
    (output tokens/s; time to first token p50, above 1 a longer wait), and its greedy outputs equal to the
    one process's; a ratio whose contender did not run is absent."""
    served, one, limit = rows.get("served", {}), rows.get("one_process", {}), rows.get("limit", {})
    out: dict[str, Any] = {}
    if "output_tokens_per_s" in served and "output_tokens_per_s" in one:
        out["served_vs_one_process"] = served["output_tokens_per_s"] / one["output_tokens_per_s"]
        if served["ttft_p50_ms"] and one["ttft_p50_ms"]:
            out["ttft_p50_served_vs_one_process"] = served["ttft_p50_ms"] / one["ttft_p50_ms"]
        out["outputs_equal_one_process"] = _equal(served, one)
    if "output_tokens_per_s" in served and "output_tokens_per_s" in limit:
        out["served_vs_limit"] = served["output_tokens_per_s"] / limit["output_tokens_per_s"]
    replicas = rows.get("replicas", {})
    if "output_tokens_per_s" in replicas and "output_tokens_per_s" in one:
        out["replicas_vs_one_process"] = replicas["output_tokens_per_s"] / one["output_tokens_per_s"]
        out["replicas_outputs_equal_one_process"] = _equal(replicas, one)
        if "output_tokens_per_s" in limit:
            out["replicas_vs_limit"] = replicas["output_tokens_per_s"] / limit["output_tokens_per_s"]
    if "output_tokens_per_s" in one and "output_tokens_per_s" in limit:
        out["limit_vs_one_process"] = limit["output_tokens_per_s"] / one["output_tokens_per_s"]
    return out
