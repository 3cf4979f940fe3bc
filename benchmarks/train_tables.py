"""Train and bubble sections' tables: results.md's train and bubble sections, README's train table."""

from __future__ import annotations

from typing import Any

from benchmarks.tables import Table, pct
from benchmarks.timing import median

__all__ = ["bubble_markdown", "markdown", "readme"]


def _intro(s: dict) -> list:
    return [
        "## Train: tokens/s against one transformers process, and against the machine's limit",
        "",
        f"LLaMA hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads ({s.get('kv_heads', s['heads'])} "
        "key/value), vocab "
        f"{s['vocab']}, seq {s['seq']}, global batch {s['batch']}, {s['n_microbatches']} microbatches; forward + "
        "backward of "
        f"the whole batch per step (medians of {s['train_reps']} steps after a warm-up). Pipelined: {s['world']} "
        "ranks x 1 "
        "thread. **vs transformers**: one transformers process (1 thread, the whole batch), run on its own. References "
        f"measured in the same run: the **2-way limit** ({s['world']} independent transformers processes at once, each "
        "training on its share of the batch, run right before each pipelined step in the same job), the **microbatch "
        "cost** (one process running one rank's share of the batch, what each 2-way process trains in one piece, as "
        "the "
        "pipeline's microbatches one after another, over that share in one piece, alternating), and **perfect "
        "overlap** = "
        "2-way limit / microbatch cost: what a pipeline with no bubble and free communication reaches at this "
        "microbatch "
        "size. Fractions are medians over back-to-back pairs.",
        "",
    ]


def _limits(tr: dict, base: dict, s: dict) -> list:
    """The machine's limits: the 2-way limit, the microbatch cost, perfect overlap (computed and measured)."""
    if not (base and tr.get("two_way_speedup")):
        return []
    whole = (f" (on the whole batch, against the whole batch in one piece: {base['whole_batch_microbatch_cost']:.2f}x)"
             if "whole_batch_microbatch_cost" in base else "")
    measured = ""
    if tr.get("microbatched_two_way_speedup"):
        measured = (f"; perfect overlap measured ({s['world']} processes at once, each running its share as the "
                    f"pipeline's microbatches): **{tr['microbatched_two_way_speedup']:.2f}x**")
    return [
        f"2-way limit: **{tr['two_way_speedup']:.2f}x**; microbatch cost: {base['microbatch_cost']:.2f}x" + whole
        + f"; perfect overlap: **{tr['perfect_overlap_speedup']:.2f}x**" + measured + ".",
        "",
    ]


def _schedules_table(tr: dict, base: dict | None) -> Table:
    table = Table([
        "schedule", "stages per rank", "step (s)", "vs transformers", "fraction of perfect overlap",
        "fraction of perfect overlap, measured", "fraction of the 2-way limit",
    ])
    if base:
        table.add("transformers, one process", "-", f"{median(base['step_seconds']):.3f}", "1.00x", "-", "-", "-")
    for name, row in tr["schedules"].items():
        if "error" in row:
            table.add(name, str(row["virtual_stages"]), f"error: {row['error'][:200]}", None, None, None, None)
            continue
        sep = f"**{row['speedup_vs_separate_baseline']:.2f}x**" if row.get("speedup_vs_separate_baseline") else "-"
        label = name
        if name in ("auto", "default") and row.get("picked"):
            label = f"{name}: {row['picked']['schedule']}, m={row['picked']['n_microbatches']}"
        stages = row["picked"]["virtual_stages"] if row.get("picked") else row["virtual_stages"]
        table.add(label, str(stages), f"{median(row['step_seconds']):.3f}", sep,
                  pct(row.get("fraction_of_perfect_overlap")), pct(row.get("fraction_of_microbatched_two_way")),
                  pct(row.get("fraction_of_two_way")))
    return table


