"""A request to the serving engine, and the handle its caller reads the completion from as it grows.

Example:
    >>> handle = engine.submit(CompletionRequest(prompt_ids=[1, 5, 9], max_new_tokens=8))
    >>> for delta in handle:                       # blocks until the next tokens arrive
    ...     print(delta.index, delta.text, delta.finish_reason)
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Sequence

from ..errors import ServingRequestError
from ..generation.logprobs import TokenLogprob

__all__ = ["Choice", "CompletionRequest", "Delta", "Handle"]

MAX_LOGPROBS = 20  # top alternatives per token at most (vLLM's default max_logprobs; OpenAI's chat limit)


@dataclass(kw_only=True)
class CompletionRequest:
    """One completion request: a tokenized prompt and how to continue it.

    Attributes:
        prompt_ids: the prompt's token ids (not empty).
        max_new_tokens: tokens to generate at most per choice.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_p: nucleus sampling (with temperature > 0).
        stop: strings that end a choice; the text stops before the first one found.
        stop_token_ids: token ids that end a choice, besides the model's EOS.
        seed: sampling seed; a seeded request runs in a generate call of its own, so its tokens
            depend on its seed alone, not on the requests it was queued with.
        n: choices to generate for the prompt (sampling only: greedy choices would be equal).
        stream: hand tokens over as they are chosen; False: at the end of the round (a round with no
            streamed request skips the per-step hand-over from the last stage, which costs it time).
        ignore_eos: EOS does not end a choice (vLLM's extension): it runs to ``max_new_tokens`` or a stop.
        min_tokens: no EOS (nor a ``stop_token_ids`` id) before this many tokens (transformers'
            ``MinNewTokensLengthLogitsProcessor``).
        logprobs: None, or the log-probability of each chosen token with this many top alternatives (0..20).
        echo: also the prompt's token log-probabilities (with ``logprobs``); ``max_new_tokens`` may then be 0.
        presence_penalty / frequency_penalty: OpenAI's, in [-2, 2]; repetition_penalty: transformers' (> 0);
        logit_bias: {token id: bias in [-100, 100]} (:mod:`hf_pipeline.generation.penalties`).
        grammar: None, or the llguidance grammar every choice follows (``response_format``,
            :func:`~hf_pipeline.generation.grammar.json_grammar`); it decides where a choice ends, so not
            with ``min_tokens``.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    n: int = 1
    stream: bool = True
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(int(t) for t in self.stop_token_ids)
        if not self.prompt_ids:
            raise ServingRequestError("the prompt is empty; pass at least one token", param="prompt")
        least = 0 if self.echo else 1  # echo with max_tokens 0: the prompt's log-probabilities alone
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < least:
            raise ServingRequestError(f"max_tokens must be >= {least}, got {self.max_new_tokens}", param="max_tokens")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ServingRequestError(f"min_tokens must be in [0, max_tokens={self.max_new_tokens}], got "
                                      f"{self.min_tokens}", param="min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ServingRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                                      param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ServingRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        if not 0 < self.repetition_penalty <= 10:
            raise ServingRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                                      param="repetition_penalty")
        try:
            self.logit_bias = {int(t): float(b) for t, b in dict(self.logit_bias).items()}
        except (TypeError, ValueError):
            raise ServingRequestError("logit_bias maps token ids to numbers", param="logit_bias") from None
        if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            raise ServingRequestError("logit_bias values must be in [-100, 100]", param="logit_bias")
        if self.grammar is not None and self.min_tokens:
            raise ServingRequestError("min_tokens is not served with response_format (the grammar decides where "
                                      "the answer ends, with EOS); leave min_tokens out", param="min_tokens")
        if self.echo and self.logprobs is None:
            raise ServingRequestError("echo needs logprobs (the prompt's log-probabilities come with them); "
                                      "pass logprobs", param="echo")
        if not 0 <= self.temperature <= 2:
            raise ServingRequestError(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if not 0 < self.top_p <= 1:
            raise ServingRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not isinstance(self.n, int) or self.n < 1:
            raise ServingRequestError(f"n must be >= 1, got {self.n}", param="n")
        if self.n > 1 and self.temperature == 0:
            # transformers refuses num_return_sequences > 1 without sampling: every choice would be the same.
            raise ServingRequestError(
                f"n={self.n} needs sampling (temperature > 0): greedy choices would all be equal", param="n"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ServingRequestError("stop must hold non-empty strings", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class _LoopWaker:
    """Sets asyncio events of one event loop from the engine's thread, with one loop callback for all the events set
    before the loop ran it: an op's tokens for several requests wake the loop once, not once a token (each wake is
    a write to the loop's pipe, and the loop thread then takes the interpreter from the engine's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._events: list[asyncio.Event] = []

    def wake(self, event: asyncio.Event) -> None:
        with self._lock:
            self._events.append(event)
            if len(self._events) > 1:
                return  # a callback is scheduled and has not run yet: it sets this one too
        try:
            self.loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the loop closed (its server stopped): nobody waits on it any more
            with self._lock:
                self._events.clear()

    def _set(self) -> None:
        with self._lock:
            events, self._events = self._events, []
        for event in events:
            event.set()


_wakers: dict[asyncio.AbstractEventLoop, _LoopWaker] = {}
_wakers_lock = threading.Lock()


def _waker(loop: asyncio.AbstractEventLoop) -> _LoopWaker:
    with _wakers_lock:
        for closed in [lp for lp in _wakers if lp.is_closed()]:
            del _wakers[closed]
        if loop not in _wakers:
            _wakers[loop] = _LoopWaker(loop)
        return _wakers[loop]


@dataclass(kw_only=True)
class Choice:
    """One choice of a request as far as it has come: its token ids (without the stop token) and the
    text a reader may see (the decoded tokens up to a stop string, holding back a tail that may still
    become one).

    ``completion_tokens`` counts every token generated, the stop token included (OpenAI's usage);
    ``logprobs`` has one entry per generated token, the stop token included (when asked for);
    ``prompt_logprobs`` one per prompt token after the first (``echo``)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(kw_only=True)
class Delta:
    """What one choice gained since the reader last looked: new token ids, new text, and its
    ``finish_reason`` once it is done."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Handle:
    """The caller's side of a submitted request: iterate it (threads) or ``async for`` over
    :meth:`deltas` (asyncio) to get :class:`Delta` s as tokens arrive; :meth:`result` waits for all.

    The engine writes, under one lock; every reader keeps its own cursor, so several readers (a
    stream and a log) each see every delta once.
    """

    def __init__(self, request: CompletionRequest, request_id: str):
        self.request, self.id = request, request_id
        self.choices = [Choice() for _ in range(request.n)]
        self.error: str | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[_LoopWaker, asyncio.Event]] = []

    # -------------------------------------------------------------- engine side
    def update(self, fn: Any) -> None:
        """Run ``fn(choices)`` under the lock, then wake every reader."""
        with self._cond:
            fn(self.choices)
            self._cond.notify_all()
            waiters = list(self._waiters)
        for waker, event in waiters:
            waker.wake(event)

    def fail(self, message: str, reason: str = "error") -> None:
        """End every unfinished choice with ``reason`` (``error``: ``message`` says why)."""
        def end(choices: list[Choice]) -> None:
            if reason == "error":
                self.error = message
            for c in choices:
                c.finish_reason = c.finish_reason or reason
        self.update(end)

    def cancel(self) -> None:
        """Stop producing tokens for this request: dropped from the queue, or from its round's output."""
        self.fail("cancelled", reason="cancelled")

    # -------------------------------------------------------------- reader side
    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def cancelled(self) -> bool:
        return any(c.finish_reason == "cancelled" for c in self.choices)

    def _deltas_since(self, cursor: list[tuple[int, int, bool, int]]) -> list[Delta]:
        out = []
        for i, c in enumerate(self.choices):
            n_ids, n_text, ended, n_lp = cursor[i]
            if ended or (len(c.token_ids) == n_ids and len(c.text) == n_text and c.finish_reason is None):
                continue
            out.append(Delta(index=i, token_ids=c.token_ids[n_ids:], text=c.text[n_text:],
                             finish_reason=c.finish_reason, logprobs=c.logprobs[n_lp:]))
            cursor[i] = (len(c.token_ids), len(c.text), c.finish_reason is not None, len(c.logprobs))
        return out

    def __iter__(self) -> Iterator[Delta]:
        cursor = [(0, 0, False, 0)] * len(self.choices)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.done or bool(self._peek(cursor)))
                deltas, done = self._deltas_since(cursor), self.done
            yield from deltas
            if done:
                return

    def _peek(self, cursor: list[tuple[int, int, bool, int]]) -> bool:
        return any(not e and (len(c.token_ids) != n or len(c.text) != t)
                   for c, (n, t, e, _) in zip(self.choices, cursor))

    async def deltas(self, poll_s: float = 0.5) -> AsyncIterator[list[Delta]]:
        """Async batches of deltas as they come; an empty batch every ``poll_s`` seconds without news
        (so the caller can check its client and its deadline)."""
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        waiter = (_waker(loop), event)
        with self._cond:
            self._waiters.append(waiter)
        cursor = [(0, 0, False, 0)] * len(self.choices)
        try:
            while True:
                event.clear()
                with self._cond:
                    deltas, done = self._deltas_since(cursor), self.done
                yield deltas
                if done:
                    return
                if not event.is_set():
                    # A timer that sets the event, not ``wait_for``: that made a task per wait, per token streamed.
                    timer = loop.call_later(poll_s, event.set)
                    try:
                        await event.wait()
                    finally:
                        timer.cancel()
        finally:
            with self._cond:
                self._waiters.remove(waiter)

    def result(self, timeout: float | None = None) -> list[Choice]:
        """Wait until every choice is done (at most ``timeout`` seconds) and return the choices."""
        with self._cond:
            self._cond.wait_for(lambda: self.done, timeout)
            return [Choice(token_ids=list(c.token_ids), text=c.text, finish_reason=c.finish_reason,
                           completion_tokens=c.completion_tokens, logprobs=list(c.logprobs),
                           prompt_logprobs=c.prompt_logprobs) for c in self.choices]
