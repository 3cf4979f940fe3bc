"""Checkpoints of a pipelined model: a normal transformers checkpoint, written by every rank at once.

``model.save_pretrained(dir)`` writes what ``transformers``' own ``save_pretrained`` of the unsplit
model would write — safetensors shards, ``model.safetensors.index.json``, ``config.json`` (and
``generation_config.json`` for generative heads) — so ``transformers.AutoModelFor*.from_pretrained(dir)``
(or ``hf_pipeline``'s ``pipeline=True``) loads it. No rank gathers the model: each pipeline rank of
the first data-parallel replica writes the tensors its stages own into its own shards. A tensor
held by several stages (a tied embedding / LM head, T5's replicated relative bias) is written once,
by the first stage holding it, under the key transformers keeps for it.

Like transformers, a save into an existing directory writes and overwrites only the checkpoint's
own files (config, generation config, weight shards, index) and removes only stale weight files:
``model.safetensors`` and ``model*-NNNNN-of-NNNNN.safetensors`` files the new index does not list.
Everything else (a tokenizer, a README, scripts, subdirectories, ``notes.safetensors``) stays, so
``save_pretrained(".")`` and saving back into the directory a model was loaded from are safe.

Training state is written only when asked for: with ``optimizer=`` / ``scheduler=`` / ``step=`` /
``trainer_state=`` it goes beside the weights: ``optimizer/pp-XXXXX.pt`` (one file per pipeline
rank, states keyed by checkpoint key, with ``optimizer/index.json``), ``scheduler.pt``,
``rng/rank-XXXXX.pt`` (every global rank's RNG states) and ``trainer_state.json``.
:func:`load_training_state` restores them, so a resumed run continues bitwise where it stopped
(same world size, CPU). A plain ``save_pretrained(dir)`` writes none of these.

Crash safety (a kill of any rank at any instant leaves the old or the new checkpoint complete, and
found by ``from_pretrained(dir)`` and :func:`latest_checkpoint`): every rank writes (and fsyncs)
its files into a hidden staging directory ``<dir>/.hf_pipeline.tmp-<save id>``; once every rank
has finished (agreed through a collective), rank 0 moves them into place with ``os.replace``:
first the shards, under names no file of the directory has (``model-0000i-of-0000n.safetensors``,
or ``model-<save id>-0000i-of-0000n.safetensors`` when those exist already), then the training
state, tokenizer and config, and the index last: replacing the index is the one instant the
checkpoint switches from old to new. Only then are the stale weight files removed. Kill points:

- before or between shards, before the agreement: only the staging directory is new; the old
  checkpoint is untouched (a new directory has no index, so it is never taken for a checkpoint).
- while rank 0 moves shards in: the new files have names the old index does not list, so the
  old checkpoint stays complete; the loader ignores files no index lists.
- before the index (config, tokenizer, training state already replaced): the old index still
  lists the old, untouched shards. The config is the new one: for a save of the same model (a
  resume, a fine-tune saved back) it describes the old weights as well. Training state replaced
  in place belongs to the new save: :func:`load_training_state` sees its save id differ from the
  index's and refuses to pair it with the old weights (only when overwriting a directory that
  holds training state; fresh ``checkpoint-N`` directories have no such window).
- after the index: it lists only new shards, all present and fsynced: the new checkpoint is
  complete. Stale files (and the old ``model.safetensors``, which transformers would load in
  preference to an index until it is removed — a complete old checkpoint) are listed by no index.
A killed save leaves its staging directory behind; the loader ignores it and warns, and the next
save into the directory removes it. A save that fails (raises on any rank) removes what it wrote,
and the directory too if it created it.

Example:
    >>> model.save_pretrained("out/checkpoint-100", optimizer=opt, scheduler=sched, step=100)
    >>> # later, possibly in a new job:
    >>> path = latest_checkpoint("out")
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    >>> state = load_training_state(model, path, optimizer=opt, scheduler=sched)   # state["step"] == 100
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import pathlib
import random
import re
import shutil
import tempfile
import uuid
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..distributed.agreement import collective_errors
from ..loading.weights import SAVE_STAGING_PATTERN, SAVE_STAGING_PREFIX
from ..log import get_logger
from ..planning.options import parse_size

logger = get_logger(__name__)

__all__ = [
    "INDEX_NAME",
    "WEIGHT_FILE_PATTERN",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "load_training_state",
    "replace_file",
    "save_pretrained",
]

INDEX_NAME = "model.safetensors.index.json"  # replaced last: the instant a save becomes the checkpoint
SINGLE_NAME = "model.safetensors"
TRAINER_STATE_NAME = "trainer_state.json"
SCHEDULER_NAME = "scheduler.pt"
OPTIMIZER_DIR = "optimizer"
RNG_DIR = "rng"
# Weight files a save may remove when its index does not list them: transformers' own rule for
# stale shards (a name starting with "model" and ending in -NNNNN-of-NNNNN), safetensors only.
WEIGHT_FILE_PATTERN = re.compile(r"model.*-\d{5}-of-\d{5}\.safetensors")
SAVE_ID_KEY = "hf_pipeline_save_id"  # in the index metadata and trainer_state.json: which save wrote them
_TMP = ".tmp-"
_OLD = ".old-"
_FORMAT = 1

# Test hook: when set, called with the phase name on the rank passing it. Phases: "begin" (nothing
# written), "shard" (after each of this rank's shard files is staged), "written" (this rank staged
# everything), and on rank 0 "moved" (after each shard is moved into place), "before_index",
# "after_index" and "cleaned" (stale files removed). Tests kill the process there.
save_phase_hook: Callable[[str], None] | None = None


def _phase(name: str) -> None:
    if save_phase_hook is not None:
        save_phase_hook(name)


# --------------------------------------------------------------------------------------------
# What this rank writes
# --------------------------------------------------------------------------------------------
def _my_tensors(model) -> dict[str, torch.Tensor]:
    """checkpoint key -> tensor, for the keys whose first holding stage is on this rank (replica 0 only)."""
    if model.dims.dp_rank != 0:
        return {}  # replicas hold the same values: the first one writes
    layout = model.param_layout
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
    layout = model.param_layout
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


# --------------------------------------------------------------------------------------------
# Writing files: staged, fsynced, a full disk named
# --------------------------------------------------------------------------------------------
def _fsync(path: pathlib.Path) -> None:
    """Flush a file's data (or a directory's entries) to disk: a rename is durable only after both."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _disk_of(path: pathlib.Path) -> str:
    """``the disk mounted at /x (tmpfs, tmpfs, 2.0 KiB free of 64.0 KiB)``: the filesystem holding ``path``."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    device = ""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[1] == str(mount):
                device = f"{fields[0]}, {fields[2]}, "  # the last entry wins: it is the one mounted on top
    try:
        usage = shutil.disk_usage(p)
        space = f"{_human(usage.free)} free of {_human(usage.total)}"
    except OSError:
        space = "free space unknown"
    return f"the disk mounted at {mount} ({device}{space})"


# How a full disk (or quota) shows: OSError ENOSPC/EDQUOT, safetensors' "... (os error 28)", and
# torch.save's short write "[enforce fail at inline_container.cc] unexpected pos".
_DISK_FULL = ("No space left on device", "os error 28", "StorageFull", "Disk quota exceeded", "unexpected pos")


@contextlib.contextmanager
def _writing(path: pathlib.Path) -> Iterator[None]:
    """Turn a full disk while writing ``path`` into an ``OSError`` (ENOSPC) that names the disk and the file."""
    try:
        yield
    except Exception as e:
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if not (full or any(s in str(e) for s in _DISK_FULL)):
            raise
        error = OSError(
            f"No space left on device: writing {path} failed on {_disk_of(path)}; free space there or save to another disk"
        )
        error.errno = errno.ENOSPC
        raise error from e


def replace_file(path: str | os.PathLike, text: str) -> None:
    """Replace the file ``path`` with ``text`` all at once: a process stopped while writing leaves the
    old file or the new one, never part of one.

    The text goes to a temporary file of its own beside ``path`` (unique per call, so two threads
    writing the same file never share one: with a shared name, one writer's rename can publish the
    file the other has just truncated), renamed over ``path`` once complete and removed if the write
    fails. A full disk is an ``OSError`` naming the disk.
    """
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with _writing(path), os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def _save_torch(obj: Any, path: pathlib.Path) -> None:
    with _writing(path):
        torch.save(obj, path)
        _fsync(path)


def _write_json(path: pathlib.Path, data: Any) -> None:
    with _writing(path):
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        _fsync(path)


def _shard_names(plans: list[dict], tag: str | None) -> list[list[str]]:
    """Per rank, the file names of its shards: ``model[-<tag>]-0000i-of-0000n.safetensors``, numbered across ranks."""
    total = sum(len(p["shards"]) for p in plans)
    infix = f"-{tag}" if tag else ""
    out, first = [], 0
    for p in plans:
        out.append([f"model{infix}-{first + i + 1:05d}-of-{total:05d}.safetensors" for i in range(len(p["shards"]))])
        first += len(p["shards"])
    return out


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
    """Write a transformers checkpoint from every rank, and training state when asked for. Collective.

    Files in ``save_directory`` that are not the checkpoint's own are kept (see the module docstring
    for what is replaced, what is removed and why a kill at any instant leaves a complete checkpoint).

    Args:
        model: the :class:`~hf_pipeline.model.PipelinedModel`.
        save_directory: the checkpoint directory (created if missing; the same path on every rank).
        optimizer: this rank's optimizer; its state is written per pipeline rank, keyed by checkpoint key.
        scheduler: an LR scheduler (anything with ``state_dict()``), written by rank 0.
        step: the training step reached, kept in ``trainer_state.json``.
        max_shard_size: largest shard file per rank (``"5GB"``, ``"500MB"``, bytes).
        tokenizer: a tokenizer / processor saved into the checkpoint by rank 0 (``save_pretrained``).
        trainer_state: extra JSON-serialisable values kept in ``trainer_state.json``.

    Any of ``optimizer``, ``scheduler``, ``step`` or ``trainer_state`` asks for the training state:
    then RNG states and ``trainer_state.json`` are written too. Without them only the HF checkpoint is.

    Returns:
        The checkpoint directory.

    Example:
        >>> model.save_pretrained("out/checkpoint-100", optimizer=opt, scheduler=sched, step=100)
    """
    import safetensors.torch  # save_file looked up at call time (tests replace it)

    ctx = model.ctx
    final = pathlib.Path(save_directory).absolute()
    token = _broadcast(model, uuid.uuid4().hex[:12] if ctx.is_main_process else None)
    paths = _gather(model, str(final))
    staging = final / f"{SAVE_STAGING_PREFIX}{token}"
    with_state = optimizer is not None or scheduler is not None or step is not None or trainer_state is not None
    layout = model.param_layout

    # 1. Checks and plans on every rank; nothing is written before every rank has passed them.
    with collective_errors(ctx, "preparing the checkpoint"):
        if len(set(paths)) > 1:
            listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
            raise ValueError(
                f"save_pretrained got a different directory on each rank ({listing}); pass the same path on every rank "
                "(a shared filesystem: each rank writes its own shards into it)"
            )
        if final.exists() and not final.is_dir():
            raise FileExistsError(f"{final} exists and is not a directory; pass a directory path to save_pretrained")
        tensors = _my_tensors(model)
        shards = _plan_shards(tensors, parse_size(max_shard_size, what="max_shard_size"))
        opt_state = _optimizer_state(model, optimizer) if optimizer is not None and model.dims.dp_rank == 0 else None
        my_plan = {
            "rank": ctx.rank,
            "shards": [[(k, tensors[k].numel(), tensors[k].numel() * tensors[k].element_size()) for k in keys] for keys in shards],
            "optimizer_keys": sorted(opt_state["state"]) if opt_state is not None else None,
            "pp_rank": model.dims.pp_rank,
        }
    plans = _gather(model, my_plan)

    # 2. Rank 0 picks shard names that no file in the directory has (so that no file the old index
    #    lists is ever overwritten) and makes the staging directory.
    created: list[pathlib.Path] = []  # directories this save made, deepest first: removed again if it fails
    progress = {"committed": False, "moved": []}
    try:
        tag = None
        with collective_errors(ctx, "preparing the checkpoint directory"):
            if ctx.is_main_process:
                plain = [n for names in _shard_names(plans, None) for n in names]
                tag = token if any((final / n).exists() for n in plain) else None
                p = final
                while not p.exists():
                    created.append(p)
                    p = p.parent
                staging.mkdir(parents=True)
                if with_state:
                    (staging / OPTIMIZER_DIR).mkdir()
                    (staging / RNG_DIR).mkdir()
        tag = _broadcast(model, tag)
        names = _shard_names(plans, tag)

        # 3. Every rank stages its shards (and optimizer / RNG state when asked for), fsynced.
        with collective_errors(ctx, "writing the checkpoint"):
            _phase("begin")
            for name, keys in zip(names[ctx.rank], shards):
                path = staging / name
                with _writing(path):
                    safetensors.torch.save_file({k: tensors[k].contiguous().cpu() for k in keys}, str(path), metadata={"format": "pt"})
                    _fsync(path)
                _phase("shard")
            if opt_state is not None:
                _save_torch(opt_state, staging / OPTIMIZER_DIR / f"pp-{model.dims.pp_rank:05d}.pt")
            if with_state:
                _save_torch(_rng_state(), staging / RNG_DIR / f"rank-{ctx.rank:05d}.pt")
            if ctx.is_main_process:
                _stage_main(model, staging, plans, names, layout, token, with_state=with_state,
                            scheduler=scheduler, step=step, tokenizer=tokenizer, extra=trainer_state)
            _phase("written")

        # 4. Rank 0 moves everything into place, the index last, then removes stale weight files.
        with collective_errors(ctx, "finishing the checkpoint"):
            if ctx.is_main_process:
                _publish(final, staging, [n for ns in names for n in ns], progress)
    except BaseException:
        if ctx.is_main_process:  # every rank is past its writes (agreed above), or dead
            _remove_failed(final, staging, created, progress)
        raise
    return final


def _stage_main(model, staging: pathlib.Path, plans, names, layout, token: str, *, with_state: bool, scheduler, step, tokenizer, extra) -> None:
    """Rank 0's share of the staging: index, config, generation config, tokenizer, training state."""
    weight_map: dict[str, str] = {}
    total_size = 0
    total_params = 0
    for plan, rank_names in zip(plans, names):
        for shard, name in zip(plan["shards"], rank_names):
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

    with _writing(staging / "config.json"):
        config = copy.deepcopy(model.config)
        config.dtype = str(model.plan.dtype).removeprefix("torch.")  # as transformers writes it
        config.architectures = [type(model.skeleton).__name__]
        config.save_pretrained(staging)
        if model.skeleton.can_generate():
            from ..generation.generate import generation_config

            generation_config(model).save_pretrained(staging)
    if tokenizer is not None:
        with _writing(staging):
            tokenizer.save_pretrained(staging)
    if scheduler is not None:
        _save_torch(scheduler.state_dict(), staging / SCHEDULER_NAME)
    if with_state:
        optimizer_index = {k: f"pp-{p['pp_rank']:05d}.pt" for p in plans if p["optimizer_keys"] for k in p["optimizer_keys"]}
        if any(p["optimizer_keys"] is not None for p in plans):  # an optimizer without state (plain SGD) too
            _write_json(staging / OPTIMIZER_DIR / "index.json", {"format": _FORMAT, "state_files": optimizer_index})
        plan = model.plan
        _write_json(staging / TRAINER_STATE_NAME, {
            **(extra or {}),
            "format": _FORMAT, "step": step, "world_size": model.ctx.world_size, "pp_size": plan.pp_size,
            "dp_size": model.dims.dp_size, "num_stages": plan.num_stages, "virtual_stages": plan.virtual_stages,
            "schedule": model.schedule.name, "n_microbatches": model.n_microbatches, "model_class": type(model.skeleton).__name__,
            "stage_blocks": [list(s.blocks) for s in plan.stages], SAVE_ID_KEY: token,
        })
    metadata = {"total_size": total_size, "total_parameters": total_params, SAVE_ID_KEY: token}
    _write_json(staging / INDEX_NAME, {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})
    for p in staging.rglob("*"):  # config / tokenizer files were written by transformers: flush them too
        if p.is_file():
            with _writing(p):
                _fsync(p)


