"""Train section, results side: the per-rank results summed up (``results.json``'s ``train``).

Its tables are in :mod:`benchmarks.train_tables`.
"""

from __future__ import annotations

from typing import Any

from benchmarks.config import SCHEDULES, Sizes, is_fixed
from benchmarks.timing import median

__all__ = ["gap", "summarize"]


def _ratios(over: list[float], under: list[float]) -> float:
    """The median of the paired ratios ``over[i] / under[i]``."""
    return median([a / b for a, b in zip(over, under)])


def _baseline(base: dict, tokens: int) -> dict[str, Any]:
    """The transformers process: tokens/s, the cost of small microbatches, the split backward's cost."""
    # The cost of small microbatches on one process, median over back-to-back pairs: on one
    # rank's share of the batch, the size each 2-way process trains in one piece (what perfect
    # overlap pays), and on the whole batch (for reference: on a machine where a batch of the
    # share's size runs faster per row than the whole one, it understates the cost).
    sb = base["split_backward"]
    return {
        "step_seconds": base["step_seconds"], "tokens_per_s": tokens / median(base["step_seconds"]),
        "share_step_seconds": base["share_step_seconds"],
        "share_microbatched_seconds": base["share_microbatched_seconds"],
        "microbatch_cost": _ratios(base["share_microbatched_seconds"], base["share_step_seconds"]),
        "microbatched_seconds": base["microbatched_seconds"],
        "whole_batch_microbatch_cost": _ratios(base["microbatched_seconds"], base["step_seconds"]),
        "split_backward": {**sb, "split_over_full": (sb["input"] + sb["weight"]) / sb["backward"],
                           "torch_split_over_full": (sb["torch_input"] + sb["torch_weight"]) / sb["backward"]},
    }


def gap(r0: dict, world: int) -> dict[str, float]:
    """Where a schedule's step goes against the 2-way limit, as factors whose product is the median
    step over the median 2-way step: the ranks' compute over the 2-way processes' compute (``compute``:
    small microbatches, per-stage work, the split backward), the busiest rank over the mean
    (``imbalance``), the profiled step over the busiest rank's compute (``bubble``: its idle), and the
    timed step over the profiled one (``rest``: messages and the step's own work, and noise).

    Two factors are split further (their products are the factors above): ``compute`` into
    ``microbatches`` (the 2-way processes running their shares as the pipeline's microbatches, over
    in one piece, both measured in the job: small matmuls with every core busy) and ``stages`` (the
    rest: the stages' own work, the split backward); ``bubble`` into ``schedule`` (the profiled
    step replayed with free messages over the busiest rank's compute: the idle the schedule's order
    leaves with these action times, :meth:`~hf_pipeline.tools.profile.Timeline.replayed_seconds`) and
    ``waits`` (the profiled step over its replay: P2P latency and the runtime between actions)."""
    bd = r0["breakdown"]  # Timeline.breakdown of the profiled step
    two_way, step = median(r0["two_way_seconds"]), median(r0["step_seconds"])
    factors = {"compute": sum(bd["busy_seconds"]) / (world * two_way), "rest": step / bd["wall_seconds"]}
    factors.update({k: bd[k] for k in ("imbalance", "bubble", "schedule", "waits", "messages", "runtime")})
    factors["microbatches"] = median(r0["two_way_microbatched_seconds"]) / two_way
    factors["stages"] = factors["compute"] / factors["microbatches"]
    return factors


def _schedule_row(r0: dict, v, tokens: int, baseline: dict | None, micro_cost: float | None,
                  world: int) -> dict[str, Any]:
    """One schedule's figures from rank 0's ``train_pp`` result."""
    tps = tokens / median(r0["step_seconds"])
    two_way = r0["two_way_seconds"]
    # median over steps of (2-way step / pipelined step), each pair run back to back
    of_two_way = _ratios(two_way, r0["step_seconds"])
    micro_way = r0.get("two_way_microbatched_seconds") or []
    row = {
        "virtual_stages": v, "step_seconds": r0["step_seconds"], "tokens_per_s": tps, "two_way_seconds": two_way,
        "speedup_vs_separate_baseline": tps / baseline["tokens_per_s"] if baseline else None,
        "fraction_of_two_way": of_two_way,
        # perfect overlap = the 2-way limit paid the microbatch cost: 2-way time x cost
        "fraction_of_perfect_overlap": of_two_way * micro_cost if micro_cost else None,
        # perfect overlap measured: the 2-way processes running the pipeline's microbatches
        "two_way_microbatched_seconds": micro_way,
        "fraction_of_microbatched_two_way": _ratios(micro_way, r0["step_seconds"]) if micro_way else None,
        "breakdown": r0["breakdown"], "activation_hop_s": r0["activation_hop_s"],
        "idle_fraction": r0["idle_fraction"], "theoretical_idle_fraction": r0["theoretical_idle_fraction"],
        "order_matches_schedule": r0["order_matches"], "busy_seconds": r0["busy_seconds"],
        "profiled_steps": r0["profiled_steps"], "profiled_step": r0["profiled_step"],
        "profiled_step_walls": r0["profiled_step_walls"],
        "profiled_wall_seconds": r0["profiled_wall_seconds"], "picked": r0["picked"],
        "gap": gap(r0, world), "split": r0["split"],
    }
    if "measured_split" in r0:
        row["measured_split"] = r0["measured_split"]
    return row


