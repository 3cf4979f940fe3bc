"""Checkpoints of a pipelined model: a normal transformers checkpoint, written by every rank at once.

``model.save_pretrained(dir)`` writes what ``transformers``' own ``save_pretrained`` of the unsplit
model would write — safetensors shards, ``model.safetensors.index.json``, ``config.json`` (and
``generation_config.json`` for generative heads) — so ``transformers.AutoModelFor*.from_pretrained(dir)``
(or ``hf_pipeline``'s ``pipeline=True``) loads it. No rank gathers the model: each pipeline rank of
the first data-parallel replica writes the tensors its stages own into its own shards. A tensor
held by several stages (a tied embedding / LM head, T5's replicated relative bias) is written once,
by the first stage holding it, under the key transformers keeps for it. Tensors transformers converts
on load are written as its save writes them, through its own ``revert_weight_conversion`` of each
rank's tensors (mixture-of-experts layers one tensor per expert, GPT-NeoX's ``embed_out``): the
conversions the loaded checkpoint went through are reverted, as ``from_pretrained`` records them.

Like transformers, a save into an existing directory writes and overwrites only the checkpoint's
own files (config, generation config, weight shards, index) and removes only stale weight files:
``model.safetensors`` and ``model*-NNNNN-of-NNNNN.safetensors`` files the new index does not list.
Everything else (a tokenizer, a README, scripts, subdirectories, ``notes.safetensors``) stays, so
``save_pretrained(".")`` and saving back into the directory a model was loaded from are safe.

Training state is written only when asked for (``optimizer=`` / ``scheduler=`` / ``step=`` /
``trainer_state=``), beside the weights, and :func:`~.training_state.load_training_state` restores it so a resumed
run continues bitwise where it stopped (see :mod:`.training_state` for the files). A plain
``save_pretrained(dir)`` writes none of it.

A save is crash safe: a kill of any rank at any instant leaves the old or the new checkpoint
complete (every rank stages its files, rank 0 moves them into place with the index last; see
:mod:`.staging`). Where things live: the file names and :func:`~.layout.latest_checkpoint` in
:mod:`.layout`, training state and :func:`~.training_state.load_training_state` in :mod:`.training_state`,
flushed writes and full-disk messages in :mod:`.durable`; this module plans and runs the save.

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
import os
import pathlib
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..core import PipelineCore
from ..distributed.agreement import collective_errors
from ..distributed.shards import full_tensor
from ..errors import CheckpointExistsError, InputError, InternalError
from ..loading.checkpoint_files import INDEX_NAME, SAVE_STAGING_PREFIX, name_listing
from ..loading.key_conversions import saved_shapes, saved_tensors
from ..planning.options import parse_size
from .directory import OPTIMIZER_DIR, RNG_DIR, SAVE_ID_KEY
from .durable import fsync, reporting_full_disk, write_json
from .lock import acquire_save_lock, check_inside, release_save_lock
from .staging import SaveProgress, publish, remove_failed_save, shard_file_names
from .state_shards import writes_pipeline_state
from .training_state import (
    optimizer_file_name,
    optimizer_state_by_key,
    stage_main_training_state,
    stage_rank_training_state,
)

__all__ = ["save_pretrained"]

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
@dataclass(kw_only=True, frozen=True)
class _RankPlan:
    """What one rank will write; gathered on every rank before anything is written."""

    rank: int
    pp_rank: int
    shards: list[list[tuple[str, int, int]]]  # per shard file: (checkpoint key, numel, bytes)
    parameters: int  # elements of the parameters written (buffers left out), counted before the reverse conversions
    optimizer_keys: list[str] | None  # keys with optimizer state (replica 0 saving an optimizer), else None


@dataclass(kw_only=True)
class _RankShare:
    """This rank's tensors and optimizer state, and how its shards cut them."""

    tensors: dict[str, torch.Tensor]  # saved key (transformers' reverse conversions applied) -> tensor
    shards: list[list[str]]  # keys per shard file
    optimizer_state: dict[str, Any] | None
    plan: _RankPlan


