"""Load section's tables: results.md's load section, README's load table."""

from __future__ import annotations

from typing import Any

from benchmarks.tables import Table, gb

__all__ = ["markdown", "readme"]


def _memory_table(ld: dict) -> Table:
    table = Table([
        "ranks", "hf_pipeline peak RSS per rank", "stage bytes per rank", "peak / stage bytes (max)",
        "bytes read, all ranks / checkpoint", "transformers peak RSS per rank",
        "transformers bytes, all ranks / checkpoint",
    ])
    for p, row in ld["by_world"].items():
        if "error" in row:
            table.add(p, f"error: {row['error']}", None, None, None, None, None)
            continue
        table.add(
            p, ", ".join(gb(x) for x in row["ours_peak_rss"]), ", ".join(gb(x) for x in row["ours_stage_bytes"]),
            f"{row['peak_over_stage']:.2f}x (target <= 1.25x)",
            f"{row['bytes_read_over_checkpoint']:.2f}x (target <= 1.1x)",
            ", ".join(gb(x) for x in row["hf_peak_rss"]), f"{row['hf_bytes_read_over_checkpoint']:.2f}x",
        )
    return table


def _moe_table(moe: dict) -> Table:
    table = Table(["mesh", "ranks", "kept per rank", "bytes read per rank", "peak RSS per rank",
                   "peak / kept (max)", "bytes read / kept (max)"])
    for row in moe["meshes"]:
        if "error" in row:
            table.add(row["mesh"], row["ranks_count"], f"error: {row['error'][:160]}", None, None, None, None)
            continue
        ranks = row["ranks"]
        table.add(row["mesh"], row["ranks_count"], ", ".join(gb(r["kept_bytes"]) for r in ranks),
                  ", ".join(gb(r["bytes_read"]) for r in ranks), ", ".join(gb(r["peak_rss"]) for r in ranks),
                  f"{row['peak_over_kept']:.2f}x (target <= 1.05x)", f"{row['read_over_kept']:.2f}x")
    return table


def _moe_blocks(res: dict[str, Any]) -> list:
    """results.md's mixture-of-experts load table (results from before it was measured have none)."""
    moe, s = res["load"].get("moe"), res["sizes"]
    if not moe:
        return []
    return [
        "",
        f"A mixture of experts as transformers saves it (Mixtral, hidden {s['hidden']}, {s['layers']} layers, "
        f"{s['moe_experts']} experts of {s['moe_intermediate']}, fp32; {gb(moe['tensor_bytes'])}; experts one "
        "tensor each, merged at load into transformers' stacked `gate_up_proj` / `down_proj`), loaded by mesh: "
        "each rank's peak RSS (as above) against the parameter bytes it keeps (its experts' share under ep), "
        "and the bytes it read.",
        "",
        _moe_table(moe),
    ]


def _seconds(xs) -> str:
    return ", ".join("-" if x is None else f"{x:.2f}" for x in xs)


def _time_table(ld: dict) -> Table:
    table = Table([
        "ranks", "load (s)", "plain read (s)", "load / read, warm (max)", "cold load (s)", "cold read (s)",
        "load / read, cold (max)",
    ])
    for p, row in ld["by_world"].items():
        if "error" in row or "load_seconds" not in row:
            continue
        cold = f"{row['cold_load_over_read']:.2f}x" if row.get("cold_load_over_read") else "not measured"
        table.add(p, _seconds(row["load_seconds"]), _seconds(row["read_seconds"]), f"{row['load_over_read']:.2f}x",
                  _seconds(row["cold_load_seconds"]), _seconds(row["cold_read_seconds"]), cold)
    return table


def markdown(res: dict[str, Any]) -> list:
    """results.md's load section: memory and bytes read, then load time against a plain read."""
    ld, s = res["load"], res["sizes"]
    blocks: list = [
        "## Load: per-rank memory and bytes read",
        "",
        f"LLaMA-architecture checkpoint, random bf16 weights: hidden {s['load_hidden']}, {s['load_layers']} layers, "
        "vocab "
        f"{s['load_vocab']}; {gb(ld['checkpoint_bytes'])} in {ld['shards']} safetensors shards. Peak RSS = the OS's "
        "high-water mark (VmHWM, reset before each load) minus the RSS just before loading; it includes the pages of "
        "the shard being read. Baseline: `transformers.AutoModelForCausalLM.from_pretrained` on every rank (what "
        "accelerate's `prepare_pippy` needs).",
        "",
        _memory_table(ld),
        "",
        "Load wall time per rank against plainly reading the same byte ranges of the same files into fresh memory "
        "(anonymous mappings, faulted in by the read as new tensors are), in the same process, every rank at once: "
        "warm = pages in the OS cache (medians of 7 interleaved read/load pairs, which of the two goes first "
        "alternating; the ratio is the median of the pairs' ratios, the worst rank's shown), cold = page cache dropped "
        "just before each read and each load (where the machine allows it; medians of 5 pairs, likewise). "
        "Target <= 1.2x.",
        "",
        _time_table(ld),
    ]
    timed = [(p, row) for p, row in ld["by_world"].items() if "error" not in row and row.get("phases")]
    if timed:
        blocks += ["", "Where a load's time goes (rank 0's first load, seconds): " + "; ".join(
            f"{p} ranks: " + ", ".join(f"{k} {v:.2f}" for k, v in row["phases"][0].items()) for p, row in timed) + "."]
    worlds = [(p, row) for p, row in ld["by_world"].items() if "error" not in row and int(p) > 1]
    if worlds:
        blocks += ["", f"Whole checkpoint: {gb(ld['checkpoint_bytes'])}. Largest per-rank peak RSS: " + "; ".join(
            f"{p} ranks {gb(max(row['ours_peak_rss']))} (transformers {gb(max(row['hf_peak_rss']))})"
            for p, row in worlds) + "."]
    return blocks + _moe_blocks(res) + [""]


def readme(res: dict[str, Any]) -> list:
    """README's load table: memory, bytes read and load time, as ratios."""
    ld = res["load"]
    table = Table([
        "ranks", "peak RSS / stage bytes", "bytes read / checkpoint", "transformers on every rank: bytes read",
        "load time / plain read, warm", "cold",
    ])
    for p, row in ld["by_world"].items():
        if "error" in row:
            continue
        cold = f"{row['cold_load_over_read']:.2f}x" if row.get("cold_load_over_read") else "-"
        warm = f"{row['load_over_read']:.2f}x" if "load_over_read" in row else "-"
        table.add(p, f"{row['peak_over_stage']:.2f}x", f"{row['bytes_read_over_checkpoint']:.2f}x",
                  f"{row['hf_bytes_read_over_checkpoint']:.2f}x", warm, cold)
    blocks = [f"Load ({gb(ld['checkpoint_bytes'])} bf16 LLaMA in {ld['shards']} shards):", "", table, ""]
    if ld.get("moe"):
        moe = Table(["mesh", "peak RSS / kept", "bytes read / kept"])
        for row in ld["moe"]["meshes"]:
            moe.add(row["mesh"], *((None, None) if "error" in row else (
                f"{row['peak_over_kept']:.2f}x", f"{row['read_over_kept']:.2f}x")))
        blocks += [f"Load, a Mixtral of {res['sizes']['moe_experts']} experts stored one tensor each "
                   f"({gb(ld['moe']['tensor_bytes'])}), by mesh:", "", moe, ""]
    return blocks