def _paired(pr: dict) -> list:
    """The fixed schedules' steps taking turns, each beside torch's own pipeline."""
    if "schedules" not in pr:
        return ["", f"Schedules paired in one job: error: {pr['error'][:200]}"] if "error" in pr else []
    table = Table([
        "schedule", "step (s)", "tokens/s vs 1F1B, paired", "fraction of perfect overlap, measured, paired",
        "torch's own pipeline: step (s)", "hf_pipeline's tokens/s over torch's own, paired",
        "loss: hf_pipeline, torch's own",
    ])
    for name, row in pr["schedules"].items():
        to = row.get("torch_only", {})
        if "step_seconds" in to:
            worst = max(to["losses"], key=lambda pair: abs(pair[0] - pair[1]))
            theirs = [f"{median(to['step_seconds']):.3f}", f"**{pct(to['vs_torch_only'])}**",
                      f"{worst[0]:.6f}, {worst[1]:.6f}"]
        else:
            theirs = ["-", to.get("error", "not run")[:120], "-"]
        table.add(name, f"{median(row['step_seconds']):.3f}", pct(row["vs_1f1b"]),
                  pct(row["fraction_of_microbatched_two_way"]), *theirs)
    return [
        "", "The fixed schedules again, all loaded in one job and their steps taking turns (each round: the "
        "microbatched 2-way step, then one step of each schedule; medians over the rounds of the per-round ratios): "
        "here each comparison is on the same seconds of the machine, where the rows above come from a job each. "
        "GPipe is left out: it alone keeps every microbatch's activations alive at once, and in a process shared "
        "with other models its step time swings by 2-3x. **torch's own pipeline**: the same split run without "
        "hf_pipeline (each stage a plain module over transformers' embedding, layers, norm and LM head, torch's "
        "`PipelineStage` and the schedule's torch class, for the zero-bubble schedules with torch's generic split "
        "backward), its step right after hf_pipeline's in each round; the loss columns are both pipelines' losses "
        "on the same weights and batch (the largest difference over the rounds).",
        "", table,
    ]


def _choices(tr: dict) -> list:
    """``auto`` against the best fixed choice; each measured split against its planned one."""
    blocks: list = []
    if tr.get("auto_vs_best_fixed"):
        blocks += ["", f"`schedule=\"auto\", n_microbatches=\"auto\"` (the cost model's pick at load) reaches "
                   f"**{pct(tr['auto_vs_best_fixed'])}** of the best fixed choice's tokens/s."]
    for name, row in tr["schedules"].items():
        ms = row.get("measured_split")
        if ms and row.get("vs_planned_split"):
            heads = "; ".join(f"{m} {b:.2f} blocks measured, {ms['head_blocks_by_flops'][m]:.2f} by FLOPs"
                              for m, b in ms["head_blocks"].items())
            blocks += ["", f"`{name}`: `model.measure_split(batch)` on the planned split {ms['planned']} measured "
                       f"the head and loss apart from the blocks ({heads}) and advised {ms['split']}"
                       + (" (the same split)" if ms["split"] == ms["planned"] else "")
                       + f"; loaded so, its tokens/s are **{pct(row['vs_planned_split'])}** of the planned split's "
                       "(both loaded in one job, their steps taking turns; median of the pairs' ratios)."]
    return blocks


