"""Training state in files that cannot carry code: RNG states in safetensors, the scheduler in JSON.

A checkpoint may come from anywhere (a hub download, a shared disk), and unpickling a file runs
whatever code it names. So nothing of the training state is unpickled freely: the RNG states
(torch's and CUDA's are uint8 tensors, Python's and NumPy's Mersenne Twister tables integers) go
into ``rng/rank-XXXXX.safetensors`` with their few scalars as JSON in its metadata, and the
scheduler's ``state_dict()`` (numbers, strings, lists) into ``scheduler.json``; a state JSON cannot
hold is refused at save, naming its key. The optimizer state (tensors and numbers keyed by
checkpoint key) stays a ``torch.save`` file, read only with ``weights_only=True``.

Checkpoints of earlier versions hold ``scheduler.pt`` and ``rng/rank-XXXXX.pt`` pickles: they are
read with :func:`hf_pipeline.checked_files.load_torch_data` (``weights_only``: tensors, numbers, strings,
containers; no other class), and one that needs more (NumPy's RNG state is an ndarray) is refused with a
:class:`~hf_pipeline.errors.CheckpointError` that says to re-save it, never unpickled freely. Every file is
read through :mod:`hf_pipeline.checked_files`: a truncated, foreign or non-regular one is named as such.
"""

from __future__ import annotations

import json
import pathlib
import random
from typing import Any

import torch

from ..checked_files import NOT_OURS
from ..errors import CheckpointError, InputError
from ..loading.safetensors_header import read_shard_header
from .durable import fsync, reporting_full_disk, write_json

__all__ = ["json_state", "read_rng_state", "rng_state", "set_rng_state", "write_rng_state"]

_RNG_FORMAT = "1"


def rng_state() -> dict[str, Any]:
    """This process's RNG states: Python's, torch's, NumPy's (when installed) and CUDA's (when initialised)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (or :func:`read_rng_state` read)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rng_state(path: pathlib.Path, state: dict[str, Any]) -> None:
    """``state`` (from :func:`rng_state`) as safetensors: tables as tensors, the scalars as JSON metadata."""
    import safetensors.torch

    version, table, gauss_next = state["python"]
    tensors = {"torch": state["torch"], "python": torch.tensor(table, dtype=torch.int64)}
    meta: dict[str, Any] = {"python": {"version": version, "gauss_next": gauss_next}}
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        tensors["numpy"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    for i, t in enumerate(state.get("cuda", ())):
        tensors[f"cuda.{i}"] = t
    meta["cuda_devices"] = len(state.get("cuda", ()))
    metadata = {"format": _RNG_FORMAT, "state": json.dumps(meta)}
    with reporting_full_disk(path):
        safetensors.torch.save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, str(path), metadata=metadata)
        fsync(path)


def read_rng_state(path: pathlib.Path, hint: str = "") -> dict[str, Any]:
    """What :func:`write_rng_state` wrote, as :func:`set_rng_state` takes it.

    Args:
        path: the ``rng/rank-XXXXX.safetensors`` file.
        hint: another way out, appended to the error (``", or pass rng=False ..."``).

    Raises:
        CheckpointError: the file is no regular file, is truncated (its header checked first, as a
            shard's is), or is no RNG state this version wrote (another format, damaged).
    """
    from safetensors import SafetensorError, safe_open

    try:
        read_shard_header(path, what="the RNG state")  # a regular file, complete: else named, before safetensors
    except CheckpointError as e:
        raise CheckpointError(f"{e}{hint}") from e
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["state"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        python = meta["python"]
        state: dict[str, Any] = {
            "python": (python["version"], tuple(tensors["python"].tolist()), python["gauss_next"]),
            "torch": tensors["torch"],
        }
        if "numpy" in meta:
            n = meta["numpy"]
            keys = tensors["numpy"].numpy().astype("uint32")
            state["numpy"] = (n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"])
        if meta["cuda_devices"]:
            state["cuda"] = [tensors[f"cuda.{i}"] for i in range(meta["cuda_devices"])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as e:
        raise CheckpointError(
            f"{path} (the RNG state) is no RNG state hf_pipeline wrote ({type(e).__name__}: {e}): it {NOT_OURS}; "
            f"re-save the checkpoint{hint}"
        ) from e
    return state


def _check_json(value: Any, key: str) -> None:
    """Refuse what JSON cannot hold exactly (a tensor, an object, a non-string key), naming where it sits."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        return  # JSON writes repr(), read back exactly; inf and nan as Infinity / NaN
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{key}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InputError(
                    f"the scheduler's state_dict() has the non-string key {k!r} under {key!r}, which JSON cannot "
                    "hold; use a scheduler whose state is plain numbers, strings and lists, or save it yourself"
                )
            _check_json(v, f"{key}.{k}" if key else k)
        return
    raise InputError(
        f"the scheduler's state_dict() holds a {type(value).__name__} under {key!r}, which a checkpoint stores only "
        "as JSON (a file that cannot run code when loaded); use a scheduler whose state is plain numbers, strings "
        "and lists, or save that state yourself"
    )


def json_state(path: pathlib.Path, state: dict[str, Any]) -> None:
    """A scheduler's ``state_dict()`` as JSON in ``path``.

    Raises:
        InputError: a value JSON cannot hold (named by its key).
    """
    _check_json(state, "")
    write_json(path, state)
