"""Generate section, results side: the per-rank results summed up (``results.json``'s ``generate``).

Its tables are in :mod:`benchmarks.generate_tables`.
"""

from __future__ import annotations

from typing import Any

from benchmarks.config import Sizes
from benchmarks.timing import median

__all__ = ["RUNS", "summarize"]

# The pipelined runs, in the order of the job and of the tables.
RUNS = ("pipelined", "chunked_prefill", "one_microbatch", "more_microbatches", "compiled", "v_layout")


def _ratios(over: list[float], under: list[float]) -> float:
    """The median of the paired ratios ``over[i] / under[i]``."""
    return median([a / b for a, b in zip(over, under)])


def _bound(base: dict, pp: dict, world: int) -> dict[str, Any]:
    """The most a decode ring can gain on this machine, and where a decoded token's time goes."""
    bd = dict(base["bound"])
    bd["stage_parts"], bd["stage_steps_s"] = pp["stage_parts"], pp["stage_steps_s"]
    bd["stage_step_s"] = max(pp["stage_steps_s"])
    bd["ring_step_s"] = bd["microbatches"] * bd["stage_step_s"]
    bd["speedup_bound"] = bd["full_step_s"] / bd["ring_step_s"]
    bd["concurrent_stage_step_s"] = max(pp["concurrent_stage_steps_s"])
    bd["concurrent_speedup_bound"] = bd["full_step_s"] / (bd["microbatches"] * bd["concurrent_stage_step_s"])
    bd["back_to_back_token_s"] = pp["back_to_back_token_s"]
    bd["torch_ring_token_s"] = pp["torch_ring_token_s"]
    bd["hop_s"] = pp["hop_s"]
    # A token's cycle runs every stage once and crosses every link once: with balanced stages
    # the ring pays world hops per token beyond the same steps back to back.
    bd["predicted_ring_token_s"] = bd["back_to_back_token_s"] + world * pp["hop_s"]
    bd["decode_token_s"] = pp["decode_token_s"]
    # Per decoded token (prefill excluded), the ring against the 2-way limit's processes,
    # as factors whose product is the ring's token time over theirs: the model's steps
    # split into stages (``stages``: 2 stage steps per rank back to back over the whole
    # model's step on a rank's share, both ranks at once), the ring's pattern with torch's
    # P2P alone (``pattern``), hf_pipeline's ring over that torch-only ring (``ours``),
    # and transformers' generate loop's own work per token beyond its model step
    # (``generate_loop``, divided out: the 2-way processes pay it, the ring its own, in ``ours``).
    bd["two_way_token_s"], bd["two_way_step_token_s"] = pp["two_way_token_s"], pp["two_way_step_token_s"]
    bd["token_factors"] = {
        "stages": pp["back_to_back_token_s"] / pp["two_way_step_token_s"],
        "pattern": pp["torch_ring_token_s"] / pp["back_to_back_token_s"],
        "ours": pp["decode_token_s"] / pp["torch_ring_token_s"],
        "generate_loop": pp["two_way_token_s"] / pp["two_way_step_token_s"],
        "ring_over_two_way": pp["decode_token_s"] / pp["two_way_token_s"],
    }
    return bd


def _run_row(r: dict, want, base_ok: bool) -> dict[str, Any]:
    """One pipelined run: tokens/s, whether its tokens are ``want`` (transformers'), and its 2-way pairs."""
    row = {
        "seconds": r["seconds"], "tokens_per_s": r["new_tokens"] / median(r["seconds"]),
        "n_microbatches": r["n_microbatches"],
        "tokens_equal_transformers": base_ok and r["tokens"] == want, "prefill_steps": r["prefill_steps"],
    }
    if "first_seconds" in r:  # the warm-up call (for the compiled run: compiling each graph once)
        row["first_seconds"] = r["first_seconds"]
    if "time_split" in r:  # per rank: each part's median share of the call (GenerationStats.time_split)
        row["time_split"] = r["time_split"]
    if "two_way_seconds" in r:
        row["two_way_seconds"] = r["two_way_seconds"]
        row["fraction_of_two_way"] = _ratios(r["two_way_seconds"], r["seconds"])
    return row


