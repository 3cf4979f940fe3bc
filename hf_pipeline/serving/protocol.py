"""OpenAI request bodies, checked field by field, turned into :class:`CompletionRequest` s.

Each field is a row of :data:`FIELDS` (its accepted types and default) or of one endpoint's
:data:`ENDPOINT_FIELDS`; fields the engine cannot honour are the rows of :data:`UNSUPPORTED` (what values
are refused); any other field is refused, every unknown one named, as OpenAI refuses them; the counts
OpenAI refuses below 1 are :data:`AT_LEAST_ONE`. Chat content may be a list of text parts.
``response_format`` (json_object, json_schema) becomes an llguidance grammar here, so a bad one is refused
before the request is queued (:mod:`hf_pipeline.generation.grammar`).
A refusal is a :class:`~hf_pipeline.errors.ServingRequestError` whose
``param`` names the field, which the server turns into OpenAI's 400 error object. A prompt (or the
chat messages) longer than ``max_prompt_chars`` is refused before the tokenizer sees it
(:func:`prompt_char_limit`: no longer prompt can fit the context).

Example:
    >>> body = {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    >>> parsed = parse_completion(body, tokenizer, model_name="m")   # prompts, request options, stream
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InputError, ServingRequestError
from ..generation.grammar import json_grammar
from .handles import CompletionRequest

__all__ = ["AT_LEAST_ONE", "ENDPOINT_FIELDS", "FIELDS", "UNSUPPORTED", "ParsedRequest", "error_body", "parse_chat",
           "parse_completion", "prompt_char_limit"]

_NUMBER = (int, float)
# field -> (accepted types, default); OpenAI's defaults (temperature 1, max_tokens 16 for completions).
FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "model": ((str,), None),
    "max_tokens": ((int,), 16),
    "max_completion_tokens": ((int,), None),
    "temperature": (_NUMBER, 1.0),
    "top_p": (_NUMBER, 1.0),
    "n": ((int,), 1),
    "stop": ((str, list), None),
    "seed": ((int,), None),
    "stream": ((bool,), False),
    "stream_options": ((dict,), None),
    "user": ((str,), None),
    # vLLM's extensions (lm-eval and guidellm send them): generate exactly max_tokens; no EOS before min_tokens.
    "ignore_eos": ((bool,), False),
    "min_tokens": ((int,), 0),
    "presence_penalty": (_NUMBER, 0.0),
    "frequency_penalty": (_NUMBER, 0.0),
    "repetition_penalty": (_NUMBER, 1.0),  # vLLM's extension: transformers' repetition penalty
    "logit_bias": ((dict,), None),
    # JSON modes (json_object, json_schema) through llguidance: :mod:`hf_pipeline.generation.grammar`.
    "response_format": ((dict,), None),
}
# Fields one endpoint takes besides FIELDS and UNSUPPORTED (an unknown field is refused, as OpenAI does).
ENDPOINT_FIELDS: dict[str, frozenset[str]] = {
    "completions": frozenset({"prompt", "suffix", "echo", "best_of", "logprobs"}),
    "chat": frozenset({"messages", "logprobs", "top_logprobs", "tools"}),
}
# field -> (refused when, what to do instead)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "suffix": (lambda v: v is not None, "suffix is not supported; leave it out"),
    "best_of": (lambda v: v not in (None, 1), "best_of is not supported; use n"),
    "tools": (lambda v: bool(v), "tools are not supported; leave them out"),
}
# Counts OpenAI answers 400 below 1 (a 0 must not fall back to the default).
AT_LEAST_ONE = ("max_tokens", "max_completion_tokens", "n")


@dataclass(kw_only=True)
class ParsedRequest:
    """A checked body: one engine request per prompt, and whether to stream."""

    requests: list[CompletionRequest]
    stream: bool
    include_usage: bool
    prompt_tokens: int


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def prompt_char_limit(tokenizer: Any, context: int | None) -> int | None:
    """The most characters a prompt can have and still fit ``context`` tokens: ``context`` times the
    longest entry of the tokenizer's vocabulary (a token stands for at most that many characters; a
    byte-level vocabulary writes one character per byte). None when the context is unknown."""
    if context is None:
        return None
    try:
        longest = max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: a generous bound
        longest = 64
    return context * max(longest, 1)


def _check_chars(chars: int, limit: int | None, param: str) -> None:
    if limit is not None and chars > limit:
        raise ServingRequestError(
            f"the {param} holds {chars} characters, more than this server takes ({limit}: --max-prompt-chars, "
            "by default the most that can fit the model's context); shorten it", param=param,
        )


def _field(body: dict[str, Any], name: str) -> Any:
    types, default = FIELDS[name]
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        wanted = " or ".join("number" if t is float else t.__name__ for t in types)
        raise ServingRequestError(f"{name} must be a {wanted}, got {type(value).__name__}", param=name)
    return value


def _check_names(body: dict[str, Any], endpoint: str) -> None:
    """Unknown fields refused, all named (OpenAI: "Unrecognized request argument supplied")."""
    known = FIELDS.keys() | UNSUPPORTED.keys() | ENDPOINT_FIELDS[endpoint]
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise ServingRequestError(
            f"Unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: {', '.join(unknown)} "
            f"(this server takes: {', '.join(sorted(known))})", param=unknown[0],
        )
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise ServingRequestError("stream_options is only allowed when stream is true; set stream: true or leave "
                                  "stream_options out", param="stream_options")


def _grammar(body: dict[str, Any]) -> str | None:
    """``response_format`` as an llguidance grammar (None for text), checked before the request is queued."""
    try:
        return json_grammar(_field(body, "response_format"))
    except InputError as e:
        raise ServingRequestError(str(e), param="response_format") from None


def _common(body: Any, model_name: str, endpoint: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ServingRequestError("the request body must be a JSON object")
    _check_names(body, endpoint)
    for name, (refused, why) in UNSUPPORTED.items():
        if name in body and refused(body[name]):
            raise ServingRequestError(why, param=name)
    model = _field(body, "model")
    if model is None:
        raise ServingRequestError("model is required; GET /v1/models lists the one served", param="model")
    if model != model_name:
        raise ServingRequestError(f"model {model!r} is not served here; use {model_name!r}", param="model")
    stop = _field(body, "stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ServingRequestError("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    for name in AT_LEAST_ONE:
        least = 0 if name == "max_tokens" and body.get("echo") is True else 1  # echo alone: the prompt's logprobs
        if (value := _field(body, name)) is not None and value < least:
            raise ServingRequestError(f"{name} must be >= {least}, got {value}", param=name)
    max_tokens = _field(body, "max_completion_tokens")
    max_tokens = _field(body, "max_tokens") if max_tokens is None else max_tokens
    options = _field(body, "stream_options") or {}
    min_tokens = _field(body, "min_tokens")
    if not 0 <= min_tokens <= max_tokens:
        raise ServingRequestError(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}",
                                  param="min_tokens")
    return {
        "options": {
            "max_new_tokens": max_tokens, "temperature": float(_field(body, "temperature")),
            "top_p": float(_field(body, "top_p")), "stop": stop, "seed": _field(body, "seed"), "n": _field(body, "n"),
            "ignore_eos": _field(body, "ignore_eos"), "min_tokens": min_tokens,
            **{k: float(_field(body, k)) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")},
            "logit_bias": _field(body, "logit_bias") or {}, "grammar": _grammar(body),
        },
        "stream": _field(body, "stream"), "include_usage": bool(options.get("include_usage")),
    }


def _build(prompts: list[list[int]], common: dict[str, Any]) -> ParsedRequest:
    requests = [CompletionRequest(prompt_ids=p, stream=common["stream"], **common["options"]) for p in prompts]
    return ParsedRequest(requests=requests, stream=common["stream"], include_usage=common["include_usage"],
                         prompt_tokens=sum(len(p) for p in prompts))


def _prompts(prompt: Any, tokenizer: Any, max_chars: int | None) -> list[list[int]]:
    """``prompt`` as OpenAI takes it: a string, a list of strings, a list of ids or a list of id lists;
    every one checked (a string's length too) before any is tokenized."""
    def checked(p: Any) -> Any:
        if isinstance(p, str):
            _check_chars(len(p), max_chars, "prompt")
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise ServingRequestError("prompt must be a string, a list of strings or a list of token ids",
                                  param="prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [checked(prompt)]
    elif isinstance(prompt, list) and prompt:
        prompts = [checked(p) for p in prompt]
    elif isinstance(prompt, str):
        prompts = [checked(prompt)]
    else:
        raise ServingRequestError("prompt is required: a string, a list of strings or a list of token ids",
                                  param="prompt")
    return [list(tokenizer(p)["input_ids"]) if isinstance(p, str) else p for p in prompts]


def parse_completion(body: Any, tokenizer: Any, *, model_name: str, max_prompt_chars: int | None = None
                     ) -> ParsedRequest:
    """``POST /v1/completions``'s body, checked (``max_prompt_chars``: longer prompts are refused untokenized).

    Returns:
        A :class:`ParsedRequest` (one engine request per prompt).
    Raises:
        ServingRequestError: naming the field to change.
    """
    common = _common(body, model_name, "completions")
    logprobs, echo = body.get("logprobs"), body.get("echo", False)
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)):
        raise ServingRequestError("logprobs must be an integer (the alternatives per token, 0..20) for "
                                  "/v1/completions", param="logprobs")
    if not isinstance(echo, bool) and echo is not None:
        raise ServingRequestError("echo must be a boolean", param="echo")
    if echo and logprobs is None:
        raise ServingRequestError("echo is served with logprobs (the prompt's token log-probabilities); pass "
                                  "logprobs too", param="echo")
    if echo and common["stream"]:
        raise ServingRequestError("echo is not served with stream: true; leave one out", param="echo")
    common["options"].update(logprobs=logprobs, echo=bool(echo))
    return _build(_prompts(body.get("prompt"), tokenizer, max_prompt_chars), common)


