"""The OpenAI-compatible HTTP server: a FastAPI app on rank 0 in front of the :class:`Engine`.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream=true``: server-sent events ending with ``data: [DONE]``). Every answer but a success is
OpenAI's error object (:mod:`.guard`): 401 without the API key (every route but ``/health``), 413 for
a body over the limit, 400 naming the field, 429 while the queue is full, 503 while draining, 504
past the request timeout, 500 for anything unforeseen. Bodies are decoded, prompts tokenized and chat
templates applied in a worker thread, off the event loop, so a long prompt holds up no other client.
A client that goes away cancels its request (checked at least every half second).

:func:`serve` runs on every rank: rank 0 starts uvicorn in a thread and runs the engine's rounds in
its main thread (where SIGTERM arrives and starts the drain); the other ranks run the rounds alone.

Example (``torchrun --nproc_per_node 2 -m hf_pipeline.cli serve PATH --port 8000``), then:
    >>> client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    >>> client.completions.create(model="default-model", prompt="Return the", max_tokens=8, temperature=0)
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from typing import Any, AsyncIterator

# Imported here, not in the functions: FastAPI reads the routes' annotations ("Request") from this module.
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..distributed.sockets import listening_socket
from ..errors import CLIError, ServerBusy, ServingRequestError
from ..generation.logprobs import TokenLogprob
from ..log import get_logger
from .engine import Engine
from .guard import API_KEY_ENV, Guard, Limits, error_response, install_error_handlers, refusal
from .handles import Handle
from .metrics import ServerMetrics
from .protocol import ParsedRequest, error_body, parse_chat, parse_completion, prompt_char_limit

__all__ = ["build_app", "serve"]

log = get_logger(__name__)
_STARTUP_S = 60.0  # how long rank 0 waits for uvicorn to listen


def _submit_all(engine: Engine, parsed: ParsedRequest) -> list[Handle]:
    """Every prompt's request queued, or none (a request is all its prompts' rows, counted together)."""
    for req in parsed.requests:
        engine.check(req)  # n over --max-n, a prompt past the context: named before rows are counted
    rows = sum(r.n for r in parsed.requests)
    if rows > engine.max_queue:
        raise ServingRequestError(
            f"the request asks for {rows} rows ({len(parsed.requests)} prompt(s) x n), more than the queue holds "
            f"({engine.max_queue}, --max-queue); send fewer prompts or a smaller n", param="prompt",
        )
    handles: list[Handle] = []
    try:
        for req in parsed.requests:
            handles.append(engine.submit(req))
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    return handles


async def _merged(handles: list[Handle], n: int, poll_s: float = 0.5) -> AsyncIterator[list[tuple[int, Any]]]:
    """Every handle's deltas as ``(choice index over all prompts, Delta)`` batches as they come; an empty batch
    after ``poll_s`` seconds without news. One handle (one prompt) is read directly: a task and a queue hand-over
    per token cost the event loop more than the rest of a streamed token."""
    import asyncio

    if len(handles) == 1:
        async for batch in handles[0].deltas(poll_s):
            yield [(d.index, d) for d in batch]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, h: Handle) -> None:
        async for batch in h.deltas(poll_s):
            for d in batch:
                await queue.put((k * n + d.index, d))
        await queue.put(None)

    tasks = [asyncio.create_task(pump(k, h)) for k, h in enumerate(handles)]
    open_ = len(tasks)
    try:
        while open_:
            try:
                item = await asyncio.wait_for(queue.get(), poll_s)
            except asyncio.TimeoutError:
                yield []
                continue
            if item is None:
                open_ -= 1
            else:
                yield [item]
    finally:
        for t in tasks:
            t.cancel()


def _finite(logprob: float) -> float:
    """A log-probability as JSON can carry it: a token a processor masked (top-p, a ``response_format``
    grammar) has ``-inf``, which JSON has no number for; vLLM's floor, -9999.0, stands in for it."""
    return max(logprob, -9999.0)


