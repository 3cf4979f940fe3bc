"""OpenAI request bodies, checked field by field, turned into :class:`CompletionRequest` s.

Each field is a row of :data:`FIELDS` (its accepted types and default); fields the engine cannot
honour are the rows of :data:`UNSUPPORTED` (what values are refused). A refusal is a
:class:`~hf_pipeline.errors.ServingRequestError` whose ``param`` names the field, which the server
turns into OpenAI's 400 error object.

Example:
    >>> body = {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    >>> parsed = parse_completion(body, tokenizer, model_name="m")   # prompts, request options, stream
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ServingRequestError
from .handles import CompletionRequest

__all__ = ["FIELDS", "UNSUPPORTED", "ParsedRequest", "error_body", "parse_chat", "parse_completion"]

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
}
# field -> (refused when, what to do instead)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "logprobs": (lambda v: v not in (None, False, 0), "logprobs are not supported; leave logprobs out"),
    "top_logprobs": (lambda v: v not in (None, 0), "top_logprobs are not supported; leave it out"),
    "echo": (lambda v: v not in (None, False), "echo is not supported; leave it out"),
    "suffix": (lambda v: v is not None, "suffix is not supported; leave it out"),
    "best_of": (lambda v: v not in (None, 1), "best_of is not supported; use n"),
    "logit_bias": (lambda v: bool(v), "logit_bias is not supported; leave it out"),
    "presence_penalty": (lambda v: v not in (None, 0, 0.0), "presence_penalty is not supported; leave it out"),
    "frequency_penalty": (lambda v: v not in (None, 0, 0.0), "frequency_penalty is not supported; leave it out"),
    "tools": (lambda v: bool(v), "tools are not supported; leave them out"),
    "response_format": (lambda v: v not in (None, {"type": "text"}), "response_format is not supported"),
}


@dataclass(kw_only=True)
class ParsedRequest:
    """A checked body: one engine request per prompt, and whether to stream."""

    requests: list[CompletionRequest]
    stream: bool
    include_usage: bool
    prompt_tokens: int


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _field(body: dict[str, Any], name: str) -> Any:
    types, default = FIELDS[name]
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        wanted = " or ".join("number" if t is float else t.__name__ for t in types)
        raise ServingRequestError(f"{name} must be a {wanted}, got {type(value).__name__}", param=name)
    return value


def _common(body: Any, model_name: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ServingRequestError("the request body must be a JSON object")
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
    max_tokens = _field(body, "max_completion_tokens") or _field(body, "max_tokens")
    options = _field(body, "stream_options") or {}
    return {
        "options": {
            "max_new_tokens": max_tokens, "temperature": float(_field(body, "temperature")),
            "top_p": float(_field(body, "top_p")), "stop": stop, "seed": _field(body, "seed"), "n": _field(body, "n"),
        },
        "stream": _field(body, "stream"), "include_usage": bool(options.get("include_usage")),
    }


def _build(prompts: list[list[int]], common: dict[str, Any]) -> ParsedRequest:
    requests = [CompletionRequest(prompt_ids=p, stream=common["stream"], **common["options"]) for p in prompts]
    return ParsedRequest(requests=requests, stream=common["stream"], include_usage=common["include_usage"],
                         prompt_tokens=sum(len(p) for p in prompts))


def _prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """``prompt`` as OpenAI takes it: a string, a list of strings, a list of ids or a list of id lists."""
    def ids(p: Any) -> list[int]:
        if isinstance(p, str):
            return list(tokenizer(p)["input_ids"])
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise ServingRequestError("prompt must be a string, a list of strings or a list of token ids",
                                  param="prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [ids(prompt)]
    if isinstance(prompt, list) and prompt:
        return [ids(p) for p in prompt]
    if isinstance(prompt, str):
        return [ids(prompt)]
    raise ServingRequestError("prompt is required: a string, a list of strings or a list of token ids",
                              param="prompt")


def parse_completion(body: Any, tokenizer: Any, *, model_name: str) -> ParsedRequest:
    """``POST /v1/completions``'s body, checked.

    Returns:
        A :class:`ParsedRequest` (one engine request per prompt).
    Raises:
        ServingRequestError: naming the field to change.
    """
    common = _common(body, model_name)
    return _build(_prompts(body.get("prompt"), tokenizer), common)


def parse_chat(body: Any, tokenizer: Any, *, model_name: str) -> ParsedRequest:
    """``POST /v1/chat/completions``'s body, checked; the messages go through the tokenizer's chat template.

    Raises:
        ServingRequestError: naming the field to change (``messages`` when the tokenizer has no chat template).
    """
    common = _common(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ServingRequestError("messages must be a non-empty list of {role, content} objects with string content",
                                  param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ServingRequestError(
            f"the tokenizer of {model_name!r} has no chat template: use /v1/completions, or serve a model whose "
            "tokenizer_config.json has a chat_template", param="messages",
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return _build([list(ids)], common)
