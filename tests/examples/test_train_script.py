"""scripts/train.py at tiny size, started the way users start it: torchrun and accelerate launch.

A tiny model and a word-level tokenizer built with ``tokenizers`` over a small local text file
(saved into the model directory) stand in for a hub model. The torchrun run trains LLaMA for 4
steps with checkpoints every 2; a second run with ``--resume`` (after removing checkpoint-4)
continues from checkpoint-2 and must log the same losses for steps 3-4. The accelerate run trains
T5 and its checkpoint must load in plain transformers, with the tokenizer.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import tiny
import transformers
from harness import free_port

pytestmark = pytest.mark.dist  # every test here starts other processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train.py"
def _model_dir(root: pathlib.Path, arch: str, text: pathlib.Path) -> pathlib.Path:
    path = tiny.make_checkpoint(root / arch, arch, auto=tiny.AUTO[arch])
    tiny.word_tokenizer(text).save_pretrained(path)
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1", "HF_PIPELINE_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
    })
    return env


def _run(cmd: list[str], timeout: float = 240) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc.stdout + proc.stderr


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(SCRIPT), *args]


def _log(path: pathlib.Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def test_torchrun_training_checkpoints_and_bitwise_resume(tmp_path):
    text = tiny.text_file(tmp_path / "train.txt")
    model = _model_dir(tmp_path, "llama", text)
    out = tmp_path / "out"
    common = ["--model", str(model), "--data", str(text), "--output-dir", str(out), "--steps", "4", "--save-every", "2",
              "--batch-size", "4", "--n-microbatches", "2", "--block-size", "16", "--device", "cpu", "--no-progress"]
    log = _run(_torchrun(*common, "--log-file", str(tmp_path / "a.jsonl")))
    assert "on 2 rank(s)" in log, log[-2000:]
    first = _log(tmp_path / "a.jsonl")
    assert sorted(first) == [1, 2, 3, 4] and all(v > 0 for v in first.values())
    for step in (2, 4):
        ckpt = out / f"checkpoint-{step}"
        assert (ckpt / "model.safetensors.index.json").is_file() and (ckpt / "tokenizer.json").is_file()
        assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint-4")
    tok = transformers.AutoTokenizer.from_pretrained(out / "checkpoint-4")
    ids = tok(["the quick brown fox"], return_tensors="pt")
    assert hf(**ids).logits.shape == (1, 4, tiny.VOCAB)
    # Resume picks the latest COMPLETE checkpoint: checkpoint-4 is gone, a crashed save of 6 is ignored.
    shutil.rmtree(out / "checkpoint-4")
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-6.tmp-0123456789ab")
    log = _run(_torchrun(*common, "--resume", "--log-file", str(tmp_path / "b.jsonl")))
    assert "resumed from" in log and "checkpoint-2 at step 2" in log, log[-2000:]
    second = _log(tmp_path / "b.jsonl")
    assert sorted(second) == [3, 4]
    assert second[3] == first[3] and second[4] == first[4], (first, second)  # bitwise: same floats


def test_accelerate_launch_multi_gpu_on_cpu_trains_t5(tmp_path):
    if shutil.which("accelerate") is None:
        pytest.skip("accelerate CLI not installed")
    text = tiny.text_file(tmp_path / "train.txt")
    model = _model_dir(tmp_path, "t5", text)
    out = tmp_path / "out"
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(SCRIPT),
           "--model", str(model), "--data", str(text), "--output-dir", str(out), "--steps", "2", "--batch-size", "4",
           "--n-microbatches", "2", "--block-size", "8", "--device", "cpu", "--no-progress"]
    log = _run(cmd)
    assert "on 2 rank(s)" in log, log[-2000:]  # two processes, one pipeline: not two single-process runs
    rows = _log(out / "log.jsonl")
    assert sorted(rows) == [1, 2]
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out / "checkpoint-2")
    tok = transformers.AutoTokenizer.from_pretrained(out / "checkpoint-2")
    enc = tok(["the quick brown fox"], return_tensors="pt")
    assert hf(**enc, labels=enc["input_ids"]).loss.isfinite()
