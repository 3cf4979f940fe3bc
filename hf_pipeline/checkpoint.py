"""Checkpoints of a pipelined model: a normal transformers checkpoint, written by every rank at once.

``model.save_pretrained(dir)`` writes what ``transformers``' own ``save_pretrained`` of the unsplit
model would write — safetensors shards, ``model.safetensors.index.json``, ``config.json`` (and
``generation_config.json`` for generative heads) — so ``transformers.AutoModelFor*.from_pretrained(dir)``
(or ``hf_pipeline``'s ``pipeline=True``) loads it. No rank gathers the model: each pipeline rank of
the first data-parallel replica writes the tensors its stages own into its own shards. A tensor
held by several stages (a tied embedding / LM head, T5's replicated relative bias) is written once,
by the first stage holding it, under the key transformers keeps for it.

With ``optimizer=`` / ``scheduler=`` / ``step=`` the training state goes beside the weights:
``optimizer/pp-XXXXX.pt`` (one file per pipeline rank, states keyed by checkpoint key, with
``optimizer/index.json``), ``scheduler.pt``, ``rng/rank-XXXXX.pt`` (every global rank's RNG states)
and ``trainer_state.json``. :func:`load_training_state` restores them, so a resumed run continues
bitwise where it stopped (same world size, CPU).

Atomicity: everything is written into ``<dir>.tmp-<id>`` beside the target; after every rank has
finished (agreed through a collective), rank 0 writes the index last and renames the directory
into place (a previous checkpoint of the same name is moved aside first, then deleted). A save
interrupted at any point leaves at most a ``.tmp-`` directory without an index, which
:func:`is_complete_checkpoint` and :func:`latest_checkpoint` never take for a checkpoint.

Example:
    >>> model.save_pretrained("out/checkpoint-100", optimizer=opt, scheduler=sched, step=100)
    >>> # later, possibly in a new job:
    >>> path = latest_checkpoint("out")
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    >>> state = load_training_state(model, path, optimizer=opt, scheduler=sched)   # state["step"] == 100
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import random
import re
import shutil
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .dist import collective_errors

__all__ = [
    "INDEX_NAME",
    "TRAINER_STATE_NAME",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "load_training_state",
    "parse_size",
    "save_pretrained",
]

INDEX_NAME = "model.safetensors.index.json"  # written last: its presence marks a complete checkpoint
TRAINER_STATE_NAME = "trainer_state.json"
SCHEDULER_NAME = "scheduler.pt"
OPTIMIZER_DIR = "optimizer"
RNG_DIR = "rng"
_TMP = ".tmp-"
_OLD = ".old-"
_FORMAT = 1


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"64KiB"`` or an int (transformers' ``max_shard_size`` forms)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not a size; use e.g. '5GB', '500MB' or a number of bytes")
    unit = m.group(2)
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0] if unit != "B" else "B"]
    return int(float(m.group(1)) * base**power)


# --------------------------------------------------------------------------------------------
# What this rank writes
# --------------------------------------------------------------------------------------------
def _my_tensors(model) -> dict[str, torch.Tensor]:
    """checkpoint key -> tensor, for the keys whose first holding stage is on this rank (replica 0 only)."""
    from .train import param_layout

    if model.dp_rank != 0:
        return {}  # replicas hold the same values: the first one writes
    layout = param_layout(model)
    out: dict[str, torch.Tensor] = {}
    for stage in model.stages:
        for name, t in stage.state_dict(keep_vars=True).items():
            key = layout.key_of.get(name, name)
            if key in layout.saved and key not in out and layout.owner_stage(key) == stage.spec.index:
                out[key] = t.detach()
    return out


def _plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy split of this rank's keys (in key order) into shards of at most ``max_bytes`` (one big tensor alone)."""
    shards: list[list[str]] = []
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if not shards or (size + nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _optimizer_state(model, optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter indices replaced by checkpoint keys."""
    from .train import param_layout

    layout = param_layout(model)
    key_of_param: dict[int, str] = {}
    for stage in model.stages:
        for name, p in stage.named_parameters(remove_duplicate=False):
            key_of_param.setdefault(id(p), layout.key_of.get(name, name))
    sd = optimizer.state_dict()
    index_to_key: dict[int, str] = {}
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in key_of_param:
                raise ValueError(
                    "the optimizer holds a parameter that is not one of this model's stage parameters; build it from "
                    "model.parameters() (this rank's parameters only)"
                )
            index_to_key[i] = key_of_param[id(p)]
            i += 1
    return {
        "format": _FORMAT,
        "state": {index_to_key[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": [index_to_key[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _gather(model, obj: Any) -> list[Any]:
    ctx = model.ctx
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


def _broadcast(model, obj: Any) -> Any:
    ctx = model.ctx
    if not ctx.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]


def _write_json(path: pathlib.Path, data: Any) -> None:
    # Through a temporary name: a reader never sees half a file.
    part = path.with_name(path.name + ".partial")
    part.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(part, path)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
def save_pretrained(
    model,
    save_directory: str | os.PathLike,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    step: int | None = None,
    max_shard_size: int | str = "5GB",
    tokenizer: Any = None,
    trainer_state: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write a transformers checkpoint (plus training state) from every rank. Collective.

    Args:
        model: the :class:`~hf_pipeline.model.PipelinedModel`.
        save_directory: the checkpoint directory (replaced atomically if it exists).
        optimizer: this rank's optimizer; its state is written per pipeline rank, keyed by checkpoint key.
        scheduler: an LR scheduler (anything with ``state_dict()``), written by rank 0.
        step: the training step reached, kept in ``trainer_state.json``.
        max_shard_size: largest shard file per rank (``"5GB"``, ``"500MB"``, bytes).
        tokenizer: a tokenizer / processor saved into the checkpoint by rank 0 (``save_pretrained``).
        trainer_state: extra JSON-serialisable values kept in ``trainer_state.json``.

    Returns:
        The checkpoint directory.

    Example:
        >>> model.save_pretrained("out/checkpoint-100", optimizer=opt, scheduler=sched, step=100)
    """
    from safetensors.torch import save_file

    from .train import param_layout

    ctx = model.ctx
    final = pathlib.Path(save_directory).absolute()
    token = _broadcast(model, uuid.uuid4().hex[:12] if ctx.is_main_process else None)
    tmp = final.with_name(f"{final.name}{_TMP}{token}")
    layout = param_layout(model)

    # 1. Local: what this rank writes; rank 0 makes the temporary directory.
    with collective_errors(ctx, "preparing the checkpoint"):
        if final.exists() and not final.is_dir():
            raise FileExistsError(f"{final} exists and is not a directory; pass a directory path to save_pretrained")
        if ctx.is_main_process:
            tmp.mkdir(parents=True, exist_ok=False)
        tensors = _my_tensors(model)
        shards = _plan_shards(tensors, parse_size(max_shard_size))
        opt_state = _optimizer_state(model, optimizer) if optimizer is not None and model.dp_rank == 0 else None
        my_plan = {
            "rank": ctx.rank,
            "shards": [[(k, tensors[k].numel(), tensors[k].numel() * tensors[k].element_size()) for k in keys] for keys in shards],
            "optimizer_keys": sorted(opt_state["state"]) if opt_state is not None else None,
            "pp_rank": model.pp_rank,
        }
    plans = _gather(model, my_plan)
    total_files = sum(len(p["shards"]) for p in plans)
    first = sum(len(p["shards"]) for p in plans[: ctx.rank])
    names = [f"model-{first + i + 1:05d}-of-{total_files:05d}.safetensors" for i in range(len(shards))]

    # 2. Every rank writes its shards, optimizer file and RNG state into the temporary directory.
    try:
        with collective_errors(ctx, "writing the checkpoint"):
            for name, keys in zip(names, shards):
                save_file({k: tensors[k].contiguous().cpu() for k in keys}, str(tmp / name), metadata={"format": "pt"})
            if opt_state is not None:
                (tmp / OPTIMIZER_DIR).mkdir(exist_ok=True)
                torch.save(opt_state, tmp / OPTIMIZER_DIR / f"pp-{model.pp_rank:05d}.pt")
            (tmp / RNG_DIR).mkdir(exist_ok=True)
            torch.save(_rng_state(), tmp / RNG_DIR / f"rank-{ctx.rank:05d}.pt")

        # 3. Rank 0: config, scheduler, trainer state, then the index (the completeness marker), then rename.
        with collective_errors(ctx, "finishing the checkpoint"):
            if ctx.is_main_process:
                _finish(model, tmp, final, token, plans, layout, scheduler=scheduler, step=step, tokenizer=tokenizer, extra=trainer_state)
    except BaseException:
        if ctx.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is past its writes (agreed above)
        raise
    return final


def _finish(model, tmp: pathlib.Path, final: pathlib.Path, token: str, plans, layout, *, scheduler, step, tokenizer, extra) -> None:
    weight_map: dict[str, str] = {}
    total_size = 0
    total_params = 0
    file_no = 0
    total_files = sum(len(p["shards"]) for p in plans)
    for plan in plans:
        for shard in plan["shards"]:
            file_no += 1
            name = f"model-{file_no:05d}-of-{total_files:05d}.safetensors"
            for key, numel, nbytes in shard:
                if key in weight_map:
                    raise RuntimeError(f"checkpoint key {key!r} was written by two ranks; the stage plan is inconsistent")
                weight_map[key] = name
                total_size += nbytes
                if key in layout.parameters:
                    total_params += numel
    missing = sorted(layout.saved - set(weight_map))
    if missing:
        raise RuntimeError(f"no rank wrote {missing[:5]}{' ...' if len(missing) > 5 else ''}; the stage plan does not cover the model")

    config = copy.deepcopy(model.config)
    config.dtype = str(model.plan.dtype).removeprefix("torch.")  # as transformers writes it
    config.architectures = [type(model.skeleton).__name__]
    config.save_pretrained(tmp)
    if model.skeleton.can_generate():
        from .generate import generation_config

        generation_config(model).save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / SCHEDULER_NAME)
    optimizer_index = {k: f"pp-{p['pp_rank']:05d}.pt" for p in plans if p["optimizer_keys"] for k in p["optimizer_keys"]}
    if any(p["optimizer_keys"] is not None for p in plans):  # an optimizer without state (plain SGD) too
        _write_json(tmp / OPTIMIZER_DIR / "index.json", {"format": _FORMAT, "state_files": optimizer_index})
    plan = model.plan
    _write_json(tmp / TRAINER_STATE_NAME, {
        **(extra or {}),
        "format": _FORMAT, "step": step, "world_size": model.ctx.world_size, "pp_size": plan.pp_size,
        "dp_size": model.dp_size, "num_stages": plan.num_stages, "virtual_stages": plan.virtual_stages,
        "schedule": model.schedule.name, "n_microbatches": model.n_microbatches, "model_class": type(model.skeleton).__name__,
        "stage_blocks": [list(s.blocks) for s in plan.stages],
    })
    _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total_size, "total_parameters": total_params}, "weight_map": dict(sorted(weight_map.items()))})
    if final.exists():
        old = final.with_name(f"{final.name}{_OLD}{token}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


# --------------------------------------------------------------------------------------------
# Finding and resuming
# --------------------------------------------------------------------------------------------
def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory that a finished save left: index and config present, not a temporary name."""
    path = pathlib.Path(path)
    return (
        path.is_dir() and _TMP not in path.name and _OLD not in path.name
        and (path / INDEX_NAME).is_file() and (path / "config.json").is_file()
    )


def latest_checkpoint(root: str | os.PathLike, prefix: str = "checkpoint-") -> pathlib.Path | None:
    """The complete ``<root>/<prefix><step>`` directory with the highest step, or None.

    Directories of interrupted saves (``.tmp-`` names, no index) are skipped.
    """
    root = pathlib.Path(root)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = re.fullmatch(re.escape(prefix) + r"(\d+)", p.name)
        if m and is_complete_checkpoint(p):
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def load_training_state(
    model,
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
    """
    from .train import param_layout

    directory = pathlib.Path(directory)
    ctx = model.ctx
    with collective_errors(ctx, "loading the training state"):
        if not is_complete_checkpoint(directory):
            raise FileNotFoundError(f"{directory} is not a complete checkpoint (no {INDEX_NAME} or config.json); pass one save_pretrained wrote")
        state_path = directory / TRAINER_STATE_NAME
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        if optimizer is not None:
            _load_optimizer(model, optimizer, directory, param_layout(model))
        if scheduler is not None:
            path = directory / SCHEDULER_NAME
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist: the checkpoint was saved without scheduler=")
            scheduler.load_state_dict(torch.load(path, weights_only=False))
        if rng:
            path = directory / RNG_DIR / f"rank-{ctx.rank:05d}.pt"
            if state.get("world_size") == ctx.world_size and path.is_file():
                _set_rng_state(torch.load(path, weights_only=False))
            else:
                warnings.warn(
                    f"not restoring RNG state: the checkpoint was written by {state.get('world_size')} ranks, this job has "
                    f"{ctx.world_size}; a resumed run then draws different dropout masks than an uninterrupted one",
                    stacklevel=2,
                )
    return state


def _load_optimizer(model, optimizer, directory: pathlib.Path, layout) -> None:
    index_path = directory / OPTIMIZER_DIR / "index.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} does not exist: the checkpoint was saved without optimizer=")
    files = json.loads(index_path.read_text())["state_files"]
    key_of_param: dict[int, str] = {}
    for stage in model.stages:
        for name, p in stage.named_parameters(remove_duplicate=False):
            key_of_param.setdefault(id(p), layout.key_of.get(name, name))
    keys = [key_of_param.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if any(k is None for k in keys):
        raise ValueError("the optimizer holds a parameter that is not one of this model's stage parameters; build it from model.parameters()")
    own = f"pp-{model.pp_rank:05d}.pt"
    needed = sorted({files[k] for k in keys if k in files} | ({own} if (directory / OPTIMIZER_DIR / own).is_file() else set()))
    saved: dict[str, dict] = {}
    for name in needed:
        saved[name] = torch.load(directory / OPTIMIZER_DIR / name, map_location=model.device, weights_only=True)
    groups_from = saved.get(own) or next(iter(saved.values()), None)
    if groups_from is None:
        raise FileNotFoundError(f"no optimizer state in {directory / OPTIMIZER_DIR} for this rank's parameters")
    if len(groups_from["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the saved optimizer has {len(groups_from['param_groups'])} parameter groups, this one "
            f"{len(optimizer.param_groups)}; build the optimizer the way the saved run did"
        )
    state = {}
    for i, key in enumerate(keys):
        if key in files and key in saved[files[key]]["state"]:
            state[i] = saved[files[key]]["state"][key]
    groups, i = [], 0
    for saved_group, group in zip(groups_from["param_groups"], optimizer.param_groups):
        n = len(group["params"])
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": list(range(i, i + n))})
        i += n
    optimizer.load_state_dict({"state": state, "param_groups": groups})
