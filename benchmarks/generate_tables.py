"""Generate section's tables: results.md's generate section, README's generate line."""

from __future__ import annotations

from typing import Any

from benchmarks.tables import Table, pct
from benchmarks.timing import median, share

__all__ = ["markdown", "readme"]


def _runs_table(g: dict, s: dict) -> Table:
    table = Table(["run", "microbatches", "seconds", "new tokens/s", "vs transformers", "tokens equal transformers"])
    b = g.get("baseline", {})
    if "tokens_per_s" in b:
        table.add("transformers generate, 1 process", "-", f"{median(b['seconds']):.2f}", f"{b['tokens_per_s']:.0f}",
                  "1.00x", "-")
    names = (("pipelined", "pipelined generate"),
             ("chunked_prefill",
              f"pipelined, prefill_chunk_size={s.get('prefill_chunk')} (tokens against transformers' chunked prefill)"),
             ("one_microbatch", "pipelined, n_microbatches=1"),
             ("more_microbatches", f"pipelined, n_microbatches={s['world'] + 1}"),
             ("compiled", "pipelined, compile=True (inductor, decode steps too; after the first call's compile)"),
             ("v_layout", "pipelined, loaded for zbv-zero-bubble (2 stages per rank in a V)"))
    for label, name in names:
        if label in g:
            r = g[label]
            vs = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if "tokens_per_s" in b else "-"
            table.add(name, str(r["n_microbatches"]), f"{median(r['seconds']):.2f}", f"{r['tokens_per_s']:.0f}", vs,
                      "yes" if r["tokens_equal_transformers"] else "no")
    if "two_way" in g:
        r = g["two_way"]
        vs = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if "tokens_per_s" in b else "-"
        each = s["prompts"] // s["world"]
        table.add(f"2-way limit: {s['world']} transformers processes at once, {each} prompts each "
                  "(each run right before a pipelined generate)", "-", f"{median(r['seconds']):.2f}",
                  f"{r['tokens_per_s']:.0f}", vs, "-")
    if "error" in g:
        table.add("pipelined generate", f"error: {g['error'][:200]}", None, None, None, None)
    return table


def _speedups(g: dict, s: dict) -> list:
    blocks: list = []
    if "speedup_vs_one_microbatch" in g:
        blocks += ["", f"Pipelined vs one microbatch: {g['speedup_vs_one_microbatch']:.2f}x."]
    if "speedup_vs_transformers" in g:
        blocks += ["", f"Pipelined vs transformers: **{g['speedup_vs_transformers']:.2f}x**."]
    if "two_way_speedup" in g:
        blocks += [
            "",
            f"2-way limit ({s['world']} independent transformers processes at once, each generating for its share of "
            "the "
            f"prompts, run right before each pipelined run): **{g['two_way_speedup']:.2f}x**; pipelined generate "
            "reaches "
            f"**{pct(g['fraction_of_two_way'])}** of it (median over back-to-back pairs).",
        ]
    return blocks


_PARTS = ("compute", "fill", "wait", "drain", "other")


def _breakdown(g: dict) -> list:
    """Where each rank's pipelined call goes (``GenerationStats.time_split``), as a share of the call."""
    rows = [(label, name) for label, name in (("pipelined", "pipelined"), ("chunked_prefill", "chunked prefill"))
            if "time_split" in g.get(label, {})]
    if not rows:
        return []
    table = Table(["run", "rank", *_PARTS])
    for label, name in rows:
        for rank, split in enumerate(g[label]["time_split"]):
            table.add(name, str(rank), *[pct(split.get(part, 0.0)) for part in _PARTS])
    return [
        "",
        "Where a pipelined call's time goes, per rank (share of the call, median of the timed runs): **compute** its "
        "stages' forwards (the 2-way processes' work, split in stages); waiting for a message while the pipe fills "
        "(**fill**: the prompt's steps and the first token's trip round the ring) and after it (**wait**: the hops "
        "and the stages' imbalance, on the ring's critical path with one microbatch per stage); **drain** the "
        "result's broadcast from the last stage; **other** the rest, Python: the call's checks, the ring's loop, "
        "choosing tokens, the caches' bookkeeping.",
        "",
        table,
    ]


