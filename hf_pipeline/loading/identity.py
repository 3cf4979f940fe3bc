"""What every rank must agree on before it builds its stages: the load-time pipeline identity.

Each rank describes the pipeline it is about to load (resolved options, the arguments that shape
it, the device type, the checkpoint by content) as one small dict; the loader compares the dicts
across ranks (``check_same_on_all_ranks``) so a rank with another split, dtype or checkpoint fails
by name at load instead of hanging or computing wrong numbers later.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import fields
from typing import Any, Callable, Mapping

from ..checked_files import is_regular_file, open_regular, read_json
from ..errors import CheckpointError
from .checkpoint_files import INDEX_NAME

__all__ = ["parallel_arguments", "pipeline_identity"]

_TAIL_BYTES = 4096  # of each shard, in the checkpoint's identity


def parallel_arguments(mesh: Mapping[str, Any]) -> dict[str, Any]:
    """The mesh arguments among ``kwargs`` as the caller gave them, comparable across ranks.

    Compared before the options are resolved: a rank resolving another mesh would otherwise fail alone
    (an invalid mesh) or be named by what follows from it (``pp_size``, ``num_stages``) instead of the
    argument. A ``DeviceMesh`` is described by its dim names and shape (one string: a mismatch names
    ``device_mesh`` and shows both), a ``DistributedConfig`` by its fields (``distributed_config.tp_size``).

    Args:
        mesh: the mesh options as given (``LoadOptions.acting_in("mesh")``: ``tp_size``, ``fsdp_size``,
            ``distributed_config``, ``device_mesh``).

    Returns:
        argument name -> its value or description (None where not given).
    """
    out: dict[str, Any] = {}
    for name, value in mesh.items():
        # Anything else is described by its type: resolving the options refuses it by name on every rank.
        if name == "device_mesh" and value is not None:
            from torch.distributed.device_mesh import DeviceMesh

            if isinstance(value, DeviceMesh):
                value = f"mesh_dim_names={value.mesh_dim_names}, shape={tuple(value.shape)}"
            else:
                value = type(value).__name__
        elif name == "distributed_config" and value is not None:
            from transformers.distributed import DistributedConfig

            value = value.to_dict() if isinstance(value, DistributedConfig) else type(value).__name__
        out[name] = value
    return out


def pipeline_identity(
    options, config, checkpoint_dir, *, device_type: str, arguments: Mapping[str, Any]
) -> dict[str, Any]:
    """What every rank must agree on before it builds its stages: one small, comparable dict.

    The resolved options, the arguments that shape the pipeline, the device type, and the
    checkpoint's identity by content, not by path (a path may differ from host to host): the
    config, the generation config, the index's weight map and each shard's size. Nothing is read
    from the shards. An unreadable index is described, not raised: the loader reports it.

    Args:
        options: the resolved :class:`~hf_pipeline.planning.options.PipelineOptions`.
        config: the transformers config the stages are built from.
        checkpoint_dir: the local checkpoint directory (or None).
        device_type: ``"cpu"`` or ``"cuda"``.
        arguments: the caller's arguments as given (``split_method``, ``gather_output``, ...).

    Returns:
        A dict for :func:`hf_pipeline.distributed.context.check_same_on_all_ranks`: mismatches are named by key
        (``split``, ``config.hidden_size``, ``shard sizes.model-00002-of-00005.safetensors``).
    """
    out: dict[str, Any] = {}
    for f in fields(options):
        if f.name == "schedule_note":  # words derived from the other options: a mismatch is named by those
            continue
        value = getattr(options, f.name)
        if isinstance(value, type):
            value = value.__qualname__  # the model class
        elif f.name == "schedule":
            value = value.name
        out[f.name] = value
    out.update({k: v for k, v in arguments.items() if k not in out})
    out["device type"] = device_type
    cfg = config.to_dict()
    cfg.pop("_name_or_path", None)  # where it was read from, not what it is
    out["config"] = cfg
    if checkpoint_dir is not None:
        out.update(_checkpoint_identity(pathlib.Path(checkpoint_dir)))
    return out


def _checkpoint_identity(directory: pathlib.Path) -> dict[str, Any]:
    """The checkpoint by content: generation config, the index's weight map (hashed), shard sizes and tails."""
    out: dict[str, Any] = {}
    generation = directory / "generation_config.json"
    out["generation_config.json"] = _described(lambda: _read_text(generation, "the generation config"))
    weight_map = _described(lambda: _weight_map(directory / INDEX_NAME))
    if isinstance(weight_map, dict):
        text = json.dumps(weight_map, sort_keys=True)
        # One leaf: thousands of keys are compared by one hash, not listed in a mismatch message.
        out["weight map"] = f"{len(weight_map)} keys (#{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()})"
        files = sorted({v for v in weight_map.values() if isinstance(v, str)})
    else:
        out["weight map"] = weight_map
        files = [p.name for p in sorted(directory.glob("*.safetensors"))]
    sizes, tails = {}, {}
    for name in files:
        try:  # a regular file only: opening a FIFO in a shard's place would wait for a writer forever
            with open_regular(directory / name, "shard") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - _TAIL_BYTES))
                tail = f.read(_TAIL_BYTES)
        except (OSError, CheckpointError):
            sizes[name] = tails[name] = None  # missing, unreadable or no regular file: the loader says which and why
            continue
        sizes[name] = size
        tails[name] = hashlib.blake2b(tail, digest_size=8).hexdigest()
    out["shard sizes"] = sizes
    # The last bytes of each shard (one page, not a tensor read): two checkpoints of one architecture
    # have the same config, index and sizes, but not the same weights.
    out["shard tails"] = tails
    return out


def _read_text(path: pathlib.Path, what: str) -> str | None:
    """The text of a regular file at ``path`` (None when nothing is there)."""
    if not is_regular_file(path, what):
        return None
    with open_regular(path, what) as f:
        return f.read().decode("utf-8", errors="replace")


def _weight_map(index: pathlib.Path) -> Any:
    """The index's weight map (None without an index)."""
    what = "the checkpoint index"
    if not is_regular_file(index, what):
        return None
    return read_json(index, what, expect=dict, keys=("weight_map",))["weight_map"]


def _described(read: Callable[[], Any]) -> Any:
    """What ``read()`` returns, or why it cannot be read (the loader raises for it, by name); the error's type
    only, since its message names a path, which may differ from host to host."""
    try:
        return read()
    except (OSError, CheckpointError) as e:
        return f"unreadable ({type(e).__name__})"