def _gathers(dims) -> bool:
    """Whether this rank takes part in gathering sharded tensors whole: the first replica's ranks, and every
    rank when shards span replicas (FSDP chunks; experts over data-parallel ranks, whose ep mesh holds ranks
    of several replicas: one left out would hang the others' gather)."""
    return dims.dp_rank == 0 or dims.fsdp_size > 1 or dims.ep_data > 1


def _my_tensors(model: PipelineCore) -> dict[str, torch.Tensor]:
    """checkpoint key -> tensor, for the keys whose first holding stage is on this rank (replica 0 only)."""
    if not _gathers(model.dims):
        return {}  # replicas hold the same values: the first one writes (FSDP ranks hold chunks: all gather)
    # Tensor-parallel ranks (and FSDP ranks) see the same whole tensors once gathered: the first one writes
    # them; the others drop each one at once, so they never hold more than one whole tensor.
    writes = writes_pipeline_state(model.dims)
    layout = model.param_layout
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for stage in model.stages:
        for name, t in stage.state_dict(keep_vars=True).items():
            key = layout.key_of.get(name, name)
            if key in layout.saved and key not in seen and layout.owner_stage(key) == stage.spec.index:
                seen.add(key)
                # A sharded tensor is gathered whole (collective over the stage's tensor-parallel / fsdp
                # ranks, all in this same order): the checkpoint is transformers' own, unsharded.
                whole = full_tensor(t.detach())
                if writes:
                    out[key] = whole
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


def _saved_shapes(model: PipelineCore) -> dict[str, tuple[int, ...]]:
    """Every key transformers' ``save_pretrained`` of the unsplit model writes -> its shape (meta device)."""
    return saved_shapes(model.skeleton, model.param_layout.saved, model.stage_maker.load_conversions)


