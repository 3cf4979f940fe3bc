"""Serving: a request engine over the pipelined ``generate`` and an OpenAI-compatible HTTP API.

Lives here: :mod:`.handles` (a request and the handle its tokens arrive on),
:mod:`.scheduler` (which queued requests share a static round), :mod:`.channel` (plans from rank 0
to every rank as JSON, tokens back to rank 0), :mod:`.engine` (the queue and the rounds, on every
rank), :mod:`.protocol` (OpenAI request bodies checked and turned into requests), :mod:`.guard`
(what the HTTP server lets in: the API key, the body limit, an OpenAI error object for every
failure) and :mod:`.server` (the FastAPI app and uvicorn on rank 0; FastAPI is imported only by
these two (the CLI imports them when serving), so the engine needs no web stack).

May import: the base modules and every room below the model facade (``distributed`` up to ``tools``;
continuous batching, the ring with its feeder, slot pool and KV budget, is
:mod:`hf_pipeline.continuous_batching`, which the engine wires to its queue). It talks to the model
through its public methods (``generate``, ``config``, ``ctx``), the ring through its stages and plan,
and wraps a ring session in the model's failure spreading (``model.spreading_failures``) as ``generate`` is.
"""

from .engine import Engine
from .handles import Choice, CompletionRequest, Delta, Handle
from .scheduler import StaticBatcher

__all__ = ["Choice", "CompletionRequest", "Delta", "Engine", "Handle", "StaticBatcher"]
