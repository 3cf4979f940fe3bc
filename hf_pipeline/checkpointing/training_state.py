"""Training state beside a checkpoint's weights: optimizer, scheduler, RNG and step, saved and restored.

Written only when ``save_pretrained`` is asked for it (``optimizer=`` / ``scheduler=`` / ``step=`` /
``trainer_state=``): ``optimizer/pp-XXXXX.pt`` (one file per pipeline rank, states keyed by
checkpoint key, with ``optimizer/index.json``), ``scheduler.json``, ``rng/rank-XXXXX.safetensors``
(every global rank's RNG states) and ``trainer_state.json``. Nothing is unpickled freely on load
(a checkpoint may come from anywhere; see :mod:`.state_files`). :func:`load_training_state` restores them, so a
resumed run continues bitwise where it stopped (same world size, CPU). Optimizer states are keyed
by checkpoint key, not by parameter index, and saved whole (a sharded parameter's states gathered,
see :mod:`.state_shards`), so a run may resume with another stage layout or mesh (pp2 x tp2 -> pp4
-> one process).

Example:
    >>> model.save_pretrained("out/checkpoint-100", optimizer=opt, scheduler=sched, step=100)
    >>> # later, possibly in a new job:
    >>> path = latest_checkpoint("out")
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    >>> state = load_training_state(model, path, optimizer=opt, scheduler=sched)   # state["step"] == 100
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

import torch

from ..checked_files import NOT_OURS, is_regular_file, load_torch_data, read_json
from ..core import PipelineCore
from ..distributed.agreement import collective_errors
from ..errors import CheckpointError, CheckpointNotFoundError, InputError
from ..loading.checkpoint_files import INDEX_NAME
from ..log import get_logger
from .directory import (
    FORMAT_VERSION,
    OLD_SCHEDULER_NAME,
    OPTIMIZER_DIR,
    RNG_DIR,
    SAVE_ID_KEY,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    is_complete_checkpoint,
    why_incomplete,
)
from .durable import save_torch, write_json
from .lock import LOCK_NAME
from .state_files import json_state, read_rng_state, rng_state, set_rng_state, write_rng_state
from .state_shards import gathered_state, sharded_state, writes_pipeline_state

logger = get_logger(__name__)

__all__ = [
    "load_training_state",
    "optimizer_file_name",
    "optimizer_keys",
    "optimizer_state_by_key",
    "read_optimizer_file",
    "rng_file_name",
    "stage_main_training_state",
    "stage_rank_training_state",
]

_FOREIGN_PARAMETER = (
    "the optimizer holds a parameter that is not one of this model's stage parameters; build it from "
    "model.parameters()"
)


def optimizer_file_name(pp_rank: int) -> str:
    """The file (in ``optimizer/``) holding the optimizer state of pipeline rank ``pp_rank``'s parameters."""
    return f"pp-{pp_rank:05d}.pt"


def _key_of_parameter(model: PipelineCore) -> dict[int, str]:
    """id(parameter) -> checkpoint key, for this rank's stage parameters (a tied one under its first name)."""
    layout = model.param_layout
    key_of_param: dict[int, str] = {}
    for stage in model.stages:
        for name, p in stage.named_parameters(remove_duplicate=False):
            key_of_param.setdefault(id(p), layout.key_of.get(name, name))
    return key_of_param


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
def optimizer_keys(model: PipelineCore, optimizer) -> list[list[str]]:
    """The checkpoint key of every parameter of ``optimizer``, group by group (no communication).

    Raises:
        InputError: the optimizer holds a parameter of none of this rank's stages.
    """
    key_of_param = _key_of_parameter(model)
    out = []
    for group in optimizer.param_groups:
        if any(id(p) not in key_of_param for p in group["params"]):
            raise InputError(f"{_FOREIGN_PARAMETER} (this rank's parameters only)")
        out.append([key_of_param[id(p)] for p in group["params"]])
    return out