def _prefill(g: dict, s: dict) -> list:
    if not ("prefill" in g and "fraction_of_two_way" in g.get("chunked_prefill", {})):
        return []
    pf, ch = g["prefill"], g["chunked_prefill"]
    med = {k: median(v) * 1e3 for k, v in pf["seconds"].items()}
    return [
        "",
        f"With `prefill_chunk_size={s['prefill_chunk']}` (transformers' chunked prefill: the {s['prompt_len']}-token "
        "prompts in "
        f"{ch['prefill_steps']} chunks, each microbatch's chunks following each other down the pipeline) pipelined "
        "generate "
        f"reaches **{pct(ch['fraction_of_two_way'])}** of the 2-way limit (its own back-to-back pairs). The prefill "
        "alone "
        f"(calls for one new token, medians): {med['pipelined']:.1f} ms pipelined, {med['chunked_prefill']:.1f} ms "
        "chunked, "
        f"{med['two_way']:.1f} ms for the 2-way processes; over theirs {pf['pipelined_over_two_way']:.2f}x and "
        f"{pf['chunked_prefill_over_two_way']:.2f}x, where a {s['world']}-stage pipeline's fill alone costs "
        f"{pf['pipelined_fill_theory']:.2f}x with {g['pipelined']['n_microbatches']} units of work per stage and "
        f"{pf['chunked_prefill_fill_theory']:.2f}x with {ch['n_microbatches'] * ch['prefill_steps']}.",
    ]


def _bound(g: dict, bd: dict, s: dict) -> list:
    stages = ", ".join(f"rank {r}: {what} {t * 1e3:.1f} ms"
                       for r, (what, t) in enumerate(zip(bd["stage_parts"], bd["stage_steps_s"])))
    blocks = [
        "",
        f"Bound on this machine, measured in the same run with transformers: one decode step of all {s['layers']} "
        "layers on "
        f"{s['prompts']} rows takes {bd['full_step_s'] * 1e3:.1f} ms; the pipelined model's stages, rebuilt from "
        f"transformers' layers with its split, on {-(-s['prompts'] // bd['microbatches'])} rows ({stages}; ranks in "
        "turn): "
        f"the slowest, run {bd['microbatches']}x per token = {bd['ring_step_s'] * 1e3:.1f} ms. No {s['world']}-stage "
        "ring with "
        f"{bd['microbatches']} microbatches can beat **{bd['speedup_bound']:.2f}x** here.",
    ]
    if "concurrent_stage_step_s" in bd:
        blocks += [
            "",
            "With every rank running its stage step at the same time (the cores share caches and memory bandwidth), "
            "the "
            f"slowest stage step takes {bd['concurrent_stage_step_s'] * 1e3:.1f} ms: bound "
            f"**{bd['concurrent_speedup_bound']:.2f}x**"
            + (f"; the measured ring reaches {g['speedup_vs_transformers'] / bd['concurrent_speedup_bound']:.0%} of it."
               if "speedup_vs_transformers" in g else "."),
        ]
    return blocks


def _torch_ring(bd: dict, s: dict) -> list:
    if "torch_ring_token_s" not in bd:
        return []
    per_token = bd.get("decode_token_s") if bd.get("decode_token_s", 0) > 0 else None  # tiny runs: noise
    ours = (f"; hf_pipeline's ring takes {per_token * 1e3:.1f} ms per token (the difference between calls for "
            f"{s['new_tokens']} and {s['new_tokens'] // 2} new tokens, per token: prefill excluded), "
            f"{bd['torch_ring_token_s'] / per_token:.0%} of that torch-only ring's speed." if per_token else ".")
    return [
        "",
        f"The ring's pattern built from transformers' own model and torch's P2P alone (no hf_pipeline: each rank runs "
        f"its stage's transformers layers as above on {bd['microbatches']} microbatches per token, waits for each "
        f"microbatch from the previous rank, sends it on with `isend`, receives posted ahead): "
        f"{bd['torch_ring_token_s'] * 1e3:.1f} ms per token, against {bd['back_to_back_token_s'] * 1e3:.1f} ms for the "
        f"same steps back to back without messages ({bd['back_to_back_token_s'] / bd['torch_ring_token_s']:.0%}): "
        f"the part of the gap that is the pattern on this machine, not hf_pipeline" + ours,
    ]


def _hop(bd: dict, s: dict) -> list:
    if "hop_s" not in bd:
        return []
    flight = share(bd["predicted_ring_token_s"] - bd["back_to_back_token_s"],
                   bd["torch_ring_token_s"] - bd["back_to_back_token_s"])
    return [
        "",
        f"One hop of the ring's message between ranks with nothing else running (`isend`, the receiver's posted "
        f"receive waited on; gloo here): **{bd['hop_s'] * 1e3:.2f} ms**. A token's cycle runs every stage once and "
        f"crosses all {s['world']} links, so with balanced stages the messages' flight adds {s['world']} hops per "
        "token to "
        f"the steps back to back: {bd['back_to_back_token_s'] * 1e3:.1f} + {s['world']} x {bd['hop_s'] * 1e3:.2f} = "
        f"{bd['predicted_ring_token_s'] * 1e3:.1f} ms per token, against {bd['torch_ring_token_s'] * 1e3:.1f} ms "
        "measured "
        f"for the torch-only ring: the flight is "
        f"{pct(flight)} "
        "of what the ring's pattern adds; the rest is lost around the hand-offs while both ranks compute, which "
        "this measurement does not split further.",
    ]