def _reverted(model: PipelineCore, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's tensors as transformers' ``save_pretrained`` writes them: its reverse conversions (merged
    experts split one tensor per expert, Mixtral's ``mlp`` named ``block_sparse_moe`` again, GPT-NeoX's
    ``lm_head`` named ``embed_out``). Each one works within one module, so within one stage: the rank
    reverts its own tensors alone, and what it makes is checked against the whole model's save.

    Raises:
        InternalError: a reverse conversion needs tensors of another rank (a key or shape the whole model's
            save does not have).
    """
    if not tensors:
        return tensors
    out = saved_tensors(model.skeleton, tensors, model.stage_maker.load_conversions)
    want = _saved_shapes(model)
    wrong = sorted(k for k, t in out.items() if want.get(k) != tuple(t.shape))
    if wrong:
        raise InternalError(
            f"transformers' reverse conversion of this rank's tensors made {name_listing(wrong)}, which its "
            "save_pretrained of the whole model does not write (or not in that shape): a conversion spans stages "
            "on two ranks. Save from one process (all stages on one rank), or load with pipeline=False to save"
        )
    return out


def _rank_share(model: PipelineCore, max_shard_size: int | str, optimizer) -> _RankShare:
    layout = model.param_layout
    tensors = _my_tensors(model)
    parameters = sum(t.numel() for k, t in tensors.items() if k in layout.parameters)
    tensors = _reverted(model, tensors)
    shards = _plan_shards(tensors, parse_size(max_shard_size, what="max_shard_size"))
    # The first replica's ranks gather sharded states whole (every fsdp rank: they hold the chunks); one rank
    # per pipeline rank keeps them (None elsewhere).
    gathers = _gathers(model.dims)
    opt_state = optimizer_state_by_key(model, optimizer) if optimizer is not None and gathers else None

    def sizes(key: str) -> tuple[str, int, int]:
        return key, tensors[key].numel(), tensors[key].numel() * tensors[key].element_size()

    plan = _RankPlan(
        rank=model.ctx.rank,
        pp_rank=model.dims.pp_rank,
        shards=[[sizes(k) for k in keys] for keys in shards],
        parameters=parameters,
        optimizer_keys=sorted(opt_state["state"]) if opt_state is not None else None,
    )
    return _RankShare(tensors=tensors, shards=shards, optimizer_state=opt_state, plan=plan)


def _check_target(final: pathlib.Path, paths: list[str]) -> None:
    """The same directory on every rank, and not a file."""
    if len(set(paths)) > 1:
        listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise InputError(
            f"save_pretrained got a different directory on each rank ({listing}); pass the same path on every rank "
            "(a shared filesystem: each rank writes its own shards into it)"
        )
    if final.exists() and not final.is_dir():
        raise CheckpointExistsError(f"{final} exists and is not a directory; pass a directory path to save_pretrained")


def _gather(model: PipelineCore, obj: Any) -> list[Any]:
    ctx = model.ctx
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


def _broadcast(model: PipelineCore, obj: Any) -> Any:
    ctx = model.ctx
    if not ctx.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
def save_pretrained(
    model: PipelineCore,
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
    for what is replaced and removed, and :mod:`.staging` for why a kill at any instant leaves a
    complete checkpoint).

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
    ctx = model.ctx
    final = pathlib.Path(save_directory).absolute()
    token = _broadcast(model, uuid.uuid4().hex[:12] if ctx.is_main_process else None)
    paths = _gather(model, str(final))
    staging = final / f"{SAVE_STAGING_PREFIX}{token}"
    with_state = optimizer is not None or scheduler is not None or step is not None or trainer_state is not None

    # 1. Checks and plans on every rank; nothing is written before every rank has passed them.
    with collective_errors(ctx, "preparing the checkpoint"):
        _check_target(final, paths)
        share = _rank_share(model, max_shard_size, optimizer)
    plans: list[_RankPlan] = _gather(model, share.plan)

    created: list[pathlib.Path] = []  # directories this save made, deepest first: removed again if it fails
    progress = SaveProgress()
    try:
        # 2. Rank 0 takes the save lock, picks fresh shard names (no old file is overwritten), makes the staging.
        with collective_errors(ctx, "preparing the checkpoint directory"):
            tag = _make_staging(final, staging, plans, token, created, with_state) if ctx.is_main_process else None
        names = shard_file_names([len(p.shards) for p in plans], _broadcast(model, tag))

        # 3. Every rank stages its shards (and optimizer / RNG state when asked for), fsynced.
        with collective_errors(ctx, "writing the checkpoint"):
            _phase("begin")
            _stage_shards(staging, names[ctx.rank], share)
            stage_rank_training_state(model, staging, share.optimizer_state, with_state=with_state)
            if ctx.is_main_process:
                _stage_main(model, staging, plans, names, token, with_state=with_state, scheduler=scheduler,
                            step=step, tokenizer=tokenizer, extra=trainer_state)
            _phase("written")

        # 4. Rank 0 moves everything into place, the index last, then removes stale weight files.
        with collective_errors(ctx, "finishing the checkpoint"):
            if ctx.is_main_process:
                publish(final, staging, [n for ns in names for n in ns], progress, _phase)
    except BaseException:
        if ctx.is_main_process:  # every rank is past its writes (agreed above), or dead
            remove_failed_save(final, staging, created, progress)
        raise
    finally:  # after the clean-up: until then no other save may start here
        if ctx.is_main_process:
            release_save_lock(final, token)
    return final


def _make_staging(
    final: pathlib.Path, staging: pathlib.Path, plans: list[_RankPlan], token: str, created: list[pathlib.Path],
    with_state: bool,
) -> str | None:
    """Rank 0: take the directory's save lock and make the staging directory (and ``final``'s missing
    parents, noted in ``created``).

    Returns:
        The tag of the shard names: None for the plain ``model-0000i-of-0000n`` names, the save id
        when a file of the directory already has one of them.

    Raises:
        CheckpointExistsError: another save into ``final`` is running, or a directory the save writes
            into is a symbolic link (see :mod:`.lock`).
    """
    p = final
    while not p.exists():
        created.append(p)
        p = p.parent
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        final.mkdir()
    except FileExistsError:  # another save made it meanwhile: not ours to remove
        created[:] = [d for d in created if d != final]
    try:
        acquire_save_lock(final, token)
    except CheckpointExistsError:
        created.clear()  # the running save owns what is there
        raise
    check_inside(final, (OPTIMIZER_DIR, RNG_DIR) if with_state else ())
    plain = [n for names in shard_file_names([len(p.shards) for p in plans], None) for n in names]
    tag = token if any((final / n).exists() for n in plain) else None
    staging.mkdir()
    if with_state:
        (staging / OPTIMIZER_DIR).mkdir()
        (staging / RNG_DIR).mkdir()
    return tag


def _stage_shards(staging: pathlib.Path, names: list[str], share: _RankShare) -> None:
    """This rank's safetensors shards, each flushed to disk."""
    import safetensors.torch  # save_file looked up at call time (tests replace it)

    for name, keys in zip(names, share.shards):
        path = staging / name
        with reporting_full_disk(path):
            tensors = {k: share.tensors[k].contiguous().cpu() for k in keys}
            safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
            fsync(path)
        _phase("shard")