def _template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template raises for messages it refuses (its ``raise_exception``): jinja2's TemplateError."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # no jinja2: transformers cannot apply a template at all, nothing to catch
        return ()
    return (TemplateError,)


def _text_content(content: Any, i: int) -> str:
    """A message's content as one string: a string, or a list of text parts joined as OpenAI does (with
    no separator); any other part is refused, naming its type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise ServingRequestError(f"messages[{i}].content must be a string or a list of content parts",
                                  param="messages")
    for p in content:
        if p.get("type") != "text":
            raise ServingRequestError(
                f"messages[{i}] holds a content part of type {p.get('type')!r}: this server takes text parts "
                "only ({\"type\": \"text\", \"text\": ...})", param="messages",
            )
        if not isinstance(p.get("text"), str):
            raise ServingRequestError(f"messages[{i}] holds a text part whose text is not a string", param="messages")
    return "".join(p["text"] for p in content)


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The chat messages, each content made one string (the form every chat template reads)."""
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
    ):
        raise ServingRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    return [{**m, "content": _text_content(m["content"], i)} for i, m in enumerate(messages)]


def parse_chat(body: Any, tokenizer: Any, *, model_name: str, max_prompt_chars: int | None = None
               ) -> ParsedRequest:
    """``POST /v1/chat/completions``'s body, checked; the messages go through the tokenizer's chat template
    (``max_prompt_chars``: longer messages, all together, are refused before it).

    Raises:
        ServingRequestError: naming the field to change (``messages`` when the tokenizer has no chat
            template, or the template refuses the messages: its ``raise_exception``).
    """
    common = _common(body, model_name, "chat")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ServingRequestError("logprobs must be a boolean for /v1/chat/completions", param="logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not logprobs):
        raise ServingRequestError("top_logprobs must be an integer (0..20), with logprobs: true", param="top_logprobs")
    common["options"]["logprobs"] = (top or 0) if logprobs else None
    messages = _messages(body.get("messages"))
    if not getattr(tokenizer, "chat_template", None):
        raise ServingRequestError(
            f"the tokenizer of {model_name!r} has no chat template: use /v1/completions, or serve a model whose "
            "tokenizer_config.json has a chat_template", param="messages",
        )
    _check_chars(sum(len(m["content"]) for m in messages), max_prompt_chars, "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except _template_errors() as e:
        raise ServingRequestError(f"the model's chat template refused the messages: {e}", param="messages") from e
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return _build([list(ids)], common)
