"""Adapter steps agreed between ranks: the same adapter everywhere, and one error on every rank when a step fails.

Each rank injects into and loads only its own stages, so a bad adapter fails on the rank whose stage
reads the bad part (a wrong-shaped tensor of layer 0, a module only the last stage holds) while the
others go on, and a different adapter folder on each rank would load silently as a mix of two. So:

* before injecting, the adapter config is compared across ranks (:func:`agree_on_config`), and before
  loading, the adapter's files by content (:func:`agree_on_files`: a hash of ``adapter_config.json`` and
  of the weight file, never the path), through :func:`~hf_pipeline.distributed.agreement.check_same_on_all_ranks`;
* the per-rank step runs inside :func:`agreed`: a failure on any rank becomes :class:`AdapterError` on
  every rank, naming the failing rank and its cause, and no rank is left waiting in a later collective;
* what the stages' sharding cannot adapt is refused by name at injection (:func:`refuse_tensor_parallel`):
  what ``peft_tensor_parallel.py`` does not take under tensor parallelism (FSDP's rules: ``peft_fsdp.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
from typing import Any

from ..core import PipelineCore
from ..distributed.agreement import check_same_on_all_ranks, is_lost_peer_error, raise_on_any_rank
from ..errors import AdapterError, PipelineError, RankError
from .peft_tensor_parallel import refuse_unsupported

__all__ = ["agree_on_config", "agree_on_files", "agreed", "refuse_tensor_parallel"]

_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_CHUNK = 1 << 20
_SAME_ADAPTER = "Pass the same adapter (the same folder contents and arguments) on every rank"
# Set by peft from the base model's path, which may be a rank-local copy: not part of what the adapter is.
_LOCAL_FIELDS = ("base_model_name_or_path",)


def _plain(value: Any) -> Any:
    """A config value compared the same on every rank: sets (peft's ``target_modules``) sorted."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def refuse_tensor_parallel(model: PipelineCore, config: Any = None) -> None:
    """Refuse an adapter on a model whose stages shard what it would adapt (every rank raises it, with no
    communication): what tensor parallelism does not take (``peft_tensor_parallel.refuse_unsupported``). Under
    ``ep_size`` alone or over plain replicas the attention and every module outside the experts are whole on each
    rank, and so are their adapters and the experts' ``lora_A`` / ``lora_B`` (``peft_experts.py``); FSDP's rules:
    ``peft_fsdp.py``."""
    refuse_unsupported(model, config)  # what tensor parallelism's LoRA does not take (peft_tensor_parallel.py)


def agree_on_config(model: PipelineCore, config: Any, adapter_name: str) -> None:
    """Collective: raise on every rank if ``adapter_name``'s peft config differs between ranks."""
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    fields = {k: v for k, v in fields.items() if k not in _LOCAL_FIELDS}
    check_same_on_all_ranks(model.ctx, f"the config of adapter {adapter_name!r}", _plain(fields),
                            describe=model.rank_label, hint=_SAME_ADAPTER)


def _file_digest(path: pathlib.Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return f"{path.stat().st_size} bytes, blake2b {h.hexdigest()}"


def files_identity(source: Any, subfolder: str | None = None) -> dict[str, Any]:
    """What an adapter source is, by content: each adapter file of a local folder -> its size and hash;
    a hub id or anything else -> itself (the same id on every rank downloads the same files)."""
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        folder = pathlib.Path(source) / (subfolder or "")
        found = {name: _file_digest(folder / name) for name in _ADAPTER_FILES if (folder / name).is_file()}
        return found or {"folder": "(no adapter files)"}
    if isinstance(source, dict):  # a state dict given directly
        return {"state_dict": source}
    return {"source": repr(source), "subfolder": subfolder}


def agree_on_files(model: PipelineCore, source: Any, adapter_name: str, subfolder: str | None = None,
                   **arguments: Any) -> None:
    """Collective: raise on every rank if the adapter files (by content) or the loading arguments differ."""
    identity = {"files": files_identity(source, subfolder), **{k: _plain(v) for k, v in arguments.items()}}
    check_same_on_all_ranks(model.ctx, f"the adapter files of {adapter_name!r}", identity,
                            describe=model.rank_label, hint=_SAME_ADAPTER)


@contextlib.contextmanager
def agreed(model: PipelineCore, what: str):
    """Run a per-rank adapter step; if it fails on any rank, raise on every rank (collective when distributed).

    A rank's own library error is raised as it is; any other failure (torch's ``size mismatch``, a
    ``KeyError`` of a module another rank holds) becomes :class:`AdapterError` naming the rank and the
    cause, and the ranks that did not fail raise :class:`AdapterError` quoting it. On one process the
    step's own error is raised unchanged.
    """
    error: Exception | None = None
    try:
        yield
    except Exception as caught:  # noqa: BLE001 - agreed below, then raised on every rank
        error = caught
    if not model.ctx.is_distributed:
        if error is not None:
            raise error
        return
    hint = "Fix the adapter; it may be partly loaded on some ranks, so load the fixed one into a freshly loaded model"
    try:
        raise_on_any_rank(model.ctx, error, what=what, describe=model.rank_label)
    except PipelineError as e:
        if isinstance(e, RankError) and e is not error and not is_lost_peer_error(e):
            raise AdapterError(f"{e}. {hint}") from e
        raise
    except Exception as own:  # this rank's own failure, not one of the library's
        label = model.rank_label(model.ctx.rank)
        raise AdapterError(
            f"rank {model.ctx.rank} ({label}) failed while {what}: {type(own).__name__}: {own}. {hint}"
        ) from own