def optimizer_state_by_key(model: PipelineCore, optimizer) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with parameter indices replaced by checkpoint keys, every tensor whole.

    Collective over the meshes of sharded parameters (every rank of the first replica calls it).

    Returns:
        The state to write, or None on a rank that does not write its pipeline rank's file (a
        tensor-parallel or fsdp rank other than the first: it only takes part in the gathers).

    Raises:
        InputError: the optimizer holds a parameter of none of this rank's stages.
    """
    sd = optimizer.state_dict()
    index_to_key = dict(enumerate(k for group in optimizer_keys(model, optimizer) for k in group))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # Sharded parameters' states are gathered whole, one tensor at a time, in the same order on every rank
    # of their mesh (see :mod:`.state_shards`); a rank that does not write drops each one at once.
    keep = writes_pipeline_state(model.dims)
    state = {}
    for i, entries in sd["state"].items():
        whole = {name: gathered_state(params[i], value) for name, value in sorted(entries.items())}
        if keep:
            state[index_to_key[i]] = whole
    if not keep:
        return None
    return {
        "format": FORMAT_VERSION,
        "state": state,
        "param_groups": [{**g, "params": [index_to_key[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def read_optimizer_file(path: pathlib.Path, device: torch.device) -> dict[str, Any]:
    """One ``optimizer/pp-XXXXX.pt`` file: read with ``weights_only`` and checked to hold what a save writes.

    Raises:
        CheckpointError: naming the file: no regular file, truncated, not ours (not a torch file, or not a
            ``{"state", "param_groups"}`` mapping), or a pickle that would run code.
    """
    saved = load_torch_data(path, "optimizer state", map_location=device)
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list)):
        raise CheckpointError(
            f"{path} (optimizer state) is no mapping with 'state' and 'param_groups': it {NOT_OURS}; re-save the "
            "checkpoint"
        )
    return saved


def stage_rank_training_state(
    model: PipelineCore, staging: pathlib.Path, optimizer_state: dict[str, Any] | None, *, with_state: bool
) -> None:
    """This rank's share: its pipeline rank's optimizer state (replica 0) and its RNG states."""
    if optimizer_state is not None:
        save_torch(optimizer_state, staging / OPTIMIZER_DIR / optimizer_file_name(model.dims.pp_rank))
    if with_state:
        write_rng_state(staging / RNG_DIR / rng_file_name(model.ctx.rank), rng_state())


def stage_main_training_state(
    model: PipelineCore,
    staging: pathlib.Path,
    token: str,
    *,
    optimizer_files: Mapping[str, str] | None,
    scheduler: Any,
    step: int | None,
    extra: dict[str, Any] | None,
    with_state: bool,
) -> None:
    """Rank 0's share: the scheduler, the optimizer index and ``trainer_state.json`` (naming the save ``token``).

    Args:
        optimizer_files: checkpoint key -> its optimizer state file (:func:`optimizer_file_name`), over
            every rank; None when no rank saved an optimizer ({} for one without state, plain SGD).
    """
    if scheduler is not None:
        json_state(staging / SCHEDULER_NAME, scheduler.state_dict())
    if not with_state:
        return
    if optimizer_files is not None:
        index = {"format": FORMAT_VERSION, "state_files": dict(optimizer_files)}
        write_json(staging / OPTIMIZER_DIR / "index.json", index)
    plan = model.plan
    write_json(staging / TRAINER_STATE_NAME, {
        **(extra or {}),
        "format": FORMAT_VERSION, "step": step, "world_size": model.ctx.world_size, "pp_size": plan.pp_size,
        "dp_size": model.dims.dp_size, "num_stages": plan.num_stages, "virtual_stages": plan.virtual_stages,
        "schedule": model.schedule.name, "n_microbatches": model.n_microbatches,
        "model_class": type(model.skeleton).__name__, "stage_blocks": [list(s.blocks) for s in plan.stages],
        SAVE_ID_KEY: token,
    })


# --------------------------------------------------------------------------------------------
# Resuming
# --------------------------------------------------------------------------------------------
def load_training_state(
    model: PipelineCore,
    directory: str | os.PathLike,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = True,
) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG state saved by ``save_pretrained(..., optimizer=...)``. Collective.

    The model weights come from loading ``directory`` itself with ``from_pretrained(..., pipeline=True)``.

    Args:
        model: the :class:`~hf_pipeline.model.PipelinedModel` (any stage layout: optimizer states are
            looked up by checkpoint key).
        directory: a complete checkpoint.
        optimizer: an optimizer built like the saved one over ``model.parameters()``.
        scheduler: the LR scheduler to restore.
        rng: restore this rank's RNG states (skipped with a warning if the world size changed).

    Returns:
        The ``trainer_state.json`` contents (``step`` among them).

    Raises:
        CheckpointNotFoundError: ``directory`` is no complete checkpoint, or lacks the state asked for.
        CheckpointError: its training state and weights come from different saves, or the optimizer
            does not match the saved one.
    """
    directory = pathlib.Path(directory)
    ctx = model.ctx
    with collective_errors(ctx, "loading the training state"):
        before = _save_id(directory)
        try:
            state = _trainer_state(directory)
            if optimizer is not None:
                _load_optimizer(model, optimizer, directory)
            if scheduler is not None:
                scheduler.load_state_dict(_scheduler_state(directory))
            if rng:
                _restore_rng(directory, state, ctx)
        except (OSError, CheckpointError) as e:  # a file replaced or removed under us says nothing true
            running = (directory / LOCK_NAME).exists() and not isinstance(e, CheckpointNotFoundError)
            if running or _save_id(directory) != before:
                raise _changed_while_read(directory) from e
            raise
        if _save_id(directory) != before:
            raise _changed_while_read(directory)
    return state