_GAP_TEXT = (
    "Where each step goes against the 2-way limit (factors; their product is the step over the 2-way step): "
    "**compute** = all ranks' compute (forward, backward, weight-gradient and loss actions of the profiled step: "
    "the median by wall time of the schedule's 3 profiled steps) "
    "over {world} x the 2-way step (each 2-way process trains its share of the batch in one piece): what "
    "running the model in small microbatches and stages costs more. Of it, one process running a rank's share of the "
    "batch as the pipeline's microbatches, against that "
    "share in one piece, takes **{share}** (this machine's matmuls on smaller microbatches); the rest is the "
    "stages' own work (zero-bubble: the split backward). **imbalance** = the busiest rank's compute over the mean; "
    "**bubble** = the profiled step over the busiest rank's compute (its idle time); **rest** = the timed step over "
    "the profiled one (messages, the step's own work, noise). Two factors split further: compute = "
    "**microbatches** (the 2-way processes running their shares as the pipeline's microbatches over in one piece, "
    "both measured in the schedule's job: small matmuls with every core busy) x **stages** (the rest: the stages' "
    "own work, the split backward); bubble = **schedule** (the profiled step replayed with every action at its "
    "recorded time and free messages, over the busiest rank's compute: the idle the schedule's order leaves with "
    "these action times, `Timeline.replayed_seconds()`) x **waits** (the profiled step over its replay: P2P "
    "latency and the runtime between actions), and waits = **messages** (the replay with one measured hop of a "
    "microbatch's activations, nothing else running, on every dependency between ranks, over the replay without: "
    "this machine's message latency) x **runtime** (the profiled step over that replay: the time between actions "
    "that is not the message's flight)."
)
_GAP_COLUMNS = (
    "compute", "microbatches", "stages", "imbalance", "bubble", "schedule", "waits", "messages", "runtime", "rest")


def _gap_table(gaps: dict[str, dict]) -> Table:
    table = Table(["schedule", "compute", "= microbatches", "x stages", "imbalance", "bubble", "= schedule", "x waits",
                   "= messages", "x runtime", "rest", "step / 2-way step"])
    for name, gp in gaps.items():
        total = gp["compute"] * gp["imbalance"] * gp["bubble"] * gp["rest"]
        table.add(name, *(f"{gp[key]:.3f}" if key in gp else "-" for key in _GAP_COLUMNS), f"{total:.3f}")
    return table


def _split_backward(sb: dict) -> list:
    return [
        "",
        f"The zero-bubble schedules' split backward on this machine, apart from any pipeline (transformers' own "
        f"{sb['layers']} layers, one microbatch of {sb['rows']} rows, in the baseline's process; medians): forward "
        f"{sb['forward'] * 1e3:.1f} ms, full backward {sb['backward'] * 1e3:.1f} ms; hf_pipeline's split "
        f"(`weight_pass.py`: the linears' weight matmuls deferred to W) input pass {sb['input'] * 1e3:.1f} ms + weight "
        f"pass {sb['weight'] * 1e3:.1f} ms = **{sb['split_over_full']:.2f}x** the full backward; torch's generic split "
        f"(`stage_backward_input` / `stage_backward_weight`) {sb['torch_input'] * 1e3:.1f} + "
        f"{sb['torch_weight'] * 1e3:.1f} "
        f"ms = {sb['torch_split_over_full']:.2f}x. Part of the zero-bubble schedules' **stages** factor above is this "
        "price, paid for their smaller **schedule** bubble.",
    ]


def _gaps(tr: dict, base: dict | None, s: dict) -> list:
    """Where each step goes against the 2-way limit, the activation's hop, the split backward's cost."""
    gaps = {name: row["gap"] for name, row in tr["schedules"].items() if "gap" in row}
    if not gaps:
        return []
    share = f"{base['microbatch_cost']:.2f}x" if base else "-"
    blocks: list = ["", _GAP_TEXT.format(world=s["world"], share=share), "", _gap_table(gaps)]
    hops = [row["activation_hop_s"] for row in tr["schedules"].values() if row.get("activation_hop_s")]
    if hops:
        blocks += ["", "One hop of a microbatch's activations between ranks (measured in each schedule's job, "
                   f"nothing else running): {min(hops) * 1e3:.2f}-{max(hops) * 1e3:.2f} ms."]
    sb = (base or {}).get("split_backward")
    return blocks + (_split_backward(sb) if sb else [])


