"""What the HTTP server lets in, and how it says no: the API key, the request-body limit, and OpenAI's
error object for every failure, 500s included.

:class:`Limits` holds the settings (``--api-key`` or ``HF_PIPELINE_API_KEY``, ``--max-body-mb``,
``--max-prompt-chars``). :class:`Guard` is an ASGI middleware in front of every route: with a key set,
every route but ``/health`` answers 401 unless the request sends ``Authorization: Bearer KEY``
(compared in constant time); a body over the limit answers 413 before it is parsed (a
``Content-Length`` over it before a byte is read). :func:`install_error_handlers` turns every other
failure into OpenAI's error object: 400 for a refused request (the field in ``param``), 429 / 503
when busy, 404 / 405 for a route or method that does not exist, and 500 (the traceback in the
server's log, only the exception's class in the answer) for anything unforeseen.

Example:
    >>> app = FastAPI()
    >>> install_error_handlers(app)
    >>> app.add_middleware(Guard, limits=Limits(api_key="s3cret", max_body_bytes=2**20))
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from ..errors import InputError, ServerBusy, ServingRequestError
from .protocol import error_body

__all__ = ["API_KEY_ENV", "OPEN_PATHS", "Guard", "Limits", "error_response", "install_error_handlers", "refusal"]

API_KEY_ENV = "HF_PIPELINE_API_KEY"  # the key when --api-key is not given (as vLLM's VLLM_API_KEY)
OPEN_PATHS = frozenset({"/health"})  # answered without the key: load balancers and probes ask it
DEFAULT_MAX_BODY_BYTES = 4 * 2**20


@dataclass(kw_only=True)
class Limits:
    """What the server lets in.

    Attributes:
        api_key: the key every route but ``/health`` needs (``Authorization: Bearer KEY``); None: none.
        max_body_bytes: a request body over this is answered 413 before it is parsed.
        max_prompt_chars: a prompt (or all chat messages together) over this many characters is answered
            400 before it is tokenized; None: :func:`~.protocol.prompt_char_limit` of the model's context.
    """

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise InputError(
                f"the API key is empty; pass a non-empty --api-key (or {API_KEY_ENV}), or leave both out to serve "
                "without one"
            )
        for name in ("max_body_bytes", "max_prompt_chars"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_chars":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a whole number >= 1, got {value!r}")


def error_response(status: int, message: str, param: str | None = None, kind: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error object with ``status`` (``kind``: invalid_request_error below 500, server_error from it)."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, param, kind, code), status_code=status, headers=headers)


def refusal(e: ServingRequestError | ServerBusy) -> JSONResponse:
    """A request the engine refused: 400 naming the field, 429 with the queue full, 503 while draining."""
    if isinstance(e, ServerBusy):
        return error_response(503 if e.draining else 429, str(e), kind="server_error" if e.draining
                              else "rate_limit_error")
    return error_response(400, str(e), getattr(e, "param", None))


# ------------------------------------------------------------------------------------ the middleware
Receive = Callable[[], Awaitable[dict[str, Any]]]


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that hands the app the body already read, then passes on (a client's disconnect)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class Guard:
    """ASGI middleware: the API key on every route but :data:`OPEN_PATHS`, then the body limit.

    Args:
        app: the ASGI app behind it.
        limits: the :class:`Limits` to hold requests to.
    """

    def __init__(self, app: Any, *, limits: Limits):
        self.app, self.limits = app, limits
        self.key = None if limits.api_key is None else limits.api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # ASGI header names are lower case bytes
        refused = self._unauthorized(scope["path"], headers.get(b"authorization"))
        body = None
        if refused is None:
            body, refused = await self._read_body(headers.get(b"content-length"), receive)
        if refused is not None:
            await refused(scope, receive, send)
        elif body is not None:  # None: the client left while sending it
            await self.app(scope, _replay(body, receive), send)

    def _unauthorized(self, path: str, header: bytes | None) -> JSONResponse | None:
        if self.key is None or path in OPEN_PATHS:
            return None
        scheme, _, token = (header or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return None
        message = ("this server needs an API key: send the header `Authorization: Bearer <key>`" if header is None
                   else "the API key is wrong (the header is `Authorization: Bearer <key>`)")
        return error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, length: bytes | None, receive: Receive) -> tuple[bytes | None, JSONResponse | None]:
        """The whole body, or the refusal when it is over the limit (said by its length before reading it)."""
        limit = self.limits.max_body_bytes
        too_large = error_response(
            413, f"the request body is over {limit} bytes, the most this server takes (--max-body-mb); send a "
            "shorter prompt, or start the server with a larger --max-body-mb")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return None, error_response(400, f"the Content-Length header is not a number: {length[:40]!r}")
            if declared > limit:
                return None, too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None, too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


# ------------------------------------------------------------------------------------ error objects
async def _refused(request: Any, e: Exception) -> JSONResponse:
    return refusal(e)  # type: ignore[arg-type]


async def _http_error(request: Any, e: HTTPException) -> JSONResponse:
    return error_response(e.status_code, f"{e.detail} ({request.method} {request.url.path})", headers=e.headers)


async def _invalid(request: Any, e: RequestValidationError) -> JSONResponse:
    first = (e.errors() or [{}])[0]
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    return error_response(400, f"the request is not valid: {first.get('msg', e)}", param=where)


async def _failed(request: Any, e: Exception) -> JSONResponse:
    # The server's log gets the traceback (Starlette raises the exception on after this answer); the
    # client only the class, not the message (it may hold paths of this machine).
    return error_response(500, f"the server failed on this request ({type(e).__name__}); its log has the traceback")


def install_error_handlers(app: Any) -> None:
    """Make every failure of ``app`` OpenAI's error object (the module docstring lists them)."""
    app.add_exception_handler(ServingRequestError, _refused)
    app.add_exception_handler(ServerBusy, _refused)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, _failed)
