"""The benchmark script at tiny size (``--quick``), so it cannot rot: every section runs and reports."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("hf_pipeline_benchmark", ROOT / "scripts" / "benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_random_checkpoint_is_a_real_sharded_checkpoint(tmp_path):
    import transformers

    bench = _bench()
    cfg = bench._llama_config(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=128, max_pos=64, dtype="bfloat16")
    path = bench.write_random_checkpoint(tmp_path / "ck", cfg, shard_bytes=12_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert float(model.model.norm.weight.detach().float().mean()) == 1.0 and 0.01 < float(model.lm_head.weight.detach().float().std()) < 0.03
    # a complete directory is a cache: not rewritten
    stamp = (path / shards[0]).stat().st_mtime_ns
    bench.write_random_checkpoint(path, cfg, shard_bytes=12_000)
    assert (path / shards[0]).stat().st_mtime_ns == stamp


def test_partial_rerun_replaces_only_its_sections():
    bench = _bench()
    old = {"load": {"x": 1}, "train": {"y": 2}, "generate": {"z": 3}, "command": "full", "quick": False, "sizes": {}, "errors": []}
    new = {"generate": {"z": 4}, "command": "rerun", "date": "d", "seconds": 5, "quick": False, "sizes": {}, "errors": [], "machine": {}}
    merged = bench._merge(old, new, ["generate"])
    assert merged["load"] == {"x": 1} and merged["train"] == {"y": 2} and merged["generate"] == {"z": 4}
    assert merged["runs"][-1]["sections"] == ["generate"]


def test_quick_benchmark_runs_every_section(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--quick", "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--timeout", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=str(ROOT))
    assert (out / "results.json").is_file(), proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    for header in ("## Load", "## Train", "## Generate", "## Bubble"):
        assert header in md
    assert res["quick"] and res["machine"]["cores"] >= 1 and "torch" in res["machine"]

    load = res["load"]
    assert load["shards"] >= 4
    for p in ("1", "2"):
        row = load["by_world"][p]
        # every tensor is read exactly once over all ranks; transformers reads the whole model on each
        assert sum(row["ours_stage_bytes"]) == load["tensor_bytes"]
        assert row["bytes_read_over_checkpoint"] == pytest.approx(1.0)
        assert row["hf_bytes_read_over_checkpoint"] == pytest.approx(int(p))
        assert all(x > 0 for x in row["ours_peak_rss"] + row["hf_peak_rss"]) and row["peak_resettable"]

    gen = res["generate"]
    assert gen["pipelined"]["tokens_equal_transformers"] and gen["one_microbatch"]["tokens_equal_transformers"]
    assert gen["pipelined"]["n_microbatches"] == 2 and gen["one_microbatch"]["n_microbatches"] == 1
    assert gen["speedup_vs_one_microbatch"] > 0 and gen["baseline"]["tokens_per_s"] > 0
    assert (out / "timelines" / "generate.png").is_file()
    bound = gen["bound"]  # the ring's ceiling on this machine, from transformers step times in the same run
    assert bound["microbatches"] == 2 and 0 < bound["stage_step_s"] and 0 < bound["concurrent_stage_step_s"]
    assert bound["speedup_bound"] == pytest.approx(bound["full_step_s"] / (2 * bound["stage_step_s"]))
    assert "No 2-stage ring with 2 microbatches can beat" in md

    train = res["train"]
    assert train["baseline"]["tokens_per_s"] > 0
    assert not res["errors"], res["errors"]
    for name, row in train["schedules"].items():
        assert row["speedup"] > 0, name
        assert all(row["order_matches_schedule"].values()), name
        assert all(0 <= v < 1 for v in row["idle_fraction"].values()), name
        assert (out / "timelines" / f"train-{name}.png").is_file() and (out / "timelines" / f"train-{name}.trace.json").is_file()
    assert proc.returncode == 0, proc.stderr[-3000:]
