"""Trainer checkpoints of a PEFT model wrapping a pipelined model: the adapter and the training state.

transformers' Trainer saves a PEFT model's checkpoint as the adapter alone (the frozen base model is
the one it was loaded from) plus the training state. ``checkpoint-N/`` here holds the same, in the
package's data-only formats:

* the adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors`` with one
  process's keys, ``README.md``): ``PeftModel.save_pretrained``, which gathers every rank's adapter
  tensors and writes them once (:mod:`hf_pipeline.integrations.peft_save`), so ``PeftModel.from_pretrained``
  loads a checkpoint on one process;
* the optimizer state per pipeline rank (``optimizer/pp-XXXXX.pt``, keyed by parameter name, read
  back with ``weights_only=True``), ``scheduler.json`` and every rank's ``rng/rank-XXXXX.safetensors``,
  as :mod:`.trainer_checkpoints` writes them for a whole model;
* ``trainer_state.json``, written by the trainer once every rank has written its files.

Resuming loads the adapter into the stages (``PeftModel.load_adapter``: each rank keeps the keys of
its own stages), then the optimizer and scheduler from these files. A checkpoint without
``trainer_state.json`` is one whose save did not finish, and is refused.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from ..checked_files import is_regular_file, read_json
from ..checkpointing.directory import OPTIMIZER_DIR, RNG_DIR, SCHEDULER_NAME, TRAINER_STATE_NAME
from ..checkpointing.durable import save_torch
from ..checkpointing.state_files import json_state, rng_state, write_rng_state
from ..checkpointing.training_state import (
    optimizer_file_name,
    optimizer_keys,
    optimizer_state_by_key,
    read_optimizer_file,
    rng_file_name,
)
from ..core import PipelineCore
from ..distributed.agreement import collective_errors
from ..errors import CheckpointError, CheckpointNotFoundError
from ..loading.safetensors_header import read_shard_header
from .trainer_checkpoints import check_trainer_state

__all__ = ["ADAPTER_WEIGHTS_NAME", "load_adapter_training_state", "reload_adapter", "save_adapter_checkpoint"]

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME
ADAPTER_CONFIG_NAME = "adapter_config.json"  # peft's CONFIG_NAME


def save_adapter_checkpoint(
    peft_model, model: PipelineCore, directory: str | os.PathLike, *, optimizer=None, scheduler=None, tokenizer=None
) -> None:
    """Write the adapter (rank 0), and with ``optimizer`` the training state (every rank). Collective.

    Args:
        peft_model: the ``PeftModel`` the Trainer trains.
        model: the pipelined model it wraps.
        directory: ``checkpoint-N`` (the same path on every rank).
        optimizer: this rank's optimizer (its pipeline rank's state is written by the first replica).
        scheduler: the LR scheduler, written by rank 0 as JSON.
        tokenizer: saved beside the adapter by rank 0, as the Trainer does.
    """
    directory = pathlib.Path(directory)
    peft_model.save_pretrained(str(directory))  # collective: gathered, written by rank 0
    ctx = model.ctx
    with collective_errors(ctx, "writing the adapter checkpoint's training state"):
        if ctx.is_main_process and tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        if optimizer is not None:
            # Replicas hold the same state: the first one writes (one rank of it per pipeline rank: None elsewhere).
            state = optimizer_state_by_key(model, optimizer) if model.dims.dp_rank == 0 else None
            if state is not None:
                path = directory / OPTIMIZER_DIR / optimizer_file_name(model.dims.pp_rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                save_torch(state, path)
            path = directory / RNG_DIR / rng_file_name(ctx.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_rng_state(path, rng_state())
        if ctx.is_main_process and scheduler is not None:
            json_state(directory / SCHEDULER_NAME, scheduler.state_dict())


def reload_adapter(peft_model, model: PipelineCore, directory: str | os.PathLike) -> None:
    """Load the active adapter's tensors from ``directory`` into this rank's stages (trainable). Collective.

    Raises:
        CheckpointNotFoundError: ``directory`` holds no adapter (on every rank).
    """
    path = pathlib.Path(directory) / ADAPTER_WEIGHTS_NAME
    with collective_errors(model.ctx, "finding the adapter checkpoint"):
        if not is_regular_file(path, "the adapter weights"):
            raise CheckpointNotFoundError(
                f"{path} does not exist: resume_from_checkpoint= must name a checkpoint the Trainer wrote for this "
                "PEFT model (adapter_config.json and adapter_model.safetensors)"
            )
        if not is_regular_file(path.parent / TRAINER_STATE_NAME, "the Trainer's state"):  # written last
            raise CheckpointNotFoundError(
                f"{path.parent} has no {TRAINER_STATE_NAME}: the save of this checkpoint did not finish; resume from "
                "an earlier checkpoint (or remove this one and pass resume_from_checkpoint=True)"
            )
        # Before peft reads them (raw errors, or a blocking read of a FIFO): named when truncated or not ours.
        check_trainer_state(path.parent)
        read_json(path.parent / ADAPTER_CONFIG_NAME, "the adapter config", expect=dict)
        read_shard_header(path, what="the adapter weights")
    with collective_errors(model.ctx, "loading the adapter checkpoint"):
        active = peft_model.active_adapters[0]
        peft_model.load_adapter(str(directory), active, is_trainable=True)


def load_adapter_training_state(model: PipelineCore, directory: str | os.PathLike, *, optimizer=None,
                                scheduler=None) -> None:
    """Restore the optimizer (from every pipeline rank's file, by parameter name) and the scheduler. Collective.

    Raises:
        CheckpointNotFoundError: the checkpoint lacks the optimizer or scheduler state (on every rank).
        CheckpointError: the saved optimizer is of another adapter or optimizer (on every rank).
    """
    directory = pathlib.Path(directory)
    with collective_errors(model.ctx, "loading the adapter checkpoint's training state"):
        if optimizer is not None:
            _load_optimizer(model, optimizer, directory)
        if scheduler is not None:
            path = directory / SCHEDULER_NAME
            if not is_regular_file(path, "the scheduler state"):
                raise CheckpointNotFoundError(f"{path} does not exist: the checkpoint was saved without its scheduler")
            scheduler.load_state_dict(read_json(path, "the scheduler state", expect=dict))


def _load_optimizer(model: PipelineCore, optimizer, directory: pathlib.Path) -> None:
    # Adapter states are small: every rank reads every pipeline rank's file and takes its own keys, so
    # the state is found by name whatever the stage layout was.
    files = sorted((directory / OPTIMIZER_DIR).glob("pp-*.pt"))
    if not files:
        raise CheckpointNotFoundError(
            f"{directory / OPTIMIZER_DIR} holds no optimizer state: the checkpoint was saved with save_only_model, "
            "resume from one saved without it"
        )
    saved: dict[str, Any] = {}
    listed: set[str] = set()
    own = directory / OPTIMIZER_DIR / optimizer_file_name(model.dims.pp_rank)
    groups_from = None
    for path in files:
        part = read_optimizer_file(path, model.device)
        saved.update(part["state"])
        listed |= {k for g in part["param_groups"] for k in g["params"]}
        if groups_from is None or path == own:
            groups_from = part["param_groups"]
    keys = [k for group in optimizer_keys(model, optimizer) for k in group]  # this optimizer's, by name
    missing = [k for k in keys if k not in listed]
    if missing or len(groups_from) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the optimizer state in {directory / OPTIMIZER_DIR} is of another adapter or optimizer (it has no entry "
            f"for {missing[:3]}, or {len(groups_from)} parameter groups against {len(optimizer.param_groups)}); resume "
            "with the LoraConfig and TrainingArguments the checkpoint was written with"
        )
    state = {i: saved[k] for i, k in enumerate(keys) if k in saved}
    groups, i = [], 0
    for saved_group, group in zip(groups_from, optimizer.param_groups):
        n = len(group["params"])
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": list(range(i, i + n))})
        i += n
    optimizer.load_state_dict({"state": state, "param_groups": groups})