def _token_factors(bd: dict, s: dict) -> list:
    if not ("token_factors" in bd and bd.get("decode_token_s", 0) > 0 and bd.get("two_way_token_s", 0) > 0):
        return []
    f = bd["token_factors"]
    return [
        "",
        f"Per decoded token against the 2-way limit (prefill excluded: calls for {s['new_tokens']} and "
        f"{s['new_tokens'] // 2} new tokens, per token, on both sides): hf_pipeline's ring "
        f"{bd['decode_token_s'] * 1e3:.1f} ms, the 2-way processes' generate {bd['two_way_token_s'] * 1e3:.1f} ms "
        f"(the ring reaches **{pct(1 / f['ring_over_two_way'])}** of the 2-way limit per token). As factors of "
        f"the ring's token time over theirs: "
        f"**stages** {f['stages']:.3f} (each rank's {bd['microbatches']} stage steps back to back, "
        f"{bd['back_to_back_token_s'] * 1e3:.1f} ms, over transformers' whole model on a rank's share of the prompts, "
        f"{bd['two_way_step_token_s'] * 1e3:.1f} ms, both ranks at once: the split's imbalance and each stage's own "
        f"work) x **pattern** {f['pattern']:.3f} (the torch-only ring over the same steps back to back: torch's P2P "
        f"and this machine) x **hf_pipeline** {f['ours']:.3f} (its ring over the torch-only ring: its stage modules, "
        f"caches, sampling and loop) / **generate loop** {f['generate_loop']:.3f} (transformers' generate per token "
        f"over its model's step alone: the 2-way processes' own loop, logits processing and cache work) = "
        f"{f['ring_over_two_way']:.3f}.",
    ]


def markdown(res: dict[str, Any]) -> list:
    """results.md's generate section."""
    g, s = res["generate"], res["sizes"]
    blocks: list = [
        "## Generate: tokens/s against transformers and a one-microbatch pipeline",
        "",
        f"{s['prompts']} prompts x {s['prompt_len']} tokens, {s['new_tokens']} new tokens, greedy (median of "
        f"{s['gen_reps']} "
        f"runs after a warm-up); pipelined on {s['world']} ranks x 1 thread.",
        "",
        _runs_table(g, s),
        *_speedups(g, s),
        *_breakdown(g),
        *_prefill(g, s),
    ]
    if "speedup_bound" in g.get("bound", {}):
        bd = g["bound"]
        blocks += [*_bound(g, bd, s), *_torch_ring(bd, s), *_hop(bd, s), *_token_factors(bd, s)]
    return blocks + [""]


def readme(res: dict[str, Any]) -> list:
    """README's generate line: against transformers, the 2-way limit and torch's own ring."""
    g, s = res["generate"], res["sizes"]
    text = (f"Generate ({s['prompts']} prompts x {s['prompt_len']} tokens, {s['new_tokens']} new, greedy, "
            "tokens equal transformers'): ")
    text += f"{g['speedup_vs_transformers']:.2f}x of one transformers process"
    if "two_way_speedup" in g:
        text += f"; 2-way limit {g['two_way_speedup']:.2f}x, of which the ring reaches {pct(g['fraction_of_two_way'])}"
        if "fraction_of_two_way" in g.get("chunked_prefill", {}):
            chunked = pct(g["chunked_prefill"]["fraction_of_two_way"])
            text += f" ({chunked} with `prefill_chunk_size={s['prefill_chunk']}`)"
        if "compiled_vs_eager" in g:
            c = g["compiled"]
            equal = "equal" if c["tokens_equal_transformers"] else "NOT equal"
            text += (f"; `compile=True` {pct(c['fraction_of_two_way'])} ({g['compiled_vs_eager']:.2f}x eager's, "
                     f"paired; tokens {equal}; its first call, compiling, {c['first_seconds']:.0f} s)")
        if "v_layout_vs_one_stage" in g:
            v = g["v_layout"]
            equal = "equal" if v["tokens_equal_transformers"] else "NOT equal"
            text += (f"; loaded for zbv-zero-bubble (2 stages per rank in a V) {pct(v['fraction_of_two_way'])} "
                     f"({g['v_layout_vs_one_stage']:.2f}x one stage per rank, paired; tokens {equal})")
    bd = g.get("bound", {})
    if "torch_ring_token_s" in bd and bd.get("decode_token_s", 0) > 0:
        per_token = bd["decode_token_s"]
        text += (f". The same ring built from transformers' model and torch's P2P alone loses "
                 f"{1 - bd['back_to_back_token_s'] / bd['torch_ring_token_s']:.0%} against its steps back to back; "
                 f"hf_pipeline's ring runs at {bd['torch_ring_token_s'] / per_token:.0%} of that ring's speed")
    splits = g.get("pipelined", {}).get("time_split")
    if splits:
        parts = "; ".join(f"rank {r}: " + ", ".join(f"{part} {pct(split[part])}" for part in _PARTS)
                          for r, split in enumerate(splits))
        text += f". Where each rank's call goes ({parts})"
    return [text + ".", ""]
