"""``hf-pipeline serve``: an OpenAI-compatible HTTP server over a pipelined model (every rank runs it)."""

from __future__ import annotations

import importlib
import os
import pathlib

from ..errors import CLIError
from .arguments import load_config, load_kwargs, load_tokenizer, local_path, model_path

__all__ = ["check_serve_extra", "cmd_serve"]


# What `hf-pipeline serve` imports beyond the package's own dependencies: the `serve` extra.
_SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def check_serve_extra() -> None:
    """One line naming the extra to install when FastAPI, uvicorn or prometheus_client cannot be imported
    (before anything loads).

    Raises:
        CLIError: ``hf-pipeline serve needs fastapi, uvicorn and prometheus_client (...): pip install
        'hf_pipeline[serve]'``.
    """
    missing = []
    for name in _SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise CLIError(
            f"hf-pipeline serve needs fastapi, uvicorn and prometheus_client ({' and '.join(missing)} cannot be "
            f"imported): "
            "pip install 'hf_pipeline[serve]'"
        )


def cmd_serve(args) -> int:
    """``hf-pipeline serve PATH``: load the model on every rank, listen on rank 0 until SIGTERM."""
    check_serve_extra()  # before the server module imports fastapi
    import hf_pipeline
    from hf_pipeline.serving import Engine
    from hf_pipeline.serving.guard import API_KEY_ENV, Limits
    from hf_pipeline.serving.server import serve

    # The key's variable set but empty counts as unset (`export HF_PIPELINE_API_KEY=`); an empty --api-key is refused.
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    limits = Limits(api_key=key, max_body_bytes=args.max_body_mb * 2**20, max_prompt_chars=args.max_prompt_chars)
    path = local_path(args.path, args.download) if args.path is not None else model_path(args)
    if load_config(path).is_encoder_decoder:
        raise CLIError(f"{args.path or path} is an encoder-decoder model; serve serves causal LMs")
    tok = load_tokenizer(path)
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False, **load_kwargs(args))
    name = args.served_model_name or pathlib.Path(args.path or path).name
    budget = None if args.kv_cache_mb is None else args.kv_cache_mb * 2**20
    engine = Engine(model, tok, max_batch=args.max_batch, max_queue=args.max_queue, max_n=args.max_n,
                    batching=args.batching, kv_cache_bytes=budget, prefill_chunk=args.prefill_chunk,
                    prefix_cache=args.prefix_cache)
    serve(engine, tok, model_name=name, host=args.host, port=args.port, timeout_s=args.request_timeout,
          limits=limits)
    return 0
