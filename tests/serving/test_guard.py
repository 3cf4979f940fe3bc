"""The HTTP server exposed to a network, in one process (FastAPI's test client, engine rounds in a thread):
the API key on every route but /health, the body and prompt limits answered before parsing or
tokenizing, tokenization off the event loop, ``n`` bounded and counted as rows against the queue, an
OpenAI error object for every failure (500s included), and the zeros OpenAI refuses."""

from __future__ import annotations

import threading

import pytest
import transformers

import hf_pipeline
from hf_pipeline.errors import InputError, ServerBusy, ServingRequestError
from hf_pipeline.serving import CompletionRequest, Engine
from hf_pipeline.tools.default_model import default_model_path

pytestmark = pytest.mark.unit
TestClient = pytest.importorskip("fastapi.testclient").TestClient

KEY = "s3cret-key"
GOOD = {"model": "m", "prompt": "Return the", "max_tokens": 4, "temperature": 0}


def _chat(body: dict, content: str = "hi") -> dict:
    """``body`` as a chat request: its prompt made one message (a field a route does not take is refused)."""
    return {**{k: v for k, v in body.items() if k != "prompt"}, "messages": [{"role": "user", "content": content}]}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def bundled():
    path = str(default_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return tok, hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False)


class Spy:
    """The bundled tokenizer as the app sees it, counting the prompts it tokenizes; ``template`` its chat
    template, ``fail`` what tokenizing raises, ``gate`` an event each call waits for (``waited`` says
    whether it came in time)."""

    def __init__(self, tok, template: str | None = CHAT_TEMPLATE, fail: Exception | None = None, gate=None):
        self.tok, self.chat_template, self.fail, self.gate = tok, template, fail, gate
        self.calls, self.entered, self.waited = 0, threading.Event(), None

    def _enter(self) -> None:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            self.waited = self.gate.wait(timeout=30)
        if self.fail is not None:
            raise self.fail

    def __call__(self, text: str):
        self._enter()
        return self.tok(text)

    def apply_chat_template(self, messages, **kwargs):
        self._enter()
        return self.tok.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

    def get_vocab(self):
        return self.tok.get_vocab()


def _app(engine, tokenizer, **limits):
    from hf_pipeline.serving.guard import Limits
    from hf_pipeline.serving.server import build_app

    return build_app(engine, tokenizer, model_name="m", timeout_s=60, limits=Limits(**limits))


def _serving(engine):
    rounds = threading.Thread(target=engine.serve_forever, daemon=True)
    rounds.start()
    return rounds


