"""``python -m devtools.device_check`` on CPU: the same sections a GPU run goes through, at tiny size.

Each run writes its JSON; the tests read the figures back (logits difference within the stated
tolerance, greedy tokens equal, stage bytes and bytes read equal to the plan, losses and gradients
equal to transformers) rather than trusting the exit status. One process (2 local stages), two
gloo ranks under ``torchrun``, a bf16 run with a failure injected into one section, and the
watchdog of the time budget.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from harness import free_port

from devtools.device_check.run import Run
from devtools.device_check.support import first_divergences

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = ("env", "checkpoint", "load", "reference", "forward", "generate", "train")
TINY_PARAMS = 3_410_176  # --size tiny: hidden 256, 4 layers, vocab 2048, untied


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", HF_PIPELINE_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
    )
    env.pop("OUT", None)
    return env


def _run(cmd: list[str], out: pathlib.Path, *, expect_rc: int = 0) -> dict:
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == expect_rc, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    )
    assert out.is_file(), f"no JSON written:\n{proc.stdout[-4000:]}"
    result = json.loads(out.read_text())
    result["_stdout"] = proc.stdout
    return result


def _script(tmp_path: pathlib.Path, *extra: str) -> tuple[list[str], pathlib.Path]:
    out = tmp_path / "device_check.json"
    return ["-m", "devtools.device_check", "--device", "cpu", "--size", "tiny", "--out", str(out), *extra], out


def _assert_all_ok(result: dict) -> None:
    secs = result["sections"]
    assert set(secs) == set(SECTIONS)
    for name, sec in secs.items():
        why = sec.get("errors") or sec.get("reason") or sec["checks"]
        assert sec["status"] == "ok", f"{name}: {sec.get('status')} {why}"
        for key, check in sec["checks"].items():
            assert check["passed"], f"{name}.{key}: {check}"
    assert result["ok"] is True and not result.get("timed_out")


def _assert_load(load: dict, world: int) -> None:
    plan = load["figures"]["plan"]
    ranks = load["figures"]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world))
    assert sum(r["stage_bytes"] for r in ranks) == plan["total_bytes"] == TINY_PARAMS * 4  # fp32
    assert sorted(s["index"] for r in ranks for s in r["stages"]) == [s["index"] for s in plan["stages"]]
    for r in ranks:
        assert r["device"] == "cpu"
        for s in r["stages"]:
            assert s["param_bytes"] == s["plan_bytes"] > 0 and s["on_device"]
        assert r["bytes_read"] == r["param_bytes"] == r["stage_bytes"]  # its own tensors, each once
        assert r["files_opened"] >= 1
        if r["host_peak_resettable"]:
            # On CPU the weights live in host memory: about 1x the stage, never a second copy.
            assert 0.5 <= r["host_peak_bytes"] / r["stage_bytes"] <= 1.25, r


def _assert_fp32_numerics(result: dict) -> None:
    fwd = result["sections"]["forward"]["figures"]
    # fp32: the stated tolerance is 1e-4 of the largest logit, and the difference is within it. The tolerance is
    # recomputed here with the script's own arithmetic: float rounding only (default 1e-6 relative).
    assert fwd["tolerance"] == pytest.approx(1e-4 * max(1.0, fwd["max_abs_logit"]))
    assert fwd["max_abs_diff"] <= fwd["tolerance"] and fwd["argmax_agreement"] == 1.0
    gen = result["sections"]["generate"]["figures"]
    assert gen["tokens_equal"] is True and gen["divergences"] == []
    assert gen["rows_equal"] == gen["rows"] == result["config"]["batch"]
    assert gen["pipelined_tokens_per_s"] > 0 and gen["reference_tokens_per_s"] > 0 and gen["speedup"] > 0
    train = result["sections"]["train"]["figures"]
    # fp32 loss (relative) and gradients (relative L2): summation order ~1e-6; a dropped microbatch or wrong
    # gradient moves them >= 1e-2.
    assert abs(train["loss"] - train["reference_loss"]) <= 1e-5 * train["reference_loss"]
    assert train["grad_rel_l2"] <= 1e-4 and train["grad_params_compared"] > 0
    assert train["pipelined_tokens_per_s"] > 0 and train["reference_tokens_per_s"] > 0
    assert len(train["pipelined_seconds"]) == len(train["reference_seconds"]) >= 1


@pytest.mark.dist
def test_one_process_two_local_stages(tmp_path):
    cmd, out = _script(tmp_path, "--workdir", str(tmp_path / "work"))
    result = _run([sys.executable] + cmd, out)
    _assert_all_ok(result)
    cfg = result["config"]
    assert cfg["world_size"] == 1 and cfg["num_stages"] == 2
    assert cfg["virtual_stages"] == 2 and cfg["dtype"] == "float32"
    ckpt = result["sections"]["checkpoint"]["figures"]
    assert ckpt["model"]["params"] == TINY_PARAMS and ckpt["model"]["shards"] >= 2
    assert (tmp_path / "work" / "model" / "model.safetensors.index.json").is_file()  # --workdir is kept
    _assert_load(result["sections"]["load"], world=1)
    _assert_fp32_numerics(result)
    # Every stage is local, so every tensor's gradient was compared with transformers'.
    assert result["sections"]["train"]["figures"]["grad_params_compared"] == 4 * 9 + 3
    assert "figures written to" in result["_stdout"] and "all ok" in result["_stdout"]


@pytest.mark.dist
def test_torchrun_two_gloo_ranks(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    cmd, out = _script(tmp_path)
    result = _run([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                   str(free_port())] + cmd, out)
    _assert_all_ok(result)
    cfg = result["config"]
    assert cfg["world_size"] == 2 and cfg["backend"] == "gloo" and cfg["num_stages"] == 2 and cfg["virtual_stages"] == 1
    load = result["sections"]["load"]
    _assert_load(load, world=2)
    assert [[s["index"] for s in r["stages"]] for r in load["figures"]["ranks"]] == [[0], [1]]
    _assert_fp32_numerics(result)
    assert [r["rank"] for r in result["sections"]["train"]["figures"]["ranks"]] == [0, 1]
    ms = result["sections"]["train"]["figures"]["measured_split"]  # each stage timed, the split advised on it
    assert len(ms["planned"]) == len(ms["split"]) == 1 and ms["planned"][0].startswith("model.layers.")
    assert len(ms["stage_seconds"]) == 2 and all(t > 0 for t in ms["stage_seconds"])
    assert set(ms["head_blocks"]) == {"lm_head"}
    # one profiled step split into the ranks' compute, the schedule's own bubble (the replay) and the waits
    bd = result["sections"]["train"]["figures"]["step_breakdown"]
    assert len(bd["busy_seconds"]) == 2
    assert max(bd["busy_seconds"]) <= bd["replayed_seconds"] <= bd["wall_seconds"] + 1e-6
    # the factors multiply back to their own measured numbers: float64 rounding only (default 1e-6 relative)
    assert bd["schedule"] * bd["waits"] == pytest.approx(bd["wall_seconds"] / max(bd["busy_seconds"]))
    assert bd["imbalance"] >= 1
    # Without --workdir the checkpoint lives in a temporary directory that is removed at the end.
    assert not pathlib.Path(result["sections"]["checkpoint"]["figures"]["path"]).exists()


@pytest.mark.dist
def test_bf16_failure_in_one_section_is_recorded_and_the_next_runs(tmp_path):
    cmd, out = _script(tmp_path, "--dtype", "bfloat16", "--fail-in", "generate")
    result = _run([sys.executable] + cmd, out, expect_rc=1)
    secs = result["sections"]
    assert result["ok"] is False
    gen = secs["generate"]
    assert gen["status"] == "failed" and "injected" in gen["errors"][0] and "RuntimeError" in gen["traceback"]
    for name in ("env", "checkpoint", "load", "reference", "forward", "train"):
        assert secs[name]["status"] == "ok", (name, secs[name])
    # bf16: the tolerance is twice transformers' own rounding against fp32, at least one bf16 step (recomputed
    # with the script's arithmetic: float rounding only).
    fwd = secs["forward"]["figures"]
    assert fwd["tolerance"] == pytest.approx(max(2 * fwd["reference_rounding_vs_fp32"],
                                                 2.0**-7 * max(1.0, fwd["max_abs_logit"])))
    assert 0 < fwd["reference_rounding_vs_fp32"] and fwd["max_abs_diff"] <= fwd["tolerance"]
    assert secs["load"]["figures"]["plan"]["dtype"] == "bfloat16"
    train = secs["train"]["figures"]
    assert abs(train["loss"] - train["reference_loss"]) <= 2.0**-7 * train["reference_loss"]
    assert train["grad_rel_l2"] <= 2.0**-4


@pytest.mark.dist
def test_budget_watchdog_writes_the_figures_and_ends_the_run(tmp_path):
    # One second cannot hold a run (imports and the checkpoint alone take longer): the watchdog fires.
    cmd, out = _script(tmp_path, "--budget-s", "1", "--reserve-s", "0", "--workdir", str(tmp_path / "work"))
    result = _run([sys.executable] + cmd, out, expect_rc=3)
    assert result["timed_out"] is True and result["ok"] is False
    assert result["sections"].get("train", {}).get("status") != "ok"  # cut short, not finished


def test_json_is_never_seen_half_written_while_two_threads_write_it(tmp_path):
    # The main thread and the budget's watchdog both write the JSON. Whatever their interleaving, a
    # reader sees either no file or a whole one, and no temporary file stays behind. (With one
    # temporary name shared by both, a rename published the file the other writer had just
    # truncated: an empty JSON was read after a run ended at its budget.)
    import argparse
    import threading

    out = tmp_path / "device_check.json"
    run = Run(argparse.Namespace(out=str(out), budget_s=3600.0, reserve_s=0.0, workdir=None))
    stop = threading.Event()
    bad: list[str] = []

    def reader():
        while not stop.is_set():
            try:
                text = out.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                bad.append(text[:80])

    def writer(tag):
        try:
            # 3 x 150 writes of ~50 kB: with a plain truncate-and-write, the reader sees partial files at once.
            for i in range(150):
                run.result["sections"][f"{tag}{i % 7}"] = {"status": "ok", "figures": {"i": i, "pad": "x" * 8000}}
                run.write()
        except Exception as e:  # a write that fails (its temporary file renamed away by the other) fails the test
            bad.append(f"writer {tag}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=reader)] + [threading.Thread(target=writer, args=(t,)) for t in "abc"]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    run.done.set()
    assert not bad, f"{len(bad)} partial reads or failed writes, e.g. {bad[0]!r}"
    assert json.loads(out.read_text())["sections"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device_check.json"]


def test_first_divergences_measures_the_gap_at_the_first_differing_token():
    reference = torch.tensor([[5, 6, 7], [1, 2, 3], [4, 4, 4]])
    pipelined = torch.tensor([[5, 6, 7], [1, 9, 8], [0, 4, 4]])
    logits = [torch.zeros(3, 10) for _ in range(3)]
    logits[1][1, 2], logits[1][1, 9] = 3.0, 2.5  # row 1 parts at step 1: a gap of 0.5
    logits[0][2, 4], logits[0][2, 0] = 1.0, 1.0  # row 2 parts at step 0 on an exact tie
    div = first_divergences(pipelined, reference, logits)
    assert div == [
        {"row": 1, "step": 1, "reference_token": 2, "pipelined_token": 9, "gap": 0.5},
        {"row": 2, "step": 0, "reference_token": 4, "pipelined_token": 0, "gap": 0.0},
    ]
