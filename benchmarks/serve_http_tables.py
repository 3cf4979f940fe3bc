"""Serve-http section, tables side: guidellm's figures for the served pipeline, one transformers process and
the machine's 2-way limit, per model and concurrency (results.md), and the headline ratios (README)."""

from __future__ import annotations

from typing import Any

from benchmarks.tables import Table

__all__ = ["GPU_NOTE", "markdown", "readme"]

NAMES = {
    "served": "hf-pipeline serve, {world} ranks",
    "replicas": "hf-pipeline serve, {world} ranks as {world} replicas (--num-stages 1)",
    "one_process": "transformers serve --continuous-batching, 1 process",
    "limit": "2-way limit: 2 transformers processes, half the requests each",
}
CONTENDER_ORDER = ("served", "one_process", "limit")
GPU_NOTE = (
    "On a GPU host (one device per stage) the 2-way limit is ~2x one process; the served pipeline should "
    "reach >= 0.95x of it at concurrency 8 on the decode-heavy model. On a CPU the two processes share the "
    "memory bandwidth that bounds decode, so the limit is small."
)


def _f(v: float | None, fmt: str = "{:.1f}") -> str | None:
    return None if v is None else fmt.format(v)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _table(sh: dict) -> Table:
    t = Table(["model", "concurrency", "contender", "output tokens/s", "requests/s", "TTFT p50", "TTFT p90",
               "ITL p50", "errors", "requests"])
    for name, m in sh["models"].items():
        for c, per in m["concurrency"].items():
            for key, row in per["contenders"].items():
                label = NAMES[key].format(world=sh["world"])
                if "output_tokens_per_s" not in row:
                    t.add(name, c, label, row.get("skipped") or f"did not run: {row.get('error')}", None, None, None,
                          None, None, None)
                    continue
                t.add(name, c, label, _f(row["output_tokens_per_s"]), _f(row["requests_per_s"], "{:.2f}"),
                      _f(row["ttft_p50_ms"], "{:.0f} ms"), _f(row["ttft_p90_ms"], "{:.0f} ms"),
                      _f(row["itl_p50_ms"], "{:.1f} ms"), str(row["errors"]), str(row["successful"] + row["errors"]))
    return t


def _ratios(sh: dict) -> Table:
    t = Table(["model", "concurrency", "served / limit", "served / one process", "limit / one process",
               "TTFT p50 served / one process", "outputs equal one process", "replicas / one process",
               "replicas' outputs equal"])
    for name, m in sh["models"].items():
        for c, per in m["concurrency"].items():
            r = per["ratios"]
            equal, twin = r.get("outputs_equal_one_process"), r.get("replicas_outputs_equal_one_process")
            t.add(name, c, _x(r.get("served_vs_limit")), _x(r.get("served_vs_one_process")),
                  _x(r.get("limit_vs_one_process")), _x(r.get("ttft_p50_served_vs_one_process")),
                  "-" if equal is None else f"{equal} / {m['requests'][c]}", _x(r.get("replicas_vs_one_process")),
                  "-" if twin is None else f"{twin} / {m['requests'][c]}")
    return t


def markdown(res: dict[str, Any]) -> list:
    sh = res.get("serve_http")
    if not sh:
        return []
    return [
        "## Serve over HTTP: guidellm against the served pipeline, one transformers process and the 2-way limit", "",
        f"`guidellm run` (its CLI, concurrent profile, completions endpoint, offline) sends each contender the same "
        f"prompts (~{sh['prompt_tokens']} tokens, seeded), greedy, exactly {sh['output_tokens']} output tokens each "
        "(each server's own no-EOS field: transformers serve refuses guidellm's `ignore_eos`). Every server runs "
        "1 thread per process on 127.0.0.1 and gets one warm-up request. The limit: two independent transformers "
        "processes, each sent half the requests at half the concurrency at once (two guidellm runs side by side); "
        "throughput summed, latency percentiles over both runs' requests; not measured at an odd concurrency. "
        "Throughput: guidellm's mean output tokens/s and requests/s. TTFT: time to first token; ITL: inter-token "
        f"latency. One run, e.g.: `{sh['example_command']}`.", "",
        _table(sh), "", "Ratios (output tokens/s; TTFT above 1 is a longer wait):", "", _ratios(sh), "",
        GPU_NOTE, "",
    ]


def readme(res: dict[str, Any]) -> list:
    sh = res.get("serve_http")
    if not sh:
        return []
    t = Table(["model", "concurrency", "served tokens/s", "1 process", "2-way limit", "served / limit",
               "served / 1 process", "TTFT p50 served / 1 process", "replicas / 1 process"])
    for name, m in sh["models"].items():
        for c, per in m["concurrency"].items():
            rows, r = per["contenders"], per["ratios"]
            t.add(name, c, *(_f(rows.get(k, {}).get("output_tokens_per_s")) or "-" for k in CONTENDER_ORDER),
                  _x(r.get("served_vs_limit")), _x(r.get("served_vs_one_process")),
                  _x(r.get("ttft_p50_served_vs_one_process")), _x(r.get("replicas_vs_one_process")))
    return [f"Serving over HTTP, measured by guidellm (`--sections serve-http`; {sh['world']} ranks against "
            "`transformers serve --continuous-batching`, 1 thread per process). " + GPU_NOTE, "", t, ""]