def _error(r, status: int, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object with ``status``: ``{"error": {message, type, param, code}}``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == kind and error["param"] == param, error
    return error


def test_the_api_key_is_needed_on_every_route_but_health(bundled, monkeypatch):
    import hmac

    from hf_pipeline.serving import guard

    tok, model = bundled
    engine = Engine(model, tok, idle_s=0.05)
    compared, compare = [], hmac.compare_digest
    monkeypatch.setattr(guard.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or compare(a, b))
    rounds = _serving(engine)
    try:
        client = TestClient(_app(engine, tok, api_key=KEY), raise_server_exceptions=False)
        assert client.get("/health").json()["status"] == "ok"  # probes need no key
        for headers in ({}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer"},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
            for method, route in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                                  ("get", "/no-such-route"), ("get", "/openapi.json")):
                r = client.request(method, route, headers=headers, json=GOOD)
                assert _error(r, 401)["code"] == "invalid_api_key", (headers, route)
                assert r.headers["www-authenticate"] == "Bearer"
        assert engine.queued == 0 and engine.rounds == 0  # nothing unauthorised reached the engine
        ok = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "m"
        r = client.post("/v1/completions", headers=ok, json=GOOD)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert (KEY.encode(), KEY.encode()) in compared  # the key is compared in constant time
    finally:
        engine.drain()
        rounds.join(timeout=60)
    with pytest.raises(InputError, match="API key is empty"):
        _app(engine, tok, api_key=" ")


def test_a_body_over_the_limit_is_413_before_it_is_parsed(bundled):
    tok, model = bundled
    spy = Spy(tok)
    client = TestClient(_app(Engine(model, tok), spy, max_body_bytes=1000))
    big = {**GOOD, "prompt": "x" * 2000}
    _error(client.post("/v1/completions", json=big), 413)  # said by its Content-Length
    _error(client.post("/v1/completions", content=iter([b"{", b" " * 1500, b"}"])), 413)  # chunked: no length
    _error(client.post("/v1/chat/completions", json=_chat(big, "x" * 2000)),
           413)
    assert spy.calls == 0
    # Under the limit it is read and checked as before.
    assert _error(client.post("/v1/completions", json={**GOOD, "model": "other"}), 400, "model")


def test_a_prompt_over_the_limit_is_400_before_it_is_tokenized(bundled):
    from hf_pipeline.serving.protocol import prompt_char_limit

    tok, model = bundled
    engine = Engine(model, tok)
    # The bundled model: 512 positions, its longest vocabulary entry 17 characters: no longer prompt fits.
    assert prompt_char_limit(tok, 512) == 512 * max(len(t) for t in tok.get_vocab()) == 512 * 17
    spy = Spy(tok)
    client = TestClient(_app(engine, spy))
    too_long = "x" * (512 * 17 + 1)
    assert "8704" in _error(client.post("/v1/completions", json={**GOOD, "prompt": too_long}), 400, "prompt")["message"]
    _error(client.post("/v1/completions", json={**GOOD, "prompt": ["Return the", too_long]}), 400, "prompt")
    chat = {**_chat(GOOD), "messages": [{"role": "user", "content": "y" * 5000}] * 2}
    _error(client.post("/v1/chat/completions", json=chat), 400, "messages")
    assert spy.calls == 0  # none of them reached the tokenizer
    # --max-prompt-chars lower: counted in characters, then tokenized as before (the context refuses 3000 x's).
    client = TestClient(_app(engine, spy, max_prompt_chars=2999))
    r = client.post("/v1/completions", json={**GOOD, "prompt": "x" * 3000})
    assert "2999" in _error(r, 400, "prompt")["message"]
    assert spy.calls == 0
    r = client.post("/v1/completions", json={**GOOD, "prompt": "x " * 1000})
    assert "context of 512 tokens" in _error(r, 400, "prompt")["message"]
    assert spy.calls == 1


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_tokenizing_holds_up_no_other_client(bundled, route):
    tok, model = bundled
    engine = Engine(model, tok)
    spy = Spy(tok, gate=threading.Event())
    # Refused by the context once tokenized (no rounds run here): the slow request ends when let go.
    body = {**GOOD, "max_tokens": 600}
    body = _chat(body) if "chat" in route else body
    with TestClient(_app(engine, spy)) as client:  # one event loop for every request
        slow = threading.Thread(target=lambda: client.post(route, json=body), daemon=True)
        slow.start()
        assert spy.entered.wait(timeout=60)
        # The tokenizer is busy with the first request: /health (and the refusals) still answer.
        assert client.get("/health").json()["status"] == "ok"
        _error(client.post(route, json={**body, "model": "other"}), 400, "model")
        spy.gate.set()
        slow.join(timeout=60)
    assert spy.waited is True  # the tokenizer was let go by /health's answer, not by its own timeout


def test_n_is_bounded_and_counted_as_rows_against_the_queue(bundled):
    tok, model = bundled
    engine = Engine(model, tok, max_queue=4, max_n=3)  # no rounds run: requests stay queued
    sampled = {**GOOD, "temperature": 0.8}
    client = TestClient(_app(engine, tok))
    assert "--max-n" in _error(client.post("/v1/completions", json={**sampled, "n": 2000}), 400, "n")["message"]
    _error(client.post("/v1/completions", json={**sampled, "n": 4}), 400, "n")
    _error(client.post("/v1/completions", json={**sampled, "n": 2, "prompt": ["a", "b", "c"]}), 400, "prompt")
    assert engine.queued == 0
    # n choices take n of the queue's rows: 3 + 2 > 4 is refused at once (429), not left to wait behind.
    ids = tok("Return the")["input_ids"]
    engine.submit(CompletionRequest(prompt_ids=ids, n=3, temperature=0.8))
    with pytest.raises(ServerBusy, match="rows"):
        engine.submit(CompletionRequest(prompt_ids=ids, n=2, temperature=0.8))
    _error(client.post("/v1/completions", json={**sampled, "n": 2}), 429, kind="rate_limit_error")
    engine.submit(CompletionRequest(prompt_ids=ids))  # the last row
    with pytest.raises(ServerBusy):
        engine.submit(CompletionRequest(prompt_ids=ids))
    assert engine.queued == 2
    with pytest.raises(ServingRequestError, match="--max-n") as e:
        engine.check(CompletionRequest(prompt_ids=ids, n=4, temperature=0.8))
    assert e.value.param == "n"
    with pytest.raises(InputError, match="max_n"):
        Engine(model, tok, max_n=0)


def test_every_failure_is_an_openai_error_object_and_the_next_request_is_served(bundled):
    tok, model = bundled
    engine = Engine(model, tok, idle_s=0.05)
    rounds = _serving(engine)
    try:
        client = TestClient(_app(engine, tok), raise_server_exceptions=False)
        deep = b"[" * 100_000 + b"]" * 100_000
        assert "deeply" in _error(client.post("/v1/completions", content=deep), 400)["message"]
        _error(client.post("/v1/chat/completions", content=b'{"messages": ' + deep + b"}"), 400)
        _error(client.post("/v1/completions", content=b"\xff\xfe"), 400)
        _error(client.get("/v1/completions"), 405)
        _error(client.get("/v1/no-such-route"), 404)
        chat = _chat(GOOD)
        refusing = Spy(tok, template="{{ raise_exception('only system messages here') }}")
        r = TestClient(_app(engine, refusing), raise_server_exceptions=False).post("/v1/chat/completions", json=chat)
        assert "only system messages here" in _error(r, 400, "messages")["message"]
        for broken in (Spy(tok, fail=RuntimeError("/home/someone/secret.py failed")), Spy(tok, fail=RecursionError())):
            app = TestClient(_app(engine, broken), raise_server_exceptions=False)
            for route, body in (("/v1/completions", GOOD), ("/v1/chat/completions", chat)):
                error = _error(app.post(route, json=body), 500, kind="server_error")
                assert type(broken.fail).__name__ in error["message"] and "secret" not in error["message"]
        r = client.post("/v1/completions", json=GOOD)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    finally:
        engine.drain()
        rounds.join(timeout=60)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n"])
@pytest.mark.parametrize("value", [0, -1])
def test_zero_counts_are_refused_as_openai_does(bundled, field, value):
    tok, model = bundled
    engine = Engine(model, tok)
    client = TestClient(_app(engine, tok))
    body = {**GOOD, "max_tokens": 5, field: value}  # max_completion_tokens 0 must not fall back to max_tokens
    assert f"{field} must be >= 1" in _error(client.post("/v1/completions", json=body), 400, field)["message"]
    chat = _chat(body)
    _error(client.post("/v1/chat/completions", json=chat), 400, field)
    assert engine.queued == 0


def test_the_serve_flags_are_checked_before_loading(capsys, monkeypatch):
    pytest.importorskip("uvicorn")
    from hf_pipeline import cli

    monkeypatch.delenv("HF_PIPELINE_API_KEY", raising=False)
    for argv, says in ((["serve", "--api-key", ""], "the API key is empty"), (["serve", "--max-n", "0"], "--max-n"),
                       (["serve", "--max-body-mb", "0"], "--max-body-mb"),
                       (["serve", "--max-prompt-chars", "x"], "--max-prompt-chars")):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    monkeypatch.setenv("HF_PIPELINE_API_KEY", " ")
    assert cli.main(["serve"]) == 2
    assert "HF_PIPELINE_API_KEY" in capsys.readouterr().err