def markdown(res: dict[str, Any]) -> list:
    """results.md's train section."""
    tr, s = res["train"], res["sizes"]
    base = tr.get("baseline")
    return [
        *_intro(s), *_limits(tr, base, s), _schedules_table(tr, base), *_paired(tr.get("paired", {})),
        *_choices(tr), *_gaps(tr, base, s), "",
    ]


def bubble_markdown(res: dict[str, Any]) -> list:
    """results.md's bubble section: each schedule's measured idle per rank beside its theoretical bubble."""
    table = Table(["schedule", "idle per rank (measured)", "theoretical bubble", "action order = schedule"])
    for name, row in res["train"]["schedules"].items():
        if "error" in row:
            table.add(name, "error", None, None)
            continue
        idle = ", ".join(f"rank {k}: {pct(v)}" for k, v in sorted(row["idle_fraction"].items()))
        match = "yes" if all(row["order_matches_schedule"].values()) else "no"
        table.add(name, idle, pct(row["theoretical_idle_fraction"]), match)
    return [
        "## Bubble: measured idle fraction per rank vs theory",
        "",
        "Three profiled training steps per schedule (`model.profile()`), the median one by wall time shown: idle = 1 - "
        "busy / step wall time on that rank, "
        "busy = forward, backward, weight-gradient and loss actions. Theory: GPipe/1F1B (p-1)/(m+p-1), interleaved "
        "(p-1)/(v*m+p-1), ZB-H1 about a third of 1F1B's, ZBV about 0. The recorded action order is compared with the "
        "schedule's action list. Timelines: `timelines/train-<schedule>.png` and `.trace.json` (Perfetto / chrome://tracing).",
        "",
        table,
        "",
    ]


def readme(res: dict[str, Any]) -> list:
    """README's train table: each schedule against transformers and perfect overlap; the paired comparisons."""
    tr, s = res["train"], res["sizes"]
    head = (f"Train (LLaMA hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, seq {s['seq']}, "
            f"batch {s['batch']}, {s['n_microbatches']} microbatches, {s['world']} ranks)")
    if tr.get("two_way_speedup"):
        head += (f"; this machine's 2-way limit {tr['two_way_speedup']:.2f}x, microbatch cost "
                 f"{tr['baseline']['microbatch_cost']:.2f}x, perfect overlap {tr['perfect_overlap_speedup']:.2f}x")
    if tr.get("microbatched_two_way_speedup"):
        head += f", perfect overlap measured {tr['microbatched_two_way_speedup']:.2f}x"
    table = Table(["schedule", "vs transformers (own process)", "fraction of perfect overlap",
                   "fraction of perfect overlap, measured"])
    for name, row in tr["schedules"].items():
        if "error" in row:
            continue
        picked = row.get("picked") if name in ("auto", "default") else None
        label = f"{name} ({picked['schedule']}, m={picked['n_microbatches']})" if picked else name
        table.add(label, f"{row['speedup_vs_separate_baseline']:.2f}x", pct(row.get("fraction_of_perfect_overlap")),
                  pct(row.get("fraction_of_microbatched_two_way")))
    blocks: list = [head + ":", "", table]
    if "schedules" in tr.get("paired", {}):
        schedules = tr["paired"]["schedules"].items()
        vs = ", ".join(f"{name} {pct(row['vs_1f1b'])}" for name, row in schedules if name != "1f1b")
        text = (f"The fixed schedules, the default (nothing named) and 1F1B compiled loaded in one job, their steps "
                f"taking turns: tokens/s against 1F1B's {vs}.")
        theirs = ", ".join(f"{name} {pct(row['torch_only']['vs_torch_only'])}" for name, row in schedules
                           if "vs_torch_only" in row.get("torch_only", {}))
        if theirs:
            text += (f" hf_pipeline's tokens/s over torch's own pipeline on the same split (transformers' layers, "
                     f"torch's stages and schedule, no hf_pipeline), paired: {theirs}.")
        blocks += ["", text]
    return blocks + [""]