def _publish_order(rel: pathlib.Path) -> int:
    """Training state first (trainer_state.json, which names the save, last of it), then other files, config last."""
    if rel.parts[0] in (OPTIMIZER_DIR, RNG_DIR) or rel.name == SCHEDULER_NAME:
        return 0
    return {TRAINER_STATE_NAME: 1, "generation_config.json": 3, "config.json": 4}.get(str(rel), 2)


def _publish(final: pathlib.Path, staging: pathlib.Path, shard_names: list[str], progress: dict) -> None:
    """Move the staged files into ``final``: shards, training state, tokenizer, config, then the index; then clean up.

    Until the index is replaced the old index lists only old files, which nothing here touches (new
    shard names are fresh); from that instant the new index lists only new files, all in place.
    """
    for name in shard_names:
        os.replace(staging / name, final / name)
        progress["moved"].append(final / name)
        _phase("moved")
    listed = set(shard_names)
    rest = sorted(
        (p.relative_to(staging) for p in staging.rglob("*") if p.is_file()),
        key=lambda r: (_publish_order(r), str(r)),
    )
    rest = [r for r in rest if str(r) != INDEX_NAME and str(r) not in listed]
    dirs = {final}
    for rel in rest:
        target = final / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, target)
        dirs.add(target.parent)
    for d in dirs:
        _fsync(d)
    _phase("before_index")
    os.replace(staging / INDEX_NAME, final / INDEX_NAME)  # the switch from the old checkpoint to the new one
    _fsync(final)
    progress["committed"] = True
    _phase("after_index")
    for p in final.iterdir():
        if p.name in listed or not p.is_file():
            continue
        if p.name == SINGLE_NAME or WEIGHT_FILE_PATTERN.fullmatch(p.name):
            p.unlink()  # a stale weight file; an old model.safetensors would shadow the index for transformers
    shutil.rmtree(staging, ignore_errors=True)
    for p in final.iterdir():  # staging directories of earlier saves that were killed
        if SAVE_STAGING_PATTERN.fullmatch(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    _phase("cleaned")


def _remove_failed(final: pathlib.Path, staging: pathlib.Path, created: list[pathlib.Path], progress: dict) -> None:
    """After a failed save: remove what it wrote (and the directories it made) unless the index was already replaced."""
    shutil.rmtree(staging, ignore_errors=True)
    if progress["committed"]:
        return  # the new checkpoint is complete; only the clean-up after it failed
    for path in progress["moved"]:  # fresh names: nothing of the old checkpoint
        with contextlib.suppress(OSError):
            path.unlink()
    if created and created[0] == final:
        shutil.rmtree(final, ignore_errors=True)
    for d in created:
        with contextlib.suppress(OSError):
            d.rmdir()  # a parent made for this save, if it is still empty


# --------------------------------------------------------------------------------------------
# Finding and resuming
# --------------------------------------------------------------------------------------------
def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory that a finished save left: config and index present, every file the index lists too.

    Files no index lists (a killed save's staging directory, stale shards) do not matter.
    """
    path = pathlib.Path(path)
    if not (path.is_dir() and _TMP not in path.name and _OLD not in path.name and (path / "config.json").is_file()):
        return False
    try:
        files = set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return all(isinstance(f, str) and (path / f).is_file() for f in files)


def latest_checkpoint(root: str | os.PathLike, prefix: str = "checkpoint-") -> pathlib.Path | None:
    """The complete ``<root>/<prefix><step>`` directory with the highest step, or None.

    Directories of interrupted saves (no index yet, or ``.tmp-`` names of older versions) are skipped;
    a checkpoint overwritten by a save that was killed is found with its old or its new contents.
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
    directory = pathlib.Path(directory)
    ctx = model.ctx
    with collective_errors(ctx, "loading the training state"):
        if not is_complete_checkpoint(directory):
            raise FileNotFoundError(f"{directory} is not a complete checkpoint: {_why_incomplete(directory)}")
        state_path = directory / TRAINER_STATE_NAME
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        weights_id = json.loads((directory / INDEX_NAME).read_text()).get("metadata", {}).get(SAVE_ID_KEY)
        if state.get(SAVE_ID_KEY) and weights_id and state[SAVE_ID_KEY] != weights_id:
            raise ValueError(
                f"the training state in {directory} was written by another save than its weights ({TRAINER_STATE_NAME} "
                f"names save {state[SAVE_ID_KEY]}, {INDEX_NAME} save {weights_id}): a later save_pretrained into this "
                "directory without optimizer=/step=, or one killed while replacing it. Resume from a checkpoint saved "
                "with its training state, or load the weights alone"
            )
        if optimizer is not None:
            _load_optimizer(model, optimizer, directory, model.param_layout)
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
                logger.warning(
                    "not restoring RNG state: the checkpoint was written by %s ranks, this job has %s; a resumed run "
                    "then draws different dropout masks than an uninterrupted one", state.get("world_size"), ctx.world_size,
                )
    return state


def _why_incomplete(path: pathlib.Path) -> str:
    """Why :func:`is_complete_checkpoint` refuses ``path``, and what to pass instead."""
    if not path.is_dir():
        return "it does not exist or is not a directory; pass the directory save_pretrained wrote"
    if path.name.startswith(SAVE_STAGING_PREFIX):
        return (
            f"it is the staging directory of a save_pretrained into {path.parent} that did not finish (killed or failed), "
            f"and its files may be partial; pass {path.parent} itself, or latest_checkpoint(root) for the last complete one"
        )
    if _TMP in path.name or _OLD in path.name:
        marker = _TMP if _TMP in path.name else _OLD
        return (
            f"its name {path.name!r} contains {marker!r}, which marks a directory an interrupted save left behind, so it "
            "is never taken for a checkpoint whatever it holds; pass the checkpoint directory, or rename this one "
            f"without {marker!r} if it is a complete checkpoint of yours"
        )
    if not (path / "config.json").is_file():
        return "it has no config.json; pass the directory save_pretrained wrote"
    try:
        files = json.loads((path / INDEX_NAME).read_text())["weight_map"].values()
    except FileNotFoundError:
        return f"it has no {INDEX_NAME}; pass a directory save_pretrained wrote (it always writes the index)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {INDEX_NAME} cannot be read ({type(e).__name__}: {e}); re-save the checkpoint"
    missing = sorted({f for f in files if not (isinstance(f, str) and (path / f).is_file())}, key=str)
    return f"{INDEX_NAME} lists {len(missing)} shard(s) that are not there (e.g. {missing[0]!r}); the save or copy is incomplete"


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
    own = f"pp-{model.dims.pp_rank:05d}.pt"
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