class _Api:
    """The routes' shared state: the engine, the tokenizer, the served name, the request timeout."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str, timeout_s: float):
        self.engine, self.tokenizer, self.model_name, self.timeout_s = engine, tokenizer, model_name, timeout_s
        self.metrics = ServerMetrics(engine)

    async def events(self, request, handles: list[Handle], n: int, started: float) -> AsyncIterator[tuple[int, Any]]:
        """``(choice index over all prompts, Delta)`` as they come; cancels every handle when the client
        leaves or the timeout passes (then yields ``(None, message)`` last). ``started``: the submission's
        ``time.monotonic()``, for the time-to-first-token metric."""
        deadline, first = time.monotonic() + self.timeout_s, True
        batches = _merged(handles, n)
        try:
            async for batch in batches:
                if not batch:  # half a second without news (or none yet)
                    if await request.is_disconnected():
                        return
                    if time.monotonic() > deadline:
                        yield None, f"the request took longer than --request-timeout {self.timeout_s:g} s"
                        return
                    continue
                if first:
                    self.metrics.first_token(started)
                    first = False
                for item in batch:
                    yield item
        finally:
            await batches.aclose()
            for h in handles:
                if not h.done:
                    h.cancel()

    async def complete(self, request, parsed: ParsedRequest, chat: bool):
        started = time.monotonic()
        try:
            handles = _submit_all(self.engine, parsed)
        except (ServingRequestError, ServerBusy) as e:
            return self.refused(refusal(e))
        n = parsed.requests[0].n
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if parsed.stream:
            return StreamingResponse(self._sse(request, handles, n, rid, chat, parsed, started),
                                     media_type="text/event-stream")
        async for i, d in self.events(request, handles, n, started):
            if i is None:
                return self.refused(error_response(504, d, kind="timeout"))
        if any(h.error for h in handles):
            return self.refused(error_response(500, next(h.error for h in handles if h.error)))
        choices = []
        for h in handles:
            for c in h.result():
                i = len(choices)
                if chat:
                    choices.append(self._choice(i, c.text, c.finish_reason, chat, self._chat_logprobs(h, c.logprobs)))
                else:
                    choices.append(self._completion_choice(i, h, c))
        used = sum(c.completion_tokens for h in handles for c in h.choices)
        self.metrics.finished(200, started, prompt_tokens=parsed.prompt_tokens, completion_tokens=used)
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": self._usage(parsed, used),
        }

    def refused(self, response):
        """``response`` (an error), counted by its status."""
        self.metrics.finished(response.status_code)
        return response

    @staticmethod
    def _usage(parsed: ParsedRequest, used: int) -> dict[str, int]:
        return {"prompt_tokens": parsed.prompt_tokens, "completion_tokens": used,
                "total_tokens": parsed.prompt_tokens + used}

    @staticmethod
    def _choice(i: int, text: str, reason: str | None, chat: bool, logprobs: Any = None,
                delta: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        body = {"role": "assistant", "content": text}
        return {"index": i, "delta" if delta else "message": body, "logprobs": logprobs, "finish_reason": reason}

    def _token(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _chat_logprobs(self, handle: Handle, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        if handle.request.logprobs is None:
            return None

        def one(token: int, logprob: float) -> dict[str, Any]:
            text = self._token(token)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def _completion_logprobs(self, handle: Handle, entries: list[TokenLogprob], prompt: list[TokenLogprob] | None,
                             offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's completions ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``);
        with ``echo`` the prompt's tokens first, the first of them without a log-probability. The chosen token
        is among its ``top_logprobs`` as vLLM gives them."""
        if handle.request.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

        def add(token: int, logprob: float | None, top: dict[str, float] | None) -> None:
            nonlocal offset
            text = self._token(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if logprob is None else _finite(logprob))
            out["top_logprobs"].append(None if top is None else {t: _finite(lp) for t, lp in top.items()})
            out["text_offset"].append(offset)
            offset += len(text)
        if prompt is not None:
            add(handle.request.prompt_ids[0], None, None)
        for e in (prompt or []) + entries:
            add(e.token, e.logprob, {**{self._token(t): lp for t, lp in e.top}, self._token(e.token): e.logprob})
        return out

    def _completion_choice(self, i: int, handle: Handle, c: Any) -> dict[str, Any]:
        echo = handle.request.echo
        text = (self.tokenizer.decode(handle.request.prompt_ids) if echo else "") + c.text
        logprobs = self._completion_logprobs(handle, c.logprobs, c.prompt_logprobs if echo else None)
        return self._choice(i, text, c.finish_reason, False, logprobs)

    async def _sse(self, request, handles, n, rid, chat, parsed, started) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": choices}
            return f"data: {json.dumps({**body, **extra})}\n\n"

        status = 200
        async for i, d in self.events(request, handles, n, started):
            if i is None:
                status = 504
                yield f"data: {json.dumps(error_body(d, kind='timeout'))}\n\n"
            elif d.text or d.finish_reason or d.logprobs:
                h = handles[i // n]
                lp = self._chat_logprobs(h, d.logprobs) if chat else self._completion_logprobs(h, d.logprobs, None)
                yield chunk([self._choice(i, d.text, d.finish_reason, chat, lp, delta=True)])
        used = sum(c.completion_tokens for h in handles for c in h.choices)
        self.metrics.finished(status, started, prompt_tokens=parsed.prompt_tokens, completion_tokens=used)
        if parsed.include_usage:
            yield chunk([], usage=self._usage(parsed, used))
        yield "data: [DONE]\n\n"


def _decode(raw: bytes, parse: Any, tokenizer: Any, model_name: str, max_prompt_chars: int | None) -> ParsedRequest:
    """The body decoded and checked, its prompts tokenized (in a worker thread: this is the slow part)."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ServingRequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ServingRequestError("the request body is not valid JSON: it nests too deeply") from None
    return parse(body, tokenizer, model_name=model_name, max_prompt_chars=max_prompt_chars)


def build_app(engine: Engine, tokenizer: Any, *, model_name: str, timeout_s: float = 600.0,
              limits: Limits | None = None):
    """The FastAPI app serving ``engine`` (rank 0).

    Args:
        engine: the engine (its rounds run elsewhere: :func:`serve`, or a thread in tests).
        tokenizer: the model's tokenizer (prompts, chat template, text).
        model_name: the name clients pass as ``model``.
        timeout_s: a request still running after this many seconds is cancelled (504).
        limits: the API key, body and prompt limits (:class:`~.guard.Limits`; default: no key, 4 MiB, the
            most characters the model's context can hold).
    Returns:
        A ``fastapi.FastAPI``.
    """
    limits = limits or Limits()
    max_chars = limits.max_prompt_chars or prompt_char_limit(tokenizer, engine.context)
    api = _Api(engine, tokenizer, model_name, timeout_s)
    app = FastAPI(title="hf-pipeline", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(Guard, limits=limits)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "draining" if engine.draining else "ok", "queued": engine.queued,
                "running": len(engine.running), "rounds": engine.rounds, "world_size": engine.ctx.world_size}

    @app.get("/metrics")
    def metrics() -> Response:
        body, content_type = api.metrics.exposition()
        return Response(content=body, media_type=content_type)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "hf-pipeline"}]}

    async def handle(request: Request, parse, chat: bool):
        raw = await request.body()  # at most limits.max_body_bytes: the Guard refused longer ones unread
        try:
            parsed = await run_in_threadpool(_decode, raw, parse, tokenizer, model_name, max_chars)
        except ServingRequestError as e:
            return api.refused(refusal(e))
        return await api.complete(request, parsed, chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, parse_completion, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, parse_chat, chat=True)

    return app


def _listen(host: str, port: int) -> tuple[Any, str | None]:
    """A listening socket on ``host:port`` (ours, so a taken port is an error we word, not uvicorn's exit)."""
    try:
        sock = listening_socket(host, port, backlog=2048)
    except OSError as e:
        return None, f"cannot listen on {host}:{port} ({e.strerror or e}); pass a free --port or another --host"
    return sock, None


def _start_http(app, host: str, port: int) -> tuple[Any, threading.Thread | None, str | None]:
    """uvicorn in a thread (it leaves signals to the main thread); the server, its thread, and an
    error message when it could not start."""
    import uvicorn

    sock, failed = _listen(host, port)
    if failed:
        return None, None, failed
    # log_config=None: uvicorn leaves the process's logging configuration alone.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="hf-pipeline-http", daemon=True)
    thread.start()
    end = time.monotonic() + _STARTUP_S
    while not server.started and thread.is_alive() and time.monotonic() < end:
        time.sleep(0.05)
    if not server.started:
        server.should_exit = True
        return server, thread, f"the HTTP server did not start on {host}:{port} in {_STARTUP_S:g} s"
    return server, thread, None


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(engine: Engine, tokenizer: Any, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          timeout_s: float = 600.0, limits: Limits | None = None) -> None:
    """Serve until SIGTERM / SIGINT (then drain: queued requests are served, new ones get 503). Every rank.

    Args:
        engine: the engine, built on every rank.
        tokenizer / model_name / timeout_s / limits: as :func:`build_app`.
        host / port: where rank 0 listens.
    Raises:
        CLIError: on every rank, when rank 0 cannot listen on ``host:port``.
    """
    # Every rank takes SIGTERM (the launcher sends it to all): rank 0 drains, the others follow its
    # plans until the last one says stop.
    previous = {s: signal.signal(s, (lambda *_: engine.drain()) if engine.ctx.rank == 0 else signal.SIG_IGN)
                for s in (signal.SIGTERM, signal.SIGINT)}
    server = thread = None
    try:
        if engine.ctx.rank == 0:
            app = build_app(engine, tokenizer, model_name=model_name, timeout_s=timeout_s, limits=limits)
            server, thread, failed = _start_http(app, host, port)
            if failed:
                engine.stop_with_error(failed)
                raise CLIError(failed)
            print(f"serving {model_name} on http://{host}:{port}/v1 ({engine.ctx.world_size} process(es))",
                  flush=True)
            if (limits is None or limits.api_key is None) and not _loopback(host):
                log.warning("serving on %s without an API key: anyone who reaches the port can use the model "
                            "(pass --api-key or set %s)", host, API_KEY_ENV)
        engine.serve_forever()
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(timeout=10)
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("stopped serving")
