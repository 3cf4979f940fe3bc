"""The serving engine in one process: every request against transformers' ``generate`` of it alone; the
batching policy; the OpenAI protocol's refusals through the app (FastAPI's test client, engine rounds in
a thread)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

import pytest
import tiny
import torch
import transformers

import hf_pipeline
from hf_pipeline.errors import ServerBusy, ServingRequestError
from hf_pipeline.serving import CompletionRequest, Engine, Handle, StaticBatcher
from hf_pipeline.tools.default_model import default_model_path

PROMPTS = ["Return the", "This module provides a way to", "If the file does not exist, the function", "def"]


def bundled_model() -> tuple:
    """The bundled model: its tokenizer, the pipelined model and transformers' copy."""
    path = str(default_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return tok, model, ref


@pytest.fixture(scope="module")
def bundled():
    return bundled_model()


def _alone(ref, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for one prompt on its own (no padding), EOS and what follows dropped."""
    return tiny.greedy_alone(ref, ids, max_new_tokens)[0]


@contextlib.contextmanager
def app_client(engine: Engine, tokenizer):
    """A TestClient of the app over ``engine``, whose rounds run in a thread until the block ends (then drained,
    and the thread joined: nothing left running)."""
    TestClient = pytest.importorskip("fastapi.testclient").TestClient
    from hf_pipeline.serving.server import build_app

    rounds = threading.Thread(target=engine.serve_forever, daemon=True)
    rounds.start()
    try:
        yield TestClient(build_app(engine, tokenizer, model_name="m", timeout_s=60))
    finally:
        engine.drain()
        rounds.join(timeout=60)
    assert not rounds.is_alive()


def _run(engine: Engine, handles: list[Handle]) -> None:
    """Rounds in this thread until every handle is done, then drain and stop."""
    def stop_when_done():
        for h in handles:
            h.result(timeout=120)
        engine.drain()

    threading.Thread(target=stop_when_done, daemon=True).start()
    engine.serve_forever()


@pytest.mark.equiv
def test_greedy_requests_batched_together_equal_each_alone(bundled):
    tok, model, ref = bundled
    engine = Engine(model, tok, max_batch=8, batching="static")
    lengths = [12, 5, 12, 20]
    handles = [engine.submit(CompletionRequest(prompt_ids=tok(p)["input_ids"], max_new_tokens=m))
               for p, m in zip(PROMPTS, lengths)]
    streamed = []
    reader = threading.Thread(target=lambda: streamed.extend(handles[3]), daemon=True)
    reader.start()
    _run(engine, handles)
    reader.join(timeout=30)
    # One round served all four (left padded to the longest prompt): padding must not change greedy tokens.
    assert engine.rounds == 1
    for p, m, h in zip(PROMPTS, lengths, handles):
        choice = h.result()[0]
        expected = _alone(ref, tok(p)["input_ids"], m)
        assert choice.token_ids == expected, p
        assert choice.text == tok.decode(expected, skip_special_tokens=True)
        assert choice.finish_reason == ("length" if len(expected) == m else "stop")
    # Read while it ran: the deltas add up to the result, token by token.
    assert [t for d in streamed for t in d.token_ids] == handles[3].result()[0].token_ids
    assert "".join(d.text for d in streamed) == handles[3].result()[0].text
    assert streamed[-1].finish_reason == handles[3].result()[0].finish_reason


# Continuous in the full suite only (equiv): the ring's own tests cover it, and it is the quick tier's longest.
@pytest.mark.parametrize("batching", ["static", pytest.param("continuous", marks=pytest.mark.equiv)])
def test_stop_strings_ids_seeds_and_cancellation(bundled, batching):
    tok, model, ref = bundled
    engine = Engine(model, tok, max_batch=8, batching=batching)
    ids = tok(PROMPTS[0])["input_ids"]
    full = _alone(ref, ids, 12)
    text = tok.decode(full, skip_special_tokens=True)
    stop = text[6:9]  # a stop string in the middle of the greedy text
    by_string = engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=12, stop=[stop]))
    by_id = engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=12, stop_token_ids=[full[3]]))
    seeded = [engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=8, temperature=0.9, seed=7, n=2))
              for _ in range(2)]
    cancelled = engine.submit(CompletionRequest(prompt_ids=ids, max_new_tokens=8))
    cancelled.cancel()
    _run(engine, [by_string, by_id, *seeded])
    got = by_string.result()[0]
    assert got.text == text[: text.index(stop)] and got.finish_reason == "stop"
    assert by_id.result()[0].token_ids == full[: full.index(full[3])] and by_id.result()[0].finish_reason == "stop"
    # A seeded request runs alone: the same seed gives the same choices, and they are the model's own
    # seeded generate of those n rows (two rows, two different samples).
    a, b = (h.result() for h in seeded)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    rows = model.generate(torch.tensor([ids, ids]), max_new_tokens=8, do_sample=True, temperature=0.9, seed=7)
    assert [c.token_ids for c in a] == [r[: r.index(2)] if 2 in r else r for r in rows[:, len(ids):].tolist()]
    assert a[0].token_ids != a[1].token_ids
    assert cancelled.result()[0].finish_reason == "cancelled" and cancelled.result()[0].token_ids == []
    # Static: string-stop, id-stop and each seeded request: four calls; the cancelled one none. Continuous:
    # one ring session, each row with its own stop criteria and generator.
    assert engine.rounds == (4 if batching == "static" else 1)


def test_batcher_groups_only_what_one_generate_call_can_serve():
    def h(i, **kw):
        return Handle(CompletionRequest(prompt_ids=[1] * kw.pop("length", 3), **kw), f"r{i}")

    queue = deque([h(0), h(1, temperature=0.5), h(2, max_new_tokens=40), h(3, stop=["x"]), h(4),
                   h(5, length=500, max_new_tokens=10), h(6, temperature=0.5, seed=1), h(7, temperature=0.5, seed=1)])
    batcher = StaticBatcher(max_rows=8, context=512)
    ids = [[x.id for x in batcher.take(queue)] for _ in range(6)]
    # greedy together (r5 would push the padded batch past the context with r2's 40 tokens); sampling
    # with the same parameters together unless seeded; seeded requests each alone.
    assert ids == [["r0", "r2", "r4"], ["r1"], ["r3"], ["r5"], ["r6"], ["r7"]]
    assert batcher.take(queue) == []
    assert [x.id for x in StaticBatcher(max_rows=2).take(deque([h(0), h(1, n=2, temperature=1.0), h(2), h(3)]))] == [
        "r0", "r2"]


def test_continuous_engine_settings_are_checked(bundled):
    from hf_pipeline.continuous_batching.kv_budget import pool_rows, row_kv_bytes
    from hf_pipeline.errors import InputError, UsageError

    tok, model, _ = bundled
    engine = Engine(model, tok)
    assert engine.batching == "continuous" and engine.static_reason is None and engine.pool == 8
    with pytest.raises(InputError, match="batching"):
        Engine(model, tok, batching="dynamic")
    per_row = row_kv_bytes(model, 512)
    # The bundled model's one stage holds every layer: 2 (K, V) x layers x KV heads x head dim x 4 bytes per token.
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert per_row == 512 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    assert pool_rows(model, max_batch=8, kv_cache_bytes=3 * per_row + 1, context=512) == 3
    with pytest.raises(UsageError, match="kv_cache_bytes"):
        Engine(model, tok, kv_cache_bytes=per_row - 1)


def test_refusals_name_the_field(bundled):
    tok, model, _ = bundled
    engine = Engine(model, tok, max_queue=1)
    with pytest.raises(ServingRequestError) as e:
        engine.submit(CompletionRequest(prompt_ids=[1] * 500, max_new_tokens=20))
    assert e.value.param == "max_tokens" and "512" in str(e.value)
    with pytest.raises(ServingRequestError) as e:
        CompletionRequest(prompt_ids=[1], n=2)
    assert e.value.param == "n"
    engine.submit(CompletionRequest(prompt_ids=[1, 5]))
    with pytest.raises(ServerBusy) as e:
        engine.submit(CompletionRequest(prompt_ids=[1, 5]))
    assert not e.value.draining
    engine.drain()
    with pytest.raises(ServerBusy) as e:
        engine.submit(CompletionRequest(prompt_ids=[1, 5]))
    assert e.value.draining


def test_the_app_refuses_bad_bodies_with_400_and_serves_the_next(bundled):
    tok, model, ref = bundled
    engine = Engine(model, tok, idle_s=0.05)
    with app_client(engine, tok) as client:
        good = {"model": "m", "prompt": "Return the", "max_tokens": 6, "temperature": 0}
        bad = [
            (b"{not json", None), ({**good, "model": "other"}, "model"), ({**good, "logprobs": True}, "logprobs"),
            ({**good, "n": 2}, "n"), ({**good, "max_tokens": 600}, "max_tokens"), ({**good, "temperature": "hot"},
                                                                                     "temperature"),
            ({**good, "prompt": None}, "prompt"), ({**good, "stop": [""]}, "stop"),
        ]
        for body, param in bad:
            r = client.post("/v1/completions", **({"content": body} if isinstance(body, bytes) else {"json": body}))
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        template, tok.chat_template = tok.chat_template, None  # a tokenizer without a chat template
        try:
            r = client.post("/v1/chat/completions", json=chat)
        finally:
            tok.chat_template = template
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert client.post("/v1/chat/completions", json={**chat, "max_tokens": 4}).status_code == 200  # the bundled one
        r = client.post("/v1/completions", json=good)
        assert r.status_code == 200, r.text
        expected = _alone(ref, tok("Return the")["input_ids"], 6)
        assert r.json()["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
        assert r.json()["usage"]["completion_tokens"] == len(expected)
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        assert client.get("/health").json()["status"] == "ok"


def test_a_request_past_its_timeout_is_cancelled_with_504(bundled):
    TestClient = pytest.importorskip("fastapi.testclient").TestClient
    from hf_pipeline.serving.server import build_app

    tok, model, _ = bundled
    engine = Engine(model, tok)  # no rounds run: the request waits in the queue
    client = TestClient(build_app(engine, tok, model_name="m", timeout_s=0.2))
    r = client.post("/v1/completions", json={"model": "m", "prompt": "Return the", "max_tokens": 4})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert engine.queued == 0  # cancelled: no round will run it


def test_serve_on_a_taken_port_is_one_line_exit_2(capsys):
    import socket

    pytest.importorskip("uvicorn")
    from hf_pipeline import cli

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = cli.main(["serve", "--port", str(busy.getsockname()[1])])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1" in err and "--port" in err and "Traceback" not in err, err


def test_a_client_that_leaves_cancels_its_request(bundled):
    import asyncio

    pytest.importorskip("fastapi")
    from hf_pipeline.serving.server import _Api

    tok, model, _ = bundled
    engine = Engine(model, tok)  # no rounds run: the request waits in the queue until the client leaves

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    handle = engine.submit(CompletionRequest(prompt_ids=[1, 5], max_new_tokens=4))

    async def read():
        return [x async for x in _Api(engine, tok, "m", 60).events(Gone(), [handle], 1, time.monotonic())]

    assert asyncio.run(read()) == []
    assert handle.cancelled and engine.queued == 0


def test_a_stream_holds_back_only_an_incomplete_character():
    # Byte tokens: "€" and "日本" arrive a byte at a time (decoded as U+FFFD until complete), and the last
    # token is a lone lead byte. A reader's deltas must add up to the decoded tokens exactly: the text seen so
    # far only grows (holding the whole text back made the next delta resend it: served streams then repeated
    # their beginning). The stop string "日本" is held across its incomplete second character and never sent.
    from hf_pipeline.serving.engine import _ChoiceWriter

    tok = transformers.AutoTokenizer.from_pretrained(str(default_model_path()))
    ids = tok(" return € and 日本 and", add_special_tokens=False)["input_ids"] + tok("€", add_special_tokens=False)[
        "input_ids"][:1]
    full = tok.decode(ids, skip_special_tokens=True)
    assert full.endswith("and\ufffd") and full.count("\ufffd") == 1  # the test's premise: bytes, one left incomplete
    for stop, expected in (((), full), (("日本",), full[: full.index("日本")])):
        handle = Handle(CompletionRequest(prompt_ids=[1], max_new_tokens=len(ids), ignore_eos=True, stop=stop), "r")
        writer, reader, seen = _ChoiceWriter(handle, 0, tok, set()), iter(handle), []
        for t in ids:
            writer.add([t])
            seen.append(next(reader))  # every token is news: its id, and its text once complete
            visible = "".join(d.text for d in seen)
            assert full.startswith(visible) and not (visible.endswith("\ufffd") and seen[-1].finish_reason is None)
            if seen[-1].finish_reason:
                break
        assert "".join(d.text for d in seen) == expected == handle.result()[0].text, stop


def test_an_ops_updates_wake_an_event_loop_once_and_every_reader_sees_its_own():
    # The engine hands an op's tokens to several requests; their async readers share one event loop, which is
    # woken once for all of them (each wake is a write to the loop's pipe and takes the interpreter from the
    # engine's thread), and each reader still gets exactly its own delta.
    import asyncio

    handles = [Handle(CompletionRequest(prompt_ids=[1], max_new_tokens=2), f"r{i}") for i in range(3)]

    def token(k: int):
        def write(choices):
            choices[0].token_ids.append(10 + k)
            choices[0].text = f"t{k}"
        return write

    async def main():
        loop = asyncio.get_running_loop()
        wakes, schedule = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), schedule(*a))[1]
        readers = [h.deltas(poll_s=30) for h in handles]
        assert [await r.__anext__() for r in readers] == [[], [], []]  # nothing yet; now each waits
        waiting = [asyncio.ensure_future(r.__anext__()) for r in readers]
        await asyncio.sleep(0)
        # The engine's thread, while this loop cannot run (joined here): one op's three tokens.
        engine = threading.Thread(target=lambda: [h.update(token(k)) for k, h in enumerate(handles)])
        engine.start()
        engine.join()
        batches = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        for r in readers:
            await r.aclose()
        return wakes, batches

    wakes, batches = asyncio.run(main())
    assert len(wakes) == 1
    assert [[(d.token_ids, d.text) for d in b] for b in batches] == [[([10 + k], f"t{k}")] for k in range(3)]
    assert all(not h._waiters for h in handles)  # closed readers leave no waiter behind
