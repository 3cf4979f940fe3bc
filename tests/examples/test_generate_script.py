"""Launcher smoke tests: scripts/generate.py under torchrun and accelerate, on the default model.

Both launches run 2 CPU processes on the default (tiny, random) LLaMA and must print exactly what
transformers' greedy ``generate`` gives on one process.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest
import torch
from harness import free_port

pytestmark = pytest.mark.dist  # every test here starts other processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "generate.py"
PROMPTS = ["The pipeline", "A model is split into stages", "def generate(model"]
NEW = 6


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    import transformers

    cache = tmp_path_factory.mktemp("cache")
    os.environ["HF_PIPELINE_CACHE"] = str(cache)
    try:
        from hf_pipeline.tools.default_model import default_model_path

        path = default_model_path()
    finally:
        del os.environ["HF_PIPELINE_CACHE"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = ref.generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return {"cache": cache, "ids": ids, "texts": texts}


def _env(cache) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_PIPELINE_CACHE=str(cache), OMP_NUM_THREADS="1", HF_PIPELINE_THREADS="1", GLOO_SOCKET_IFNAME="lo",
        HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
    )
    return env


def _launcher(name: str) -> list[str]:
    exe = shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not on PATH")
    return [exe]


def _run(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_torchrun_two_processes_prompts_file_json(default_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n", encoding="utf-8")  # a blank line is skipped
    cmd = _launcher("torchrun") + [
        "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(SCRIPT), "--prompts-file", str(prompts), "--max-new-tokens", str(NEW), "--json",
    ]
    out = _run(cmd, _env(default_model["cache"]))
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"exactly one rank prints: {out}"
    result = json.loads(lines[0])
    assert result["world_size"] == 2 and result["num_stages"] == 2 and result["n_microbatches"] == 2
    assert torch.equal(torch.tensor(result["ids"]), default_model["ids"])
    assert result["texts"] == default_model["texts"]
    assert result["tokens_per_s"] > 0


def test_accelerate_launch_two_processes_text(default_model):
    cmd = _launcher("accelerate") + [
        "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(SCRIPT), "--max-new-tokens", str(NEW),
    ] + [arg for p in PROMPTS for arg in ("--prompt", p)]
    out = _run(cmd, _env(default_model["cache"]))
    for prompt, text in zip(PROMPTS, default_model["texts"]):
        assert f"> {prompt!r} -> {text!r}" in out, out
    assert out.count("tokens/s") == 1 and "2 process(es), 2 stages" in out, out