def _paired(paired: dict) -> dict[str, Any]:
    """The fixed schedules' steps taking turns: each against 1F1B, the measured perfect overlap, torch's own
    pipeline."""
    if not paired.get("ok"):
        return {"error": paired.get("error", "not run")}
    ref = paired["step_seconds"]["1f1b"]
    limit = paired["two_way_microbatched_seconds"]
    rows = {
        name: {
            "step_seconds": ts,
            "vs_1f1b": _ratios(ref, ts),  # tokens/s over 1F1B's, per round
            "fraction_of_microbatched_two_way": _ratios(limit, ts),
        }
        for name, ts in paired["step_seconds"].items()
    }
    for name, row in rows.items():
        if name in paired["torch_only_step_seconds"]:
            theirs = paired["torch_only_step_seconds"][name]
            row["torch_only"] = {
                "step_seconds": theirs,
                "vs_torch_only": _ratios(theirs, row["step_seconds"]),  # our tokens/s over theirs, per round
                "losses": paired["torch_only_losses"][name],  # (ours, torch-only) per step, the same weights and batch
            }
        else:
            row["torch_only"] = {"error": paired["torch_only_errors"].get(name, "not run")}
    return {"two_way_microbatched_seconds": limit, "schedules": rows}


def _compare_choices(train: dict) -> None:
    """``auto`` against the best fixed choice of the same run (tokens/s); each measured split against its
    planned one."""
    schedules = train["schedules"]
    fixed = [row for name, row in schedules.items() if is_fixed(name) and "error" not in row]
    if "auto" in schedules and "error" not in schedules["auto"] and fixed:
        train["auto_vs_best_fixed"] = schedules["auto"]["tokens_per_s"] / max(row["tokens_per_s"] for row in fixed)
    for row in schedules.values():  # a measured split against the planned one: steps paired in its job
        if "measured_split" in row:
            row["vs_planned_split"] = _ratios(row["measured_split"]["planned_step_seconds"], row["step_seconds"])


def summarize(sizes: Sizes, find) -> dict[str, Any]:
    """``results.json``'s ``train``: the baseline, each schedule's row, the paired job, the machine's limits.

    ``find(world, label)`` returns every rank's result of the task ``label`` in the launch of ``world``.
    """
    base = find(1, "train transformers")[0]
    tokens = sizes.batch * sizes.seq
    train: dict[str, Any] = {"tokens_per_step": tokens, "baseline": None, "schedules": {}}
    micro_cost = None
    if base.get("ok"):
        train["baseline"] = _baseline(base, tokens)
        micro_cost = train["baseline"]["microbatch_cost"]
    limits, micro_limits = [], []
    for name, v in SCHEDULES:
        r0 = find(sizes.world, f"train {name}")[0]
        if not r0.get("ok"):
            train["schedules"][name] = {"virtual_stages": v, "error": r0["error"]}
            continue
        row = _schedule_row(r0, v, tokens, train["baseline"], micro_cost, sizes.world)
        limits.extend(row["two_way_seconds"])
        micro_limits.extend(row["two_way_microbatched_seconds"])
        train["schedules"][name] = row
    _compare_choices(train)
    train["paired"] = _paired(find(sizes.world, "train paired")[0])
    if train["baseline"] and limits:
        # Over every schedule's job: the 2-way limit and perfect overlap against the separate process.
        train["two_way_speedup"] = median(base["step_seconds"]) / median(limits)
        train["perfect_overlap_speedup"] = train["two_way_speedup"] / micro_cost
        if micro_limits:
            train["microbatched_two_way_speedup"] = median(base["step_seconds"]) / median(micro_limits)
    return train