def _stage_main(
    model: PipelineCore, staging: pathlib.Path, plans: list[_RankPlan], names: list[list[str]], token: str, *,
    with_state: bool,
    scheduler, step, tokenizer, extra,
) -> None:
    """Rank 0's share of the staging: index, config, generation config, tokenizer, training state."""
    weight_map, total_size = _weight_map(set(_saved_shapes(model)), plans, names)
    total_params = sum(p.parameters for p in plans)
    _stage_config(model, staging)
    if tokenizer is not None:
        with reporting_full_disk(staging):
            tokenizer.save_pretrained(staging)
    optimizer_files = None
    if any(p.optimizer_keys is not None for p in plans):  # an optimizer without state (plain SGD) too
        optimizer_files = {k: optimizer_file_name(p.pp_rank) for p in plans for k in p.optimizer_keys or ()}
    stage_main_training_state(
        model, staging, token, optimizer_files=optimizer_files, scheduler=scheduler, step=step, extra=extra,
        with_state=with_state,
    )
    metadata = {"total_size": total_size, "total_parameters": total_params, SAVE_ID_KEY: token}
    write_json(staging / INDEX_NAME, {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})
    for p in staging.rglob("*"):  # config / tokenizer files were written by transformers: flush them too
        if p.is_file():
            with reporting_full_disk(p):
                fsync(p)


def _weight_map(saved: set[str], plans: list[_RankPlan], names: list[list[str]]) -> tuple[dict[str, str], int]:
    """The index's key -> shard file map over every rank, with the total bytes.

    Raises:
        InternalError: a key written by two ranks or by none (the stage plan broke).
    """
    weight_map: dict[str, str] = {}
    total_size = 0
    for plan, rank_names in zip(plans, names):
        for shard, name in zip(plan.shards, rank_names):
            for key, _, nbytes in shard:
                if key in weight_map:
                    raise InternalError(
                        f"checkpoint key {key!r} was written by two ranks; the stage plan is inconsistent"
                    )
                weight_map[key] = name
                total_size += nbytes
    missing = sorted(saved - set(weight_map))
    if missing:
        raise InternalError(
            f"no rank wrote {missing[:5]}{' ...' if len(missing) > 5 else ''}; the stage plan does not cover the model"
        )
    return weight_map, total_size


def _stage_config(model: PipelineCore, staging: pathlib.Path) -> None:
    """``config.json`` as transformers writes it for the unsplit model, and the generation config."""
    with reporting_full_disk(staging / "config.json"):
        config = copy.deepcopy(model.config)
        config.dtype = str(model.plan.dtype).removeprefix("torch.")  # as transformers writes it
        config.architectures = [type(model.skeleton).__name__]
        config.save_pretrained(staging)
        if model.skeleton.can_generate():
            from ..generation.generate import generation_config

            generation_config(model).save_pretrained(staging)