def _save_id(directory: pathlib.Path) -> str | None:
    """The save that wrote the directory's index (None without a readable one)."""
    try:
        metadata = read_json(directory / INDEX_NAME, "the checkpoint index", expect=dict).get("metadata", {})
        return metadata.get(SAVE_ID_KEY) if isinstance(metadata, dict) else None
    except CheckpointError:  # no index, or a damaged one: _trainer_state names it
        return None


def _changed_while_read(directory: pathlib.Path) -> CheckpointError:
    return CheckpointError(
        f"{directory} changed while its training state was read: a save_pretrained into it ran meanwhile, so what "
        "was read may mix two saves. Load it again once that save has finished (or resume from another checkpoint); "
        "the files themselves are fine"
    )


_NO_RNG = ", or pass rng=False to load_training_state to resume without restoring the RNG states"


def rng_file_name(rank: int, suffix: str = ".safetensors") -> str:
    """The file (in ``rng/``) holding global rank ``rank``'s RNG states."""
    return f"rank-{rank:05d}{suffix}"


def _scheduler_state(directory: pathlib.Path) -> dict[str, Any]:
    """``scheduler.json``, or an earlier version's ``scheduler.pt`` read with ``weights_only=True``."""
    path = directory / SCHEDULER_NAME
    if is_regular_file(path, "the scheduler state"):
        return read_json(path, "the scheduler state", expect=dict)
    old = directory / OLD_SCHEDULER_NAME
    if is_regular_file(old, "the scheduler state"):
        return load_torch_data(old, "the scheduler state")
    raise CheckpointNotFoundError(f"{path} does not exist: the checkpoint was saved without scheduler=")


def _restore_rng(directory: pathlib.Path, state: dict[str, Any], ctx) -> None:
    """This rank's RNG states, when the checkpoint was written by as many ranks (else a warning)."""
    path = directory / RNG_DIR / rng_file_name(ctx.rank)
    old = directory / RNG_DIR / rng_file_name(ctx.rank, ".pt")
    found = is_regular_file(path, "the RNG state")  # a FIFO or directory there is refused, not skipped
    if state.get("world_size") == ctx.world_size and (found or is_regular_file(old, "the RNG state")):
        set_rng_state(read_rng_state(path, _NO_RNG) if found else load_torch_data(old, "the RNG state", hint=_NO_RNG))
        return
    logger.warning(
        "not restoring RNG state: the checkpoint was written by %s ranks, this job has %s; a resumed run "
        "then draws different dropout masks than an uninterrupted one",
        state.get("world_size"), ctx.world_size,
    )


def _trainer_state(directory: pathlib.Path) -> dict[str, Any]:
    """``trainer_state.json`` of a complete checkpoint ({} without one), checked to belong to its weights."""
    if not is_complete_checkpoint(directory):
        raise CheckpointNotFoundError(f"{directory} is not a complete checkpoint: {why_incomplete(directory)}")
    state_path, what = directory / TRAINER_STATE_NAME, "the trainer state"
    state = read_json(state_path, what, expect=dict) if is_regular_file(state_path, what) else {}
    weights_id = _save_id(directory)
    if state.get(SAVE_ID_KEY) and weights_id and state[SAVE_ID_KEY] != weights_id:
        raise CheckpointError(
            f"the training state in {directory} was written by another save than its weights ({TRAINER_STATE_NAME} "
            f"names save {state[SAVE_ID_KEY]}, {INDEX_NAME} save {weights_id}): a later save_pretrained into this "
            "directory without optimizer=/step=, or one killed while replacing it. Resume from a checkpoint saved "
            "with its training state, or load the weights alone"
        )
    return state