def _prefill(gen: dict, ps: dict, world: int) -> dict[str, Any]:
    """The prefill alone: each pipelined prefill over the 2-way processes' (same pairs), and the fill's
    theory: units of work per stage u, p stages: (u + p - 1) / u of the work spread evenly."""
    units = {"pipelined": gen["pipelined"]["n_microbatches"],
             "chunked_prefill": gen["chunked_prefill"]["n_microbatches"] * gen["chunked_prefill"]["prefill_steps"]}
    return {
        "seconds": ps,
        **{f"{label}_over_two_way": _ratios(ps[label], ps["two_way"]) for label in units},
        **{f"{label}_fill_theory": (u + world - 1) / u for label, u in units.items()},
    }


def _pipelined(gen: dict, base: dict, pp: dict, world: int) -> None:
    """The pipelined job's figures into ``gen``: each run, the prefill, the idle, the ratios to the baselines."""
    for label in RUNS:
        # the chunked run against transformers' own chunked prefill, the others against its default
        want = base.get("chunked_tokens" if label == "chunked_prefill" else "tokens")
        gen[label] = _run_row(pp[label], want, bool(base.get("ok")))
    gen["prefill"] = _prefill(gen, pp["prefill_seconds"], world)
    gen["idle_fraction"] = pp["idle_fraction"]
    gen["two_way_seconds"] = pp["two_way_seconds"]
    # The 2-way limit as a run of its own: the processes' calls paired with the pipelined runs, all prompts' tokens.
    gen["two_way"] = {"seconds": pp["two_way_seconds"],
                      "tokens_per_s": pp["pipelined"]["new_tokens"] / median(pp["two_way_seconds"])}
    # median over runs of (2-way time / pipelined time), each pair run back to back
    gen["fraction_of_two_way"] = _ratios(pp["two_way_seconds"], pp["pipelined"]["seconds"])
    if base.get("ok"):
        gen["two_way_speedup"] = median(base["seconds"]) / median(pp["two_way_seconds"])
        gen["speedup_vs_transformers"] = gen["pipelined"]["tokens_per_s"] / gen["baseline"]["tokens_per_s"]
        gen["one_microbatch_vs_transformers"] = gen["one_microbatch"]["tokens_per_s"] / gen["baseline"]["tokens_per_s"]
    gen["speedup_vs_one_microbatch"] = gen["pipelined"]["tokens_per_s"] / gen["one_microbatch"]["tokens_per_s"]
    if "seconds" in gen.get("compiled", {}):  # compiled over eager, each next to its own 2-way run
        gen["compiled_vs_eager"] = gen["compiled"]["fraction_of_two_way"] / gen["pipelined"]["fraction_of_two_way"]
    if "seconds" in gen.get("v_layout", {}):  # two stages per rank in a V over one per rank, the same way
        gen["v_layout_vs_one_stage"] = gen["v_layout"]["fraction_of_two_way"] / gen["pipelined"]["fraction_of_two_way"]


def summarize(sizes: Sizes, find) -> dict[str, Any]:
    """``results.json``'s ``generate``: the baseline, the ring's bound, each pipelined run and the ratios.

    ``find(world, label)`` returns every rank's result of the task ``label`` in the launch of ``world``.
    """
    base, pp = find(1, "generate transformers")[0], find(sizes.world, "generate pipelined")[0]
    gen: dict[str, Any] = {}
    if base.get("ok"):
        gen["baseline"] = {"seconds": base["seconds"], "tokens_per_s": base["new_tokens"] / median(base["seconds"])}
        gen["bound"] = _bound(base, pp, sizes.world) if pp.get("ok") else dict(base["bound"])
    else:
        gen["baseline"] = {"error": base["error"]}
    if pp.get("ok"):
        _pipelined(gen, base, pp, sizes.world)
    else:
        gen["error"] = pp["error"]
    return gen
