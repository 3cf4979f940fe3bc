"""guidellm (its CLI, unpatched) benchmarks a live 2-rank ``hf-pipeline serve`` of the bundled tiny LLaMA.

One small synchronous run, as its users start one: chat requests of synthetic 8-token prompts asking for 4
output tokens (guidellm sends ``ignore_eos`` and ``stream_options.continuous_usage_stats`` for that), its
tokenizer the model's local folder and HF_HUB_OFFLINE=1, so nothing reaches the network. Every request must
succeed (guidellm counts an answer without tokens as an error) with exactly 4 output tokens, and the prompt
tokens the server reports must be the chat template's tokens of what guidellm sent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import transformers
from live_server import start_server

from hf_pipeline.tools.default_model import default_model_path

pytest.importorskip("guidellm")

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a server of 2 processes and guidellm's own

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 8, 4


def _benchmark(url: str, out) -> dict:
    guidellm = shutil.which("guidellm")
    assert guidellm, "guidellm is installed but its command is not on PATH"
    cmd = [
        guidellm, "run", "--backend", f"kind=openai_http,target={url},model=tiny", "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={default_model_path()}",
        "--output", f"kind=json,path={out}", "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"guidellm exited with {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_a_guidellm_benchmark_of_the_server_has_no_errors_and_the_asked_lengths(tmp_path):
    server = start_server(default_model_path(), tmp_path / "server.log", "--max-batch", "4")
    try:
        server.wait_up()
        report = _benchmark(server.url, tmp_path / "benchmark.json")
    finally:
        server.stop()
    (benchmark,) = report["benchmarks"]
    requests = benchmark["requests"]
    assert len(requests["errored"]) == 0 and len(requests["incomplete"]) == 0, requests["errored"][:1]
    assert len(requests["successful"]) == REQUESTS
    tok = transformers.AutoTokenizer.from_pretrained(str(default_model_path()))
    for stats in requests["successful"]:
        assert stats["output_tokens"] == OUTPUT_TOKENS, stats
        body = json.loads(stats["request_args"])["body"]
        assert body["ignore_eos"] is True and body["max_completion_tokens"] == OUTPUT_TOKENS
        messages = [{"role": m["role"], "content": "".join(p["text"] for p in m["content"])} for m in body["messages"]]
        templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert stats["prompt_tokens"] == len(templated), (stats["prompt_tokens"], messages)