def _load_optimizer(model: PipelineCore, optimizer, directory: pathlib.Path) -> None:
    index_path = directory / OPTIMIZER_DIR / "index.json"
    what = "the optimizer state index"
    if not is_regular_file(index_path, what):
        raise CheckpointNotFoundError(f"{index_path} does not exist: the checkpoint was saved without optimizer=")
    files = read_json(index_path, what, expect=dict, keys=("state_files",))["state_files"]
    if not (isinstance(files, dict) and all(isinstance(v, str) and "/" not in v for v in files.values())):
        raise CheckpointError(
            f"{index_path} ({what}) has state_files that are no mapping of key -> file name in {OPTIMIZER_DIR}/: it "
            f"{NOT_OURS}; re-save the checkpoint"
        )
    key_of_param = _key_of_parameter(model)
    keys = [key_of_param.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if any(k is None for k in keys):
        raise InputError(_FOREIGN_PARAMETER)
    # The files holding this rank's keys, and its own pipeline rank's file (the parameter groups) when there.
    own = optimizer_file_name(model.dims.pp_rank)
    own_file = {own} if is_regular_file(directory / OPTIMIZER_DIR / own, "optimizer state") else set()
    needed = sorted({files[k] for k in keys if k in files} | own_file)
    saved: dict[str, dict] = {}
    for name in needed:
        saved[name] = read_optimizer_file(directory / OPTIMIZER_DIR / name, model.device)
    groups_from = saved.get(own) or next(iter(saved.values()), None)
    if groups_from is None:
        raise CheckpointNotFoundError(f"no optimizer state in {directory / OPTIMIZER_DIR} for this rank's parameters")
    if len(groups_from["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the saved optimizer has {len(groups_from['param_groups'])} parameter groups, this one "
            f"{len(optimizer.param_groups)}; build the optimizer the way the saved run did"
        )
    state = {}
    for i, key in enumerate(keys):
        if key in files and key in saved[files[key]]["state"]:
            state[i] = saved[files[key]]["state"][key]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    _check_same_model(model, directory, files, keys, state, params)
    # Whole tensors in the file, shards here: each rank keeps its slice of what it read (see :mod:`.state_shards`).
    state = {i: {name: sharded_state(params[i], v) for name, v in entries.items()} for i, entries in state.items()}
    groups, i = [], 0
    for saved_group, group in zip(groups_from["param_groups"], optimizer.param_groups):
        n = len(group["params"])
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": list(range(i, i + n))})
        i += n
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _check_same_model(
    model: PipelineCore, directory: pathlib.Path, files: dict[str, str], keys: list[str], state: dict[int,
    dict], params: list
) -> None:
    """Refuse another model's optimizer state here, naming the first key that differs, not at the next step().

    A state tensor must have its parameter's shape, or that shape with some dimensions 1 (factored
    states such as Adafactor's row and column statistics); 0-d values (``step``) are scalars.
    """
    unknown = sorted(k for k in files if k not in model.param_layout.parameters)
    if unknown:
        raise CheckpointError(
            f"the optimizer state in {directory / OPTIMIZER_DIR} is of another model: it holds state for "
            f"{unknown[0]!r} ({len(unknown)} key(s) in all), which is no parameter of this model; resume with the "
            "model the checkpoint was saved from (load its weights from the same directory)"
        )
    for i, key in enumerate(keys):
        shape = tuple(params[i].shape)
        for name, value in state.get(i, {}).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            got = tuple(value.shape)
            if len(got) != len(shape) or any(g not in (s, 1) for g, s in zip(got, shape)):
                raise CheckpointError(
                    f"the optimizer state in {directory / OPTIMIZER_DIR} is of another model: {key!r} has "
                    f"{name!r} of shape {list(got)} but the parameter has shape {list(shape)}; resume with the "
                    "model the checkpoint was saved from (load its weights from the same directory)"
                )
