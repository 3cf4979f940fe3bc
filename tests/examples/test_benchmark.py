"""``python -m benchmarks`` at tiny size (``--quick``), so it cannot rot: every section runs and reports."""

import dataclasses
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time

import pytest
import torch

from benchmarks.checkpoints import write_random_checkpoint
from benchmarks.config import COMPILED, MEASURED, SECTIONS, is_fixed
from benchmarks.report import readme_tables, to_markdown
from benchmarks.run import merge
from devtools.llama import llama_config

# pytest.approx's default (1e-6 relative) checks the report's derived figures against its own numbers: float64
# rounding only; a wrong formula (a missing factor or term) moves a figure by 1e-2 or more.
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_random_checkpoint_is_a_real_sharded_checkpoint(tmp_path):
    import transformers

    cfg = llama_config(
        hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=128, max_pos=64, dtype="bfloat16"
    )
    path = write_random_checkpoint(tmp_path / "ck", cfg, shard_bytes=12_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert (
        float(model.model.norm.weight.detach().float().mean()) == 1.0
        and 0.01 < float(model.lm_head.weight.detach().float().std()) < 0.03
    )
    # a complete directory is a cache: not rewritten
    stamp = (path / shards[0]).stat().st_mtime_ns
    write_random_checkpoint(path, cfg, shard_bytes=12_000)
    assert (path / shards[0]).stat().st_mtime_ns == stamp


def test_partial_rerun_replaces_only_its_sections():
    old = {
        "load": {"x": 1},
        "train": {"y": 2},
        "generate": {"z": 3},
        "command": "full",
        "quick": False,
        "sizes": {},
        "errors": [],
    }
    new = {
        "generate": {"z": 4},
        "command": "rerun",
        "date": "d",
        "seconds": 5,
        "quick": False,
        "sizes": {},
        "errors": [],
        "machine": {},
    }
    merged = merge(old, new, ["generate"])
    assert merged["load"] == {"x": 1} and merged["train"] == {"y": 2} and merged["generate"] == {"z": 4}
    assert merged["runs"][-1]["sections"] == ["generate"]


def test_report_tables_are_data_rendered_once():
    # Each section builds its tables as data; one renderer writes every table of results.md and the
    # README block: a blank cell (None) as "| |", an empty string as "|  |", as the f-strings did.
    from benchmarks.tables import Table, render

    table = Table(["ranks", "peak", "read"])
    table.add("2", "error: out of memory", None)
    table.add("4", "", "1.00x")
    assert render(["Load:", "", table, ""]) == (
        "Load:\n\n| ranks | peak | read |\n|---|---|---|\n| 2 | error: out of memory | |\n| 4 |  | 1.00x |\n"
    )


def test_serve_stream_is_seeded_and_wrong_tokens_are_errors():
    # The serve section's stream is the same for every contender (one seed), and its results turn a
    # contender's wrong tokens or token counts into errors, so no speed figure stands for them.
    from benchmarks.config import Sizes
    from benchmarks.serve import CONTENDERS, request_stream
    from benchmarks.serve_results import summarize

    sizes = Sizes.quick()
    sz = dataclasses.asdict(sizes)
    stream = request_stream(sz)
    assert stream == request_stream(sz) and stream != request_stream(sz, seed=1)
    assert [r["arrival"] for r in stream] == sorted(r["arrival"] for r in stream) and stream[0]["arrival"] == 0
    lo, hi = sizes.serve_new_tokens
    assert all(lo <= r["max_new_tokens"] <= hi and r["prompt"] for r in stream)

    def records(shift: float, wrong: int | None = None) -> list[dict]:
        return [{"arrival": r["arrival"], "first": r["arrival"] + shift, "done": r["arrival"] + 2 * shift,
                 "tokens": [7 if i == wrong else 5] * r["max_new_tokens"]} for i, r in enumerate(stream)]

    def find_with(by_label: dict[str, list[dict]]):
        return lambda world, label: [{"ok": True, "wall_seconds": 1.0, "records": by_label[label]}]

    good = {label: records(0.1 * (k + 1)) for k, label in enumerate(CONTENDERS.values())}
    res = summarize(sizes, find_with(good))
    assert not res["mismatches"] and res["requested_tokens"] == sum(r["max_new_tokens"] for r in stream)
    rows = res["contenders"]
    assert rows["static"]["latency_p50_vs_served"] == pytest.approx(2.0)  # twice the served pipeline's waits
    assert rows["static"]["tokens_equal_served"] == len(stream)
    bad = dict(good, **{CONTENDERS["hf_continuous"]: records(0.3, wrong=1)})
    want = f"{CONTENDERS['hf_continuous']}: greedy tokens differ from the served pipeline's in 1 of {len(stream)}"
    assert summarize(sizes, find_with(bad))["mismatches"] == [want + " requests"]
    short = dict(good, **{CONTENDERS["static"]: [dict(r, tokens=r["tokens"][1:]) for r in good[CONTENDERS["static"]]]})
    assert any("token counts" in m for m in summarize(sizes, find_with(short))["mismatches"])
    native = dict(good, **{CONTENDERS["hf_native_pp"]: records(0.4, wrong=0)})  # reported, not required
    res = summarize(sizes, find_with(native))
    assert not res["mismatches"] and res["contenders"]["hf_native_pp"]["tokens_equal_served"] == len(stream) - 1


def test_serve_capacity_ratios_are_of_paired_medians_and_wrong_tokens_are_errors():
    # The capacity table: tokens/s over each contender's median turn, ratios against one process and the
    # 2-way limit, and a contender whose tokens differ from one process's is an error (no speed figure stands).
    from benchmarks.config import Sizes
    from benchmarks.serve_capacity import CONTENDERS, markdown, summarize
    from benchmarks.tables import render

    sizes = Sizes.quick()
    tokens = [[5, 6], [7]]
    seconds = {"served": [2.0, 1.0, 9.0], "replicas": [3.0, 3.0, 3.0], "one_process": [4.0, 4.0, 4.0],
               "limit": [1.0, 2.0, 2.0]}

    def find_with(toks: dict):
        # per turn, per rank: the served ring's seconds (rank 1 waited 3 s of 10 over the turns)
        times = [[{"decode": 2.0, "prefill": 1.0, "wait": 0.0, "total": 4.0},
                  {"decode": 2.0, "prefill": 1.0, "wait": 1.0, "total": 4.0}],
                 [{"decode": 4.0, "prefill": 1.0, "wait": 0.5, "total": 6.0},
                  {"decode": 2.0, "prefill": 0.0, "wait": 2.0, "total": 6.0}]]
        result = {"ok": True, "wall_seconds": 1.0, "seconds": seconds, "generated": 12, "tokens": toks,
                  "ring_times": times}
        return lambda world, label: [result, {"ok": True, "wall_seconds": 1.0}]

    res = summarize(sizes, find_with({k: tokens for k in CONTENDERS}), ["tiny"])
    assert not res["mismatches"]
    rows = res["models"]["tiny"]["contenders"]
    assert res["models"]["tiny"]["repeats"] == 3
    assert rows["served"]["tokens_per_s"] == pytest.approx(6.0)  # 12 tokens over the median turn, 2 s
    assert rows["served"]["vs_one_process"] == pytest.approx(2.0) and rows["served"]["vs_limit"] == pytest.approx(1.0)
    assert rows["limit"]["vs_one_process"] == pytest.approx(2.0) and rows["served"]["tokens_equal_one_process"] == 2
    text = render(markdown({"world": 2, "capacity": res}))
    assert rows["served"]["ring_shares"][1] == pytest.approx({"decode": 0.4, "prefill": 0.1, "wait": 0.3, "other": 0.2})
    assert (f"| tiny | {CONTENDERS['served']} | 2 | 6.0 | 2.00x | 1.00x | 2.00, 1.00, 9.00 | 2 / 2 | rank 0: 60 / 20 / "
            "5%; rank 1: 40 / 10 / 30% |") in text
    assert f"| tiny | {CONTENDERS['limit']} | 2 | 6.0 | 2.00x | 1.00x | 1.00, 2.00, 2.00 | 2 / 2 | |" in text
    assert f"| tiny | {CONTENDERS['replicas']} | 2 | 4.0 | 1.33x | 0.67x | 3.00, 3.00, 3.00 | 2 / 2 | |" in text
    for key in ("served", "replicas"):
        bad = summarize(sizes, find_with({k: [[5, 6], [8]] if k == key else tokens for k in CONTENDERS}), ["tiny"])
        assert bad["mismatches"] == [f"serve capacity, tiny, {CONTENDERS[key]}: greedy tokens differ from one "
                                     "process's in 1 of 2 requests"]
    failed = summarize(sizes, lambda world, label: [{"ok": False, "error": "RuntimeError: x"}], ["tiny"])
    assert failed == {"models": {"tiny": {"error": "RuntimeError: x"}}, "mismatches": []}
    assert "| tiny | all | | did not run: RuntimeError: x |" in render(markdown({"world": 2, "capacity": failed}))


def _guidellm_report(rps: float, tps: float, requests: list[tuple[str, str, float, float]], errored: int = 0) -> dict:
    """A guidellm JSON report as ``guidellm run --output kind=json`` writes it (the fields the section reads):
    its mean rates, and per successful request (prompt, output text, TTFT ms, ITL ms)."""
    ok = [{"request_args": json.dumps({"body": {"prompt": p, "max_tokens": 4}}), "output": o,
           "time_to_first_token_ms": ttft, "inter_token_latency_ms": itl, "output_tokens": 4}
          for p, o, ttft, itl in requests]
    return {"benchmarks": [{
        "metrics": {"requests_per_second": {"successful": {"mean": rps}},
                    "output_tokens_per_second": {"successful": {"mean": tps}}},
        "requests": {"successful": ok, "errored": [{}] * errored, "incomplete": [], "total": None}}]}


def test_serve_http_figures_come_from_guidellm_reports():
    # The limit sums two side-by-side runs' rates and takes latency percentiles over both runs' requests;
    # errors are errored + incomplete requests; the ratios and the tables come from those rows.
    from benchmarks.serve_http_results import contender_row, ratios
    from benchmarks.serve_http_tables import markdown, readme
    from benchmarks.tables import render

    served = contender_row([_guidellm_report(4.0, 16.0, [("a", "x", 10, 2), ("b", "y", 30, 4)])])
    one = contender_row([_guidellm_report(2.0, 8.0, [("a", "x", 20, 3), ("b", "z", 40, 5)], errored=1)])
    limit = contender_row([_guidellm_report(1.5, 6.0, [("a", "x", 10, 1)]),
                           _guidellm_report(1.0, 4.0, [("b", "z", 50, 3)])])
    assert limit["output_tokens_per_s"] == 10.0 and limit["requests_per_s"] == 2.5 and limit["runs"] == 2
    assert limit["ttft_p50_ms"] == pytest.approx(30.0) and limit["itl_p50_ms"] == pytest.approx(2.0)
    assert limit["ttft_p90_ms"] == pytest.approx(46.0)  # numpy's linear percentile of (10, 50)
    assert one["errors"] == 1 and one["successful"] == 2 and served["errors"] == 0
    replicas = contender_row([_guidellm_report(3.0, 12.0, [("a", "x", 10, 2), ("b", "z", 30, 4)])])
    r = ratios({"served": served, "replicas": replicas, "one_process": one, "limit": limit})
    assert r["replicas_vs_one_process"] == pytest.approx(1.5) and r["replicas_vs_limit"] == pytest.approx(1.2)
    assert r["replicas_outputs_equal_one_process"] == 2
    assert r["served_vs_limit"] == pytest.approx(1.6) and r["served_vs_one_process"] == pytest.approx(2.0)
    assert r["limit_vs_one_process"] == pytest.approx(1.25)
    assert r["ttft_p50_served_vs_one_process"] == pytest.approx(2 / 3)
    assert r["outputs_equal_one_process"] == 1  # "b": "y" against "z"
    # transformers serve never streams a last incomplete character (U+FFFD once decoded); one in the middle counts.
    tail = contender_row([_guidellm_report(4.0, 16.0, [("a", "x\ufffd", 10, 2), ("b", "\ufffdy", 30, 4)])])
    assert ratios({"served": tail, "one_process": one})["outputs_equal_one_process"] == 1
    skipped = {"skipped": "concurrency 1 cannot be split over 2 processes"}
    assert ratios({"served": served, "one_process": one, "limit": skipped}).keys() == {
        "served_vs_one_process", "ttft_p50_served_vs_one_process", "outputs_equal_one_process"}
    res = {"serve_http": {"world": 2, "device": "cpu", "prompt_tokens": 8, "output_tokens": 4, "example_command": "g",
                          "models": {"tiny": {"path": "p", "requests": {"1": 2, "8": 2}, "concurrency": {
                              "1": {"contenders": {"served": served, "one_process": one, "limit": skipped},
                                    "ratios": ratios({"served": served, "one_process": one})},
                              "8": {"contenders": {"served": served, "replicas": replicas, "one_process": one,
                                                   "limit": limit},
                                    "ratios": r}}}}}}
    md = render(markdown(res))
    assert "| tiny | 8 | 1.60x | 2.00x | 1.25x | 0.67x | 1 / 2 | 1.50x | 2 / 2 |" in md
    assert "| tiny | 1 | 2-way limit: 2 transformers processes, half the requests each | concurrency 1 cannot" in md
    assert "| tiny | 8 | 16.0 | 8.0 | 10.0 | 1.60x | 2.00x | 0.67x | 1.50x |" in render(readme(res))
    assert "~2x one process" in md and markdown({}) == readme({}) == []


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def _ratio(x, world: int) -> bool:
    """A speed ratio of ``world`` ranks against one process: finite, positive, and not beyond what
    ``world`` times the compute could give (doubled: one timed repetition on a shared machine)."""
    return isinstance(x, float) and math.isfinite(x) and 1e-3 < x < 2 * world


def _check_serve(serve: dict, sizes: dict) -> None:
    """The serve section: every contender served the whole stream, its figures derived from its own
    requests' times, and its greedy tokens those of the served pipeline where they must be."""
    from benchmarks.serve import request_stream

    stream = request_stream(sizes)
    assert serve["requests"] == len(stream) == sizes["serve_requests"] and not serve["mismatches"]
    assert serve["requested_tokens"] == sum(r["max_new_tokens"] for r in stream)
    assert set(serve["contenders"]) == {"served", "static", "served_v", "hf_continuous", "hf_native_pp"}, serve
    for key, row in serve["contenders"].items():
        assert "error" not in row, (key, row)
        assert row["tokens"] == serve["requested_tokens"] and len(row["latencies"]) == len(stream), key
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"]), key
        assert 0 < row["latency_p50"] <= row["latency_p99"] <= max(row["latencies"]) + 1e-9, key
        assert row["seconds"] >= stream[-1]["arrival"], key  # the last request is served after it arrived
        assert row["throughput_vs_served"] == pytest.approx(
            row["tokens_per_s"] / serve["contenders"]["served"]["tokens_per_s"]), key
    for key in ("served", "static", "served_v", "hf_continuous"):
        assert serve["contenders"][key]["tokens_equal_served"] == len(stream), key
    assert serve["contenders"]["hf_continuous"]["batching"] == "continuous"


@pytest.mark.dist
@pytest.mark.slow
def test_quick_benchmark_runs_every_section(tmp_path):
    # The default --out: a quick run must leave the committed bench_results/ alone.
    committed = _files(ROOT / "bench_results")
    assert "results.json" in committed and "results.md" in committed
    out = ROOT / "bench_out" / "quick"
    # serve-http starts real servers and guidellm runs (minutes on a loaded 2-core machine): left out here, its
    # results and tables are checked in test_serve_http_figures_come_from_guidellm_reports; a named subset
    # merges into an earlier results.json, so that one goes first.
    (out / "results.json").unlink(missing_ok=True)
    started = time.time()
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "--quick",
        "--sections",
        ",".join(s for s in SECTIONS if s != "serve-http"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--timeout",
        "240",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    after = _files(ROOT / "bench_results")
    changed = sorted(name for name in committed.keys() | after.keys() if committed.get(name) != after.get(name))
    assert not changed, f"a quick run with the default --out changed bench_results/: {changed}"
    assert (out / "results.json").is_file() and (out / "results.json").stat().st_mtime >= started, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert not res["errors"], res["errors"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for header in ("## Load", "## Train", "## Generate", "## Bubble", "## Activation checkpointing", "## LoRA",
                   "## Serve", "## Meshes"):
        assert header in md
    _check_serve(res["serve"], res["sizes"])
    meshes = {row["mesh"]: row for row in res["mesh"]["meshes"]}  # 4 ranks each; a refused mesh says why
    moe = {"moe pp4", "moe pp2 x ep2", "moe pp2 x tp2 x ep2", "moe pp1 x fsdp2 x ep2", "moe pp2 x dp2, ep2 over dp",
           "moe fsdp4, ep4 over fsdp"}
    assert set(meshes) == {"pp4", "pp2 x tp2", "pp2 x fsdp2"} | moe, meshes
    assert all("error" not in r and "refused" not in meshes[n] for n, r in meshes.items()), meshes
    for name in ("pp4", "pp2 x tp2"):
        ranks = meshes[name]["ranks"]
        assert len(ranks) == 4 and all(r["kept_bytes"] > 0 and min(r["step_seconds"]) > 0 for r in ranks), ranks
    # a pp2 x tp2 rank keeps half of its stage's sharded weights: less than the half of the model a pp2 rank would
    whole = sum(r["kept_bytes"] for r in meshes["pp4"]["ranks"])
    assert max(r["kept_bytes"] for r in meshes["pp2 x tp2"]["ranks"]) < whole / 2, (meshes, whole)
    assert "ranks" in meshes["pp2 x fsdp2"] or meshes["pp2 x fsdp2"]["refused"], meshes["pp2 x fsdp2"]
    # the mixture of experts: every mesh generates; an expert-parallel rank keeps and reads its experts only (a
    # pp2 x ep2 rank less than the pp4 model's half, the bytes it reads what it keeps: 1.00x of the stage's share)
    assert all(meshes[n]["generate_tokens_per_s"] > 0 for n in moe), meshes
    whole = sum(r["kept_bytes"] for r in meshes["moe pp4"]["ranks"])
    assert max(r["kept_bytes"] for r in meshes["moe pp2 x ep2"]["ranks"]) < whole / 2, (meshes, whole)
    assert all(r["bytes_read"] == r["kept_bytes"] for r in meshes["moe pp2 x ep2"]["ranks"]), meshes["moe pp2 x ep2"]
    # experts over the fsdp ranks: a quarter of the dense tensors and of the experts each, read alone
    over = meshes["moe fsdp4, ep4 over fsdp"]["ranks"]
    assert max(r["kept_bytes"] for r in over) < whole / 3, over
    assert all(r["bytes_read"] == r["kept_bytes"] for r in over), over
    ck = res["checkpointing"]
    assert ck["seq"] == res["sizes"]["ckpt_seq"] and len(ck["ranks"]) == res["sizes"]["world"], ck
    for row in ck["ranks"]:  # measured and predicted, both runs, every rank
        assert row["predicted_checkpointed_activations"] < row["predicted_activations"], row
        assert all(row[k] > 0 for k in ("plain_seconds", "checkpointed_seconds", "predicted_grads")), row
    lora = res["lora"]["ranks"]  # the LoRA section: per rank, the adapter trains far fewer parameters
    assert len(lora) == res["sizes"]["world"] and all(r["lora"]["trainable"] * 5 < r["full"]["trainable"] for r in lora)
    assert res["quick"] and "--quick" in res["command"] and res["machine"]["cores"] >= 1 and "torch" in res["machine"]
    sizes = res["sizes"]
    world, m = sizes["world"], sizes["n_microbatches"]

    load = res["load"]
    assert load["shards"] >= 4
    for p in ("1", "2"):
        row = load["by_world"][p]
        # every tensor is read exactly once over all ranks; transformers reads the whole model on each
        assert sum(row["ours_stage_bytes"]) == load["tensor_bytes"]
        assert row["bytes_read_over_checkpoint"] == pytest.approx(1.0)
        assert row["hf_bytes_read_over_checkpoint"] == pytest.approx(int(p))
        assert all(x > 0 for x in row["ours_peak_rss"] + row["hf_peak_rss"]) and row["peak_resettable"]
        # load time against plainly reading the same bytes, per rank, max over ranks
        assert all(math.isfinite(x) and x > 0 for x in row["load_seconds"] + row["read_seconds"])
        # each rank's ratio is the median of its interleaved (read, load) pairs' ratios; the row shows the worst rank's
        assert len(row["load_over_read_per_rank"]) == int(p) and all(
            math.isfinite(x) and x > 0 for x in row["load_over_read_per_rank"]
        )
        assert row["load_over_read"] == pytest.approx(max(row["load_over_read_per_rank"]))
        # where each rank's load went, by phase: every phase timed, the reading among them
        for phases in row["phases"]:
            assert {"headers", "read", "initialise missing, materialise"} <= set(phases) and all(
                v >= 0 for v in phases.values()
            )

    # the mixture of experts by mesh (ranks 1 and 2 in quick runs): every rank reads exactly the bytes it keeps (its
    # stages' tensors, its experts' share under ep), and its peak RSS is measured
    moe = {row["mesh"]: row for row in load["moe"]["meshes"]}
    assert set(moe) == {"pp1", "pp2", "pp1 x ep2"}, moe
    for name, row in moe.items():
        assert "error" not in row and len(row["ranks"]) == row["ranks_count"], (name, row)
        assert all(r["bytes_read"] == r["kept_bytes"] and r["peak_rss"] > 0 for r in row["ranks"]), (name, row)
    whole = moe["pp1"]["ranks"][0]["kept_bytes"]
    assert max(r["kept_bytes"] for r in moe["pp1 x ep2"]["ranks"]) < whole, moe  # half the experts each

    # Generate: every ratio is this run's pipelined figure over this run's baseline, tokens equal.
    gen = res["generate"]
    assert gen["pipelined"]["tokens_equal_transformers"] and gen["one_microbatch"]["tokens_equal_transformers"]
    assert gen["pipelined"]["n_microbatches"] == 2 and gen["one_microbatch"]["n_microbatches"] == 1
    assert (
        gen["more_microbatches"]["n_microbatches"] == world + 1
        and gen["more_microbatches"]["tokens_equal_transformers"]
    )
    # chunked prefill: transformers' chunked tokens, in as many prefill steps as chunks, paired with the 2-way limit
    ch = gen["chunked_prefill"]
    assert (
        ch["tokens_equal_transformers"] and ch["prefill_steps"] == -(-sizes["prompt_len"] // sizes["prefill_chunk"]) > 1
    )
    assert gen["pipelined"]["prefill_steps"] == 1
    # the V layout (2 stages per rank): one microbatch per rank, not per stage; tokens equal; paired with the limit
    v = gen["v_layout"]
    assert v["tokens_equal_transformers"] and v["n_microbatches"] == world, v
    one_stage = gen["pipelined"]["fraction_of_two_way"]
    assert gen["v_layout_vs_one_stage"] == pytest.approx(v["fraction_of_two_way"] / one_stage)
    assert len(ch["two_way_seconds"]) == len(ch["seconds"]) == sizes["gen_reps"]
    assert ch["fraction_of_two_way"] == pytest.approx(
        statistics.median([w / p for w, p in zip(ch["two_way_seconds"], ch["seconds"])])
    )
    pf = gen["prefill"]
    assert all(len(v) >= 3 and min(v) > 0 for v in pf["seconds"].values()), pf
    assert pf["pipelined_fill_theory"] == pytest.approx((2 + world - 1) / 2)
    assert pf["chunked_prefill_fill_theory"] == pytest.approx(
        (2 * ch["prefill_steps"] + world - 1) / (2 * ch["prefill_steps"])
    )
    assert "prefill_chunk_size=" in md
    tps = {k: gen[k]["tokens_per_s"] for k in ("baseline", "pipelined", "one_microbatch")}
    assert all(math.isfinite(v) and v > 0 for v in tps.values()), tps
    assert gen["speedup_vs_transformers"] == pytest.approx(tps["pipelined"] / tps["baseline"])
    assert gen["one_microbatch_vs_transformers"] == pytest.approx(tps["one_microbatch"] / tps["baseline"])
    assert gen["speedup_vs_one_microbatch"] == pytest.approx(tps["pipelined"] / tps["one_microbatch"])
    for key in ("speedup_vs_transformers", "one_microbatch_vs_transformers", "speedup_vs_one_microbatch"):
        assert _ratio(gen[key], world), (key, gen[key])
    assert all(0 <= v < 1 for v in gen["idle_fraction"].values()), gen["idle_fraction"]
    assert (out / "timelines" / "generate.png").is_file()
    bound = gen["bound"]  # the ring's ceiling on this machine, from transformers step times in the same run
    assert bound["microbatches"] == 2
    assert all(
        math.isfinite(bound[k]) and bound[k] > 0 for k in ("full_step_s", "stage_step_s", "concurrent_stage_step_s")
    )
    assert bound["speedup_bound"] == pytest.approx(bound["full_step_s"] / (2 * bound["stage_step_s"]))
    assert bound["concurrent_speedup_bound"] == pytest.approx(
        bound["full_step_s"] / (2 * bound["concurrent_stage_step_s"])
    )
    assert "No 2-stage ring with 2 microbatches can beat" in md
    # the bound's stages are the pipelined model's own split: every layer once, the LM head on the last rank
    assert len(bound["stage_parts"]) == len(bound["stage_steps_s"]) == world and bound["stage_step_s"] == max(
        bound["stage_steps_s"]
    )
    assert bound["stage_parts"][0].startswith("layers 0-") and bound["stage_parts"][-1].endswith(
        f"-{sizes['layers'] - 1} + LM head"
    )
    assert math.isfinite(bound["decode_token_s"]) and math.isfinite(bound["torch_ring_token_s"])
    # the message's hop and the ring it predicts: back to back plus one hop per rank
    assert 0 < bound["hop_s"] < 1 and bound["predicted_ring_token_s"] == pytest.approx(
        bound["back_to_back_token_s"] + world * bound["hop_s"]
    )
    assert "One hop of the ring's message" in md
    # per decoded token against the 2-way processes: the factors multiply up to the measured ratio (the
    # per-token times are differences of two calls' medians: in a tiny run they may be noise, even negative)
    f = bound["token_factors"]
    assert all(math.isfinite(v) for v in f.values()) and f["stages"] > 0 and f["pattern"] > 0, f
    assert f["stages"] * f["pattern"] * f["ours"] / f["generate_loop"] == pytest.approx(f["ring_over_two_way"])
    assert f["ring_over_two_way"] == pytest.approx(bound["decode_token_s"] / bound["two_way_token_s"])
    assert f["stages"] == pytest.approx(bound["back_to_back_token_s"] / bound["two_way_step_token_s"])
    # the 2-way limit: paired with the pipelined runs, one per timed run
    assert len(gen["two_way_seconds"]) == len(gen["pipelined"]["seconds"]) == sizes["gen_reps"]
    assert gen["fraction_of_two_way"] == pytest.approx(
        statistics.median([w / p for w, p in zip(gen["two_way_seconds"], gen["pipelined"]["seconds"])])
    )
    assert gen["two_way_speedup"] == pytest.approx(
        statistics.median(gen["baseline"]["seconds"]) / statistics.median(gen["two_way_seconds"])
    )
    assert _ratio(gen["two_way_speedup"], world) and _ratio(gen["fraction_of_two_way"], world)
    # the 2-way limit's own row, from the same paired calls; where each rank's pipelined call goes, in parts
    # of the call that never overlap (so they sum to at most the whole; "other" is the remainder)
    new_tokens = gen["pipelined"]["tokens_per_s"] * statistics.median(gen["pipelined"]["seconds"])
    assert gen["two_way"]["tokens_per_s"] == pytest.approx(new_tokens / statistics.median(gen["two_way_seconds"]))
    assert "2-way limit: 2 transformers processes" in md and "Where a pipelined call's time goes" in md
    for label in ("pipelined", "chunked_prefill"):
        splits = gen[label]["time_split"]
        assert len(splits) == world, splits
        for split in splits:
            assert set(split) == {"compute", "fill", "wait", "drain", "other"}, split
            assert all(v >= 0 for v in split.values()) and split["compute"] > 0, split
            assert sum(split.values()) == pytest.approx(1, abs=0.05), split  # medians of parts summing to 1

    # Train: each schedule's steps are paired with 2-way transformers steps run just before them, in its job.
    train = res["train"]
    assert train["tokens_per_step"] == sizes["batch"] * sizes["seq"]
    base = train["baseline"]
    assert base["tokens_per_s"] == pytest.approx(train["tokens_per_step"] / statistics.median(base["step_seconds"]))
    theory = {
        "gpipe": (world - 1) / (m + world - 1),
        "1f1b": (world - 1) / (m + world - 1),
        "interleaved-1f1b": (world - 1) / (2 * m + world - 1),
    }  # (p-1)/(v*m+p-1)
    assert set(theory) <= set(train["schedules"])
    # the microbatch cost: a rank's share of the batch (what each 2-way process trains in one piece) as the
    # pipeline's microbatches one after another, paired with the share in one piece; and the same on the whole batch
    cost = base["microbatch_cost"]
    assert len(base["share_microbatched_seconds"]) == len(base["share_step_seconds"]) == sizes["train_reps"]
    assert cost == pytest.approx(
        statistics.median([mb / s for mb, s in zip(base["share_microbatched_seconds"], base["share_step_seconds"])])
    )
    assert 0.2 < cost < 20, cost
    assert len(base["microbatched_seconds"]) == len(base["step_seconds"]) == sizes["train_reps"]
    assert base["whole_batch_microbatch_cost"] == pytest.approx(
        statistics.median([mb / s for mb, s in zip(base["microbatched_seconds"], base["step_seconds"])])
    )
    sb = base["split_backward"]  # the split backward against the full one, on one rank's layers
    assert all(
        math.isfinite(sb[k]) and sb[k] > 0
        for k in ("forward", "backward", "input", "weight", "torch_input", "torch_weight")
    )
    # The ratio's value is a timing (loose on a shared machine): only how it is derived is asserted.
    assert sb["split_over_full"] == pytest.approx((sb["input"] + sb["weight"]) / sb["backward"])
    assert sb["torch_split_over_full"] == pytest.approx((sb["torch_input"] + sb["torch_weight"]) / sb["backward"])
    assert sb["layers"] == sizes["layers"] // world and "stage_backward_input" in md
    limits = [w for row in train["schedules"].values() for w in row["two_way_seconds"]]
    assert train["two_way_speedup"] == pytest.approx(
        statistics.median(base["step_seconds"]) / statistics.median(limits)
    )
    assert train["perfect_overlap_speedup"] == pytest.approx(train["two_way_speedup"] / cost)
    micro_limits = [w for row in train["schedules"].values() for w in row["two_way_microbatched_seconds"]]
    assert train["microbatched_two_way_speedup"] == pytest.approx(
        statistics.median(base["step_seconds"]) / statistics.median(micro_limits)
    )
    assert "perfect overlap measured" in md and "= schedule" in md
    # every fixed schedule in one job, steps taking turns: ratios against 1F1B and the measured perfect overlap, per
    # round
    paired = train["paired"]
    fixed_names = [n for n in train["schedules"] if n not in ("auto", "gpipe") and not n.endswith(MEASURED)]
    assert (
        list(paired["schedules"]) == fixed_names and len(paired["two_way_microbatched_seconds"]) == sizes["train_reps"]
    )
    for name, row in paired["schedules"].items():
        assert len(row["step_seconds"]) == sizes["train_reps"] and all(t > 0 for t in row["step_seconds"]), name
        assert row["vs_1f1b"] == pytest.approx(
            statistics.median([r / t for r, t in zip(paired["schedules"]["1f1b"]["step_seconds"], row["step_seconds"])])
        ), name
        assert row["fraction_of_microbatched_two_way"] == pytest.approx(
            statistics.median([w / t for w, t in zip(paired["two_way_microbatched_seconds"], row["step_seconds"])])
        ), name
    assert paired["schedules"]["1f1b"]["vs_1f1b"] == 1.0 and "tokens/s vs 1F1B, paired" in md
    # beside each, torch's own pipeline on the same split: the same loss on the same weights (a missing
    # layer, mask or head would move it by far more than the microbatches' summation order), steps paired
    # the default (nothing named) and 1F1B compiled, paired with 1F1B: they have no torch-only twin
    assert {"default", "1f1b" + COMPILED} <= set(paired["schedules"])
    for name, row in paired["schedules"].items():
        if not is_fixed(name):
            assert row["torch_only"] == {"error": "no torch-only twin: not a fixed schedule"}, name
            continue
        theirs = row["torch_only"]
        assert len(theirs["step_seconds"]) == sizes["train_reps"] and all(t > 0 for t in theirs["step_seconds"]), name
        assert theirs["vs_torch_only"] == pytest.approx(
            statistics.median([t / o for t, o in zip(theirs["step_seconds"], row["step_seconds"])])
        ), name
        assert len(theirs["losses"]) == sizes["train_reps"] + 1, name
        for ours, torch_only in theirs["losses"]:
            # fp32 losses of two runs of the same model: summation order ~1e-6 relative; a wrong step
            # moves them by 1e-2 or more.
            assert torch_only == pytest.approx(ours, rel=1e-5), name
    assert "hf_pipeline's tokens/s over torch's own, paired" in md
    # schedule="auto": measured beside the fixed choices, against the best of them
    auto = train["schedules"]["auto"]
    assert set(auto["picked"]) == {"schedule", "virtual_stages", "n_microbatches"}
    best = max(row["tokens_per_s"] for name, row in train["schedules"].items() if is_fixed(name))
    assert train["auto_vs_best_fixed"] == pytest.approx(auto["tokens_per_s"] / best)
    # a schedule loaded again with the split model.measure_split() advised, against its planned split
    measured = train["schedules"]["zbv-zero-bubble" + MEASURED]
    ms = measured["measured_split"]
    assert ms["planned"] == train["schedules"]["zbv-zero-bubble"]["split"] and measured["split"] == ms["split"]
    # The head's measured cost is a difference of two stages' medians: in the tiny run its LM head is
    # a few microseconds and the difference may round to 0 (never below: fit_stage_costs clamps it);
    # the fit itself is held exactly in tests/tools/test_split_advice.py.
    assert set(ms["head_blocks"]) == set(ms["head_blocks_by_flops"]) == {"lm_head"}
    assert math.isfinite(ms["head_blocks"]["lm_head"]) and ms["head_blocks"]["lm_head"] >= 0
    assert ms["head_blocks_by_flops"]["lm_head"] > 0
    assert len(ms["planned_step_seconds"]) == len(measured["step_seconds"]) == sizes["train_reps"]  # paired in its job
    assert measured["vs_planned_split"] == pytest.approx(
        statistics.median([p / m for p, m in zip(ms["planned_step_seconds"], measured["step_seconds"])])
    )
    assert "`model.measure_split(batch)` on the planned split" in md
    assert f"auto: {auto['picked']['schedule']}, m={auto['picked']['n_microbatches']}" in md
    default = train["schedules"]["default"]["picked"]
    assert f"default: {default['schedule']}, m={default['n_microbatches']}" in md
    for name, row in train["schedules"].items():
        steps, two_way = row["step_seconds"], row["two_way_seconds"]
        assert len(steps) == len(two_way) == sizes["train_reps"], name
        assert all(math.isfinite(t) and t > 0 for t in steps + two_way), name
        assert row["fraction_of_two_way"] == pytest.approx(
            statistics.median([w / s for w, s in zip(two_way, steps)])
        ), name
        assert row["fraction_of_perfect_overlap"] == pytest.approx(row["fraction_of_two_way"] * cost), name
        assert row["tokens_per_s"] == pytest.approx(train["tokens_per_step"] / statistics.median(steps)), name
        assert row["speedup_vs_separate_baseline"] == pytest.approx(row["tokens_per_s"] / base["tokens_per_s"]), name
        assert _ratio(row["speedup_vs_separate_baseline"], world) and _ratio(row["fraction_of_two_way"], world), name
        assert all(row["order_matches_schedule"].values()), name
        assert row["profiled_steps"] == 1 and row["profiled_step"] == 0, (
            name
        )  # --quick profiles one step (full runs: 3, the median shown)
        assert all(0 <= v < 1 for v in row["idle_fraction"].values()), name
        assert all(0 < row["busy_seconds"][r] <= row["profiled_wall_seconds"][r] for r in row["busy_seconds"]), name
        if name in theory:
            assert row["theoretical_idle_fraction"] == pytest.approx(theory[name]), name
        # where the step goes: factors whose product is the median step over the median 2-way step
        gap = row["gap"]
        assert gap["compute"] * gap["imbalance"] * gap["bubble"] * gap["rest"] == pytest.approx(
            statistics.median(steps) / statistics.median(two_way)
        ), name
        busy = list(row["busy_seconds"].values())
        assert gap["imbalance"] == pytest.approx(max(busy) / statistics.mean(busy)) and gap["imbalance"] >= 1, name
        assert gap["bubble"] >= 1 and gap["compute"] > 0, name
        # the split factors: compute = microbatches (measured 2-way, microbatched / in one piece) x stages;
        # bubble = the schedule's order with free messages (the replay) x the waits beyond it
        micro = row["two_way_microbatched_seconds"]
        assert len(micro) == sizes["train_reps"] and all(math.isfinite(t) and t > 0 for t in micro), name
        assert gap["microbatches"] == pytest.approx(statistics.median(micro) / statistics.median(two_way)), name
        assert gap["microbatches"] * gap["stages"] == pytest.approx(gap["compute"]), name
        bd = row["breakdown"]  # the profiled step's Timeline.breakdown, with the measured hop
        assert bd["busy_seconds"] == busy and bd["wall_seconds"] == max(row["profiled_wall_seconds"].values()), name
        assert gap["schedule"] == pytest.approx(bd["replayed_seconds"] / max(busy)) and gap["schedule"] >= 1 - 1e-9, (
            name
        )
        assert gap["schedule"] * gap["waits"] == pytest.approx(gap["bubble"]), name
        assert 0 < row["activation_hop_s"] < 1 and bd["latency"] == row["activation_hop_s"], name
        assert bd["replayed_with_latency_seconds"] > bd["replayed_seconds"], name
        assert gap["messages"] * gap["runtime"] == pytest.approx(gap["waits"]) and gap["messages"] > 1, name
        assert row["fraction_of_microbatched_two_way"] == pytest.approx(
            statistics.median([w / s for w, s in zip(micro, steps)])
        ), name
        assert (out / "timelines" / f"train-{name}.png").is_file() and (
            out / "timelines" / f"train-{name}.trace.json"
        ).is_file()


def test_readme_tables_are_the_committed_results():
    # README's benchmark block is generated from bench_results/results.json; a new run that was not
    # written back (python -m benchmarks --update-readme) fails here instead of leaving stale figures.
    res = json.loads((ROOT / "bench_results" / "results.json").read_text())
    block = readme_tables(res)
    readme = (ROOT / "README.md").read_text()
    assert block in readme, (
        "README.md's benchmark tables differ from bench_results/results.json: "
        "run python -m benchmarks --update-readme"
    )
    assert res["sizes"]["layers"] >= 12 and not res.get("quick")  # the committed results are a full run


def test_committed_results_md_renders_results_json_with_each_section_once():
    res = json.loads((ROOT / "bench_results" / "results.json").read_text())
    md = to_markdown(res)
    headers = [line for line in md.splitlines() if line.startswith("## ")]
    assert len(headers) == len(set(headers)), f"a section is rendered twice: {headers}"
    assert {"## Load: per-rank memory and bytes read", "## Bubble: measured idle fraction per rank vs theory"} <= set(
        headers
    )
    assert (ROOT / "bench_results" / "results.md").read_text() == md, (
        "bench_results/results.md differs from bench_results/results.json: "
        "run python -m benchmarks --update-readme"
    )
