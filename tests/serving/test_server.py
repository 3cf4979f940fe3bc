"""``hf-pipeline serve --num-processes 2`` live on 127.0.0.1, queried with the official ``openai`` client:
completions against transformers' greedy ``generate`` of each prompt alone, streamed against not
streamed, chat through the tokenizer's template, a 400 then a good request, 429 with the queue full,
and SIGTERM: the request in flight finishes, a new one gets 503, every process exits. The test stops
what it started, always."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
import transformers
from live_server import LiveServer, start_server

from hf_pipeline.tools.default_model import default_model_path

pytestmark = [pytest.mark.dist, pytest.mark.slow]

PROMPTS = ["Return the", "This module provides a way to", "If the file does not exist, the function", "def"]


SIGTERM_TOKENS = 96


def _greedy(ref, tok, ids: list[int], n: int, at_least: int = 0) -> str:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=at_least, do_sample=False
                       )[0, len(ids):].tolist()
    return tok.decode(out, skip_special_tokens=True)


def _parallel(fn, items) -> list:
    results: list = [None] * len(items)

    def run(i, item):
        try:
            results[i] = fn(item)
        except Exception as e:  # noqa: BLE001 - returned to the test, which checks it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, x)) for i, x in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    return results


def _check_completions(client, ref, tok) -> None:
    lengths = [12, 5, 16, 20]
    got = _parallel(lambda a: client.completions.create(model="tiny", prompt=a[0], max_tokens=a[1], temperature=0),
                    list(zip(PROMPTS, lengths)))
    for p, n, r in zip(PROMPTS, lengths, got):
        assert not isinstance(r, Exception), r
        assert r.choices[0].text == _greedy(ref, tok, tok(p)["input_ids"], n), p
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0, stream=True)
    chunks = list(streamed)
    assert len(chunks) > 2  # token by token, not one piece at the end
    assert "".join(c.choices[0].text for c in chunks) == got[2].choices[0].text
    assert chunks[-1].choices[0].finish_reason == got[2].choices[0].finish_reason


def _check_chat(client, ref, tok) -> None:
    messages = [{"role": "user", "content": "Return the"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == _greedy(ref, tok, list(ids), 10)
    assert r.choices[0].message.role == "assistant"
    s = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s) == r.choices[0].message.content


def _check_400_then_good(client, openai) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x" * 3000, max_tokens=4)
    assert e.value.body["param"] in ("prompt", "max_tokens"), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="other", prompt="x", max_tokens=4)
    assert e.value.body["param"] == "model"
    assert client.completions.create(model="tiny", prompt="Return the", max_tokens=3, temperature=0).choices[0].text


def _check_queue_full(client, openai) -> None:
    # --max-batch 2 --max-queue 4: a round runs at most 2, 4 more wait; the rest of 20 at once get 429.
    got = _parallel(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=120, temperature=0),
                    [PROMPTS[0]] * 20)
    refused = [r for r in got if isinstance(r, openai.RateLimitError)]
    served = [r for r in got if not isinstance(r, Exception)]
    assert refused and served and len(refused) + len(served) == 20, got
    assert len({r.choices[0].text for r in served}) == 1


def _check_sigterm(server: LiveServer, expected: str) -> None:
    import httpx

    proc, port, children = server.proc, server.port, server.children

    # Some requests still queued when SIGTERM comes: the drain serves them all and refuses new ones. Each runs
    # SIGTERM_TOKENS tokens (no EOS before: the prompt's greedy text ends at 30), so the drain lasts long enough
    # (3 rounds of 2 rows) for the late request below to reach a server still listening on a loaded machine.
    body = {"model": "tiny", "prompt": "Return the", "max_tokens": SIGTERM_TOKENS, "min_tokens": SIGTERM_TOKENS,
            "temperature": 0}
    url = f"http://127.0.0.1:{port}"

    def post():
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    def wait(ready) -> None:
        end = time.monotonic() + 60
        while not ready(httpx.get(f"{url}/health").json()) and time.monotonic() < end:
            time.sleep(0.01)

    flights = [_parallel_start(post) for _ in range(2)]
    wait(lambda h: h["running"] and not h["queued"])  # a round took them: the queue (of 4 at most) is empty
    flights += [_parallel_start(post) for _ in range(4)]
    wait(lambda h: h["queued"] >= 2)
    proc.send_signal(signal.SIGTERM)
    while httpx.get(f"{url}/health").json()["status"] != "draining":
        time.sleep(0.01)
    late = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert late.status_code == 503, late.text
    assert proc.wait(timeout=90) == 0, server.tail()
    # Every request accepted before the signal is served (200); one of the last four that reached the
    # server only after it is refused at submission as draining (the threads post at once, but not all
    # need have arrived). "shutting down" is only ever answered at submission, never to a queued request.
    for i, flight in enumerate(flights):
        flight.join(timeout=30)
        if i >= 2 and flight.result.status_code == 503:
            assert "shutting down" in flight.result.text, flight.result.text
            continue
        assert flight.result.status_code == 200, flight.result.text
        assert flight.result.json()["choices"][0]["text"] == expected
    time.sleep(0.5)
    assert not [p.pid for p in children if p.is_running() and p.status() != "zombie"]


def _parallel_start(fn) -> threading.Thread:
    t = threading.Thread(target=lambda: setattr(t, "result", fn()), daemon=True)
    t.start()
    return t


def test_serve_two_processes_with_the_openai_client(tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("psutil")
    model = default_model_path()  # its tokenizer carries the bundled chat template
    server = start_server(model, tmp_path / "server.log", "--max-batch", "2", "--max-queue", "4")
    try:
        server.wait_up()
        assert len(server.ranks()) == 2
        tok = transformers.AutoTokenizer.from_pretrained(model)
        ref = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["tiny"]
        _check_completions(client, ref, tok)
        _check_chat(client, ref, tok)
        _check_400_then_good(client, openai)
        _check_queue_full(client, openai)
        _check_sigterm(server, _greedy(ref, tok, tok("Return the")["input_ids"], SIGTERM_TOKENS, SIGTERM_TOKENS))
    finally:
        server.stop()
