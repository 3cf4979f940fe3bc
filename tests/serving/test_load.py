"""200 concurrent requests against a live 2-process ``hf-pipeline serve`` (driven by devtools/load_test.py):
every one answered 200 with transformers' greedy text and token count, none lost, the server's memory
flat from a warm-up batch to the end of the load, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers
from live_server import ROOT, rss_bytes, start_server

from devtools import load_test as load
from hf_pipeline.tools.default_model import default_model_path

pytestmark = [pytest.mark.dist, pytest.mark.slow]

PROMPTS = ["Return the", "This module provides a way to", "If the file does not exist, the function", "def",
           "The pipeline", "A model is split into stages", "import torch", "Raises an error when"]
REQUESTS, MAX_TOKENS = 200, 12
# The bundled model keeps 4 layers x 2 (K, V) x 2 KV heads x 64 dims x 4 bytes = 4 KiB of KV cache per
# position; a request here holds ~17 positions (5 of prompt on average, 12 new): ~68 KiB. A leak of every
# request's cache would grow the ranks by ~13 MiB over 200 requests (a leaked logits row per step,
# 12 x 2048 x 4 bytes per request, by ~19 MiB). The bound is under half the smaller. Measured without a
# leak: 0.6-1.0 MiB per rank per 200 requests after the warm-up (1.3-1.7 MiB for the server).
LEAK_BOUND = 6 * 2**20
# glibc hands freed blocks above this size back to the OS at once (its default threshold climbs to
# 32 MiB as tensors are freed, and RSS then keeps each batch shape's peak): RSS follows live memory.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _expected(model) -> dict[int, tuple[str, int]]:
    """transformers' greedy text and completion token count of each prompt alone (EOS ends it early and, as
    OpenAI and vLLM count it, is one of the completion's tokens)."""
    tok = transformers.AutoTokenizer.from_pretrained(model)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    out = {}
    for i, p in enumerate(PROMPTS):
        ids = tok(p)["input_ids"]
        new = ref.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
        ended = tok.eos_token_id in new
        new = new[: new.index(tok.eos_token_id)] if ended else new
        out[i] = (tok.decode(new, skip_special_tokens=True), len(new) + ended)
    return out


def _tree(server) -> list:
    import psutil

    return [psutil.Process(server.proc.pid), *server.children]


def test_200_concurrent_requests_none_lost_memory_flat(tmp_path):
    pytest.importorskip("httpx")
    pytest.importorskip("psutil")
    import httpx

    model = default_model_path()
    server = start_server(model, tmp_path / "server.log", "--max-batch", "32", "--max-queue", str(REQUESTS + 8),
                          env=ALLOCATOR)
    try:
        expected = _expected(model)  # while the server starts
        server.wait_up()
        assert len(server.ranks()) == 2
        url = f"{server.url}/v1"
        # The warm-up is the same load: the first 200 connections at once grow rank 0's buffers and the
        # allocator's arenas once; a leak grows the ranks on every batch after.
        warm = load.run_load(url, "tiny", PROMPTS, requests=REQUESTS, concurrency=REQUESTS,
                             max_tokens=MAX_TOKENS, timeout=120)
        assert len(warm.ok) == REQUESTS, [o.error for o in warm.outcomes if o.status != 200][:3]
        before = [rss_bytes([p]) for p in _tree(server)]
        report = load.run_load(url, "tiny", PROMPTS, requests=REQUESTS, concurrency=REQUESTS,
                               max_tokens=MAX_TOKENS, timeout=120)
        after = [rss_bytes([p]) for p in _tree(server)]
        failed = [(o.status, o.error) for o in report.outcomes if o.status != 200]
        assert not failed, failed[:5]
        for o in report.outcomes:  # every request's own answer: transformers' greedy text and length
            assert (o.text, o.completion_tokens) == expected[o.prompt], (PROMPTS[o.prompt], o)
        # Nothing left behind: the engine's queue and running list empty (given a moment: a request's
        # answer may leave before the engine has let go of it).
        end = time.monotonic() + 10
        while (health := httpx.get(f"{server.url}/health").json())["queued"] or health["running"]:
            assert time.monotonic() < end, health
            time.sleep(0.1)
        grown = sum(after) - sum(before)
        print(f"server RSS after the warm-up {sum(before) / 2**20:.1f} MiB, after {REQUESTS} more requests "
              f"{sum(after) / 2**20:.1f} MiB; {json.dumps(report.summary())}")
        assert grown < LEAK_BOUND, f"the server grew by {grown / 2**20:.1f} MiB (per process: {before} -> {after})"
        # The script as a user runs it, tiny: its report says what the server answered.
        cli = subprocess.run([sys.executable, "-m", "devtools.load_test", "--url", url, "--model",
                              "tiny", "--prompt", PROMPTS[0], "--requests", "4", "--concurrency", "2",
                              "--max-tokens", str(MAX_TOKENS), "--json"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
        assert cli.returncode == 0, cli.stderr
        got = json.loads(cli.stdout)
        assert got["summary"]["ok"] == 4 and {o["text"] for o in got["outcomes"]} == {expected[0][0]}
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.tail()
        assert not [p.pid for p in server.children if p.is_running() and p.status() != "zombie"]
    finally:
        server.stop()
