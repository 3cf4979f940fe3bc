"""Pipelined training: one global batch forward + backward through torch's schedules, gradients synced.

``model.train_step(batch)`` runs torch.distributed.pipelining's schedule (GPipe, 1F1B,
interleaved 1F1B, looped BFS, the zero-bubble schedules) over this rank's stages and leaves in
every parameter's ``.grad`` exactly the gradient transformers would compute on one process for
the same batch. What it adds around the schedule:

* **The loss.** Each microbatch's loss is its summed loss divided by the number of real items
  (tokens not labelled -100, or rows) of the WHOLE global batch, counted from the labels before
  the step on every rank; torch backpropagates it unscaled (``scale_grads=False``). The
  microbatch losses then add up to the global mean, whatever the token counts per microbatch
  (see ``losses.py``). The last stage's rank sums them; one all-reduce gives it to every rank.
* **Keys held by several stages.** A tied embedding / LM head on different stages, or T5's
  relative position bias replicated on stages that start mid-stack, are one tensor in the model:
  their gradients are summed over every stage that holds them (locally when one rank holds both)
  so the copies see the same gradient and stay equal after any number of optimizer steps.
* **Data parallelism.** With ``world = pp x dp`` each replica takes rows
  ``[dp_rank * B/dp, (dp_rank+1) * B/dp)`` of the global batch; since every loss is already
  divided by the global item count, gradients are *summed* over replicas, which is the
  token-weighted average — the gradient of the full batch on one pipeline. FSDP ranks are data-parallel
  ranks too, but each stage's reduce-scatter sums their gradients (torch's ``PipelineStage`` runs it once,
  after the last backward; with replicas of fsdp pipelines, HSDP, FSDP2 also all-reduces the chunks over
  them) and only tied keys are summed here (``flat_reduce.fsdp_sync_group``), with the whole tensors FSDP
  does not shard (an adapter's, added after loading), summed over the data-parallel ranks as replicas'
  (``flat_reduce.replicated_keys``).
* **Gradient accumulation.** Gradients from earlier steps are set aside during a step and added back after
  the sync; ``loss_scale=1/k`` scales a step's gradients as ``(loss / k).backward()`` would.

Every collective here has one fixed shape per model (the sync buckets follow the stage plan). With
``output_router_logits=True`` the routers' load-balancing loss is added exactly (``router_aux.py``).

Example (``torchrun --nproc_per_node 2 train.py``):
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, schedule="interleaved-1f1b", n_microbatches=8)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    >>> for batch in loader:
    ...     loss = model.train_step(batch)          # same value on every rank
    ...     model.clip_grad_norm_(1.0)          # clipping.py
    ...     opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..core import PipelineCore
from ..distributed.agreement import fingerprint, raise_on_any_rank
from ..distributed.shards import local_tensor, on_expert_mesh
from ..errors import InputError, InputTypeError
from ..families.losses import LossFunction, PipelineLoss, get_loss
from ..families.router_loss import RouterAux, router_aux_of
from ..planning.schedules import check_training
from ..runtime import weight_pass
from ..runtime.cache import run_local_stages, signature, split_microbatches
from ..runtime.checks import check_microbatches, check_model_inputs
from .flat_reduce import all_reduce_flat, fsdp_sync_group, replicated_keys
from .router_aux import aux_pass, forward_only

__all__ = ["TrainStepState", "forward_arguments", "train_state", "train_step"]

# Inputs a training step cannot take: caches and precomputed encoder outputs belong to generation.
_NOT_FOR_TRAINING = ("past_key_values", "encoder_outputs", "cache_position", "use_cache", "logits_to_keep")


# --------------------------------------------------------------------------------------------
# Per-model training state: loss function, sync buckets, process groups
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class _LocalKey:
    key: str
    params: list[nn.Parameter]  # this rank's distinct Parameters for the key, in stage order
    shared: bool  # held by more than one stage (always synced, zeros for a missing grad)


@dataclass(kw_only=True)
class TrainStepState:
    """What the training step of one model keeps between steps (``model.train_step_state``)."""

    loss: LossFunction
    loss_fn: PipelineLoss
    accepted: frozenset[str]  # input names the model's forward takes
    local: list[_LocalKey]
    # one sync bucket per set of pipeline ranks holding its keys: (group or None, keys)
    buckets: list[tuple[dist.ProcessGroup | None, list[_LocalKey]]]
    norm_params: list[nn.Parameter]  # counted once in the global gradient norm
    params: list[nn.Parameter] = field(default_factory=list)  # every distinct local Parameter
    router_aux: RouterAux | None = None  # the routers' load-balancing loss transformers adds (router_aux.py)
    loss_fns: dict[LossFunction, PipelineLoss] = field(default_factory=dict)


def forward_arguments(skeleton: nn.Module) -> frozenset[str]:
    """The input names ``skeleton``'s forward takes by name (not through its ``**kwargs``, which it ignores)."""
    sig = inspect.signature(type(skeleton).forward)
    return frozenset(
        n for n, p in sig.parameters.items() if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )


def _group_for(model: PipelineCore, pp_ranks: tuple[int, ...], made: dict) -> dist.ProcessGroup | None:
    """The process group of these pipeline ranks in every data-parallel replica, at this rank's
    tensor-parallel slot (None: nothing to reduce)."""
    ctx, dims = model.ctx, model.dims
    if dims.fsdp_size > 1:
        return fsdp_sync_group(ctx, dims, pp_ranks, made)
    ranks = dims.ranks(pp_ranks, dims.tp_rank)
    if len(ranks) == 1 or not ctx.is_distributed:
        return None
    if len(ranks) == ctx.world_size:
        return ctx.group
    if len(pp_ranks) == 1:
        return dims.dp_group  # one pipeline rank in every replica: the data-parallel group
    if dims.dp_size == 1 and len(pp_ranks) == dims.pp_size:
        return dims.pp_group or ctx.group
    # Collective over the world: every rank creates every slot's group, in the same (sorted) order.
    for slot in range(dims.tp_size):
        key = dims.ranks(pp_ranks, slot)
        if key not in made:
            made[key] = dist.new_group(list(key))
            if isinstance(made[key], dist.ProcessGroup):  # non-members get a placeholder
                ctx.apply_timeout(made[key])
    return made[ranks]


def _experts_over_data(model: PipelineCore, local: list[_LocalKey]) -> dict[str, _LocalKey]:
    """The keys of experts split over data-parallel ranks (``ep_over="data"``), not summed over the replicas: the
    all-to-all's backward already brought each of its experts the gradient of every token of the ep group's
    batches, so only the other ep groups' copies (the expert-replica group, None when there are none) add theirs."""
    if model.dims.ep_mesh is None:
        return {}
    return {e.key: e for e in local if any(on_expert_mesh(p) for p in e.params)}


def train_state(model: PipelineCore) -> TrainStepState:
    """The model's :class:`TrainStepState`, made on first use (collective then: it creates the sync groups).

    Kept in the model's own typed field ``train_step_state``: it describes one model (its stages' parameters,
    groups over its ranks), so it lives and dies with it."""
    if model.train_step_state is None:
        model.train_step_state = _new_train_state(model)
    return model.train_step_state


def _new_train_state(model: PipelineCore) -> TrainStepState:
    loss = get_loss(model.resolved.head.loss, class_name=model.resolved.class_name)
    layout = model.param_layout
    local_stages = {s.spec.index for s in model.stages}
    by_key: dict[str, _LocalKey] = {}
    seen: set[int] = set()
    for stage in model.stages:
        for name, p in stage.named_parameters(remove_duplicate=False):
            # A frozen parameter (the base weights under a LoRA adapter) gets no gradient: it is left
            # out of the sync buckets, the gradient norm and ``params`` (the optimizer holds none of it).
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            key = layout.key_of.get(name, name)
            entry = by_key.setdefault(key, _LocalKey(key=key, params=[], shared=len(layout.holders.get(key, ())) > 1))
            entry.params.append(p)
    local = list(by_key.values())
    # Buckets: keys grouped by the set of pipeline ranks holding them. The set of all such rank
    # sets is derived from the plan alone, so every rank creates the same groups in the same order.
    all_sets = sorted({layout.pp_ranks(k) for k in layout.holders if k in layout.parameters})
    made: dict = {}
    groups = {s: _group_for(model, s, made) for s in all_sets}
    # Parameters the checkpoint lacks (adapter weights in a block) live on this pipeline rank: synced over its replicas.
    mine = (model.dims.pp_rank,)
    if mine not in groups:
        groups[mine] = _group_for(model, mine, made)
    ranks_of = {e.key: layout.pp_ranks(e.key) if e.key in layout.holders else mine for e in local}
    experts = _experts_over_data(model, local)
    # Under FSDP, whole tensors beside the shards (an adapter): summed over the data-parallel ranks, as replicas'.
    whole = replicated_keys(model.dims, [(e.key, p) for e in local for p in e.params],
                            {e.key for e in local if ranks_of[e.key] == mine})
    buckets = []
    for s in groups:
        if model.dims.pp_rank not in s:
            continue
        # Sorted by key: the flat buffers of all members of the group must line up.
        keys = sorted((e for e in local if ranks_of[e.key] == s and e.key not in experts and e.key not in whole),
                      key=lambda e: e.key)
        if keys:
            buckets.append((groups[s], keys))
    if experts:
        buckets.append((model.dims.expert_replica_group, sorted(experts.values(), key=lambda e: e.key)))
    if whole:
        buckets.append((model.dims.dp_group, sorted((e for e in local if e.key in whole), key=lambda e: e.key)))
    norm_params = [e.params[0] for e in local if ranks_of[e.key] == mine or layout.owner_stage(e.key) in local_stages]
    return TrainStepState(
        loss=loss, loss_fn=PipelineLoss(loss, model.config), accepted=forward_arguments(model.skeleton),
        local=local, buckets=buckets, norm_params=norm_params, params=[p for e in local for p in e.params],
        router_aux=router_aux_of(model.skeleton, model.config),
    )


# --------------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class _Batch:
    inputs: dict[str, Any]  # this replica's rows, on the device, as every stage gets them
    labels: torch.Tensor  # this replica's labels
    denominator: float | tuple[float, ...]  # items the global mean runs over (whole global batch; one per mean)
    digest: int  # fingerprint of the global batch, compared across ranks
    n_microbatches: int  # this step's (model.microbatches_for its rows)


def _digest(batch: Mapping[str, Any]) -> int:
    material, _ = fingerprint({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
    return int.from_bytes(hashlib.blake2b(material.encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)


def _prepare_batch(model: PipelineCore, state: TrainStepState, batch: Mapping[str, Any], loss: LossFunction) -> _Batch:
    if not isinstance(batch, Mapping):
        raise InputTypeError(
            f"train_step takes a dict of tensors (as a transformers data collator makes it), got {type(batch).__name__}"
        )
    batch = {k: v for k, v in batch.items() if v is not None}
    names = loss.targets  # ("labels",), or transformers' ("start_positions", "end_positions")
    missing = [n for n in names if n not in batch]
    if names == ("labels",) and missing:
        raise InputError(
            f"the batch has no 'labels' (keys: {sorted(batch)}); a training step needs them — e.g. labels = input_ids "
            "for causal LM (the shift happens inside the loss), or use DataCollatorForLanguageModeling"
        )
    if missing:
        raise InputError(
            f"the batch has no {missing} (keys: {sorted(batch)}); {model.resolved.class_name} trains on {list(names)}, "
            f"as its transformers forward takes them"
        )
    for k, v in batch.items():
        if k in _NOT_FOR_TRAINING:
            raise InputError(f"{k!r} is for generation and cannot be passed to train_step; remove it from the batch")
        if k not in names and k not in state.accepted:
            allowed = sorted(state.accepted - set(_NOT_FOR_TRAINING))
            raise InputError(f"{type(model.skeleton).__name__}.forward takes no {k!r}; the batch may hold {allowed}")
        if not isinstance(v, torch.Tensor):
            raise InputError(
                f"batch[{k!r}] must be a tensor, got {type(v).__name__}; pass what a data collator returns "
                "(return_tensors='pt')"
            )
    digest = _digest(batch) if model.check_inputs else 0
    given = {n: batch.pop(n) for n in names}
    # One target tensor, split into microbatches with the inputs (QA's start and end positions stacked: (B, 2)).
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    length = ids.shape[-1] if "input_ids" in batch else ids.shape[-2] if ids is not None else 0
    labels = loss.make_targets(given, length)
    # Ids (dtype, shape, inside the vocabulary) and labels (shape, inside the vocabulary or -100) first:
    # the shapes below are only meaningful for (batch, length) ids.
    checked = (loss.labels_as, given["labels"]) if loss.labels_as else (loss.name, labels)
    check_model_inputs(model.config, checked[0], batch, labels=checked[1], dtype=model.dtype)
    rows = model.batch_size(batch)
    for k, v in batch.items():
        if v.dim() == 0 or v.shape[0] != rows:
            raise InputError(
                f"batch[{k!r}] has shape {tuple(v.shape)}, but the batch has {rows} rows; every input needs one row "
                "per example"
            )
    dp = model.dims.dp_size
    if rows % dp:
        raise InputError(
            f"a global batch of {rows} rows does not split over dp_size={dp} data-parallel replicas; pass a "
            f"multiple of dp_size x n_microbatches = {dp * model.n_microbatches} rows"
        )
    m = model.microbatches_for(rows // dp, training=True, seq=length)
    check_microbatches(batch=rows // dp, n_microbatches=m, training=True)
    prepared = model.prepare_inputs({**batch, "labels": labels})  # on the device; T5 derives decoder_input_ids
    labels = prepared.pop("labels")
    denominator = loss.denominator(labels, model.config)
    if dp > 1:
        share = rows // dp
        lo, hi = model.dims.dp_rank * share, (model.dims.dp_rank + 1) * share
        prepared = {k: v[lo:hi] if isinstance(v, torch.Tensor) else v for k, v in prepared.items()}
        labels = labels[lo:hi]
    return _Batch(inputs=prepared, labels=labels, denominator=denominator, digest=digest, n_microbatches=m)


def _agree(model: PipelineCore, error: BaseException | None, digest: int) -> None:
    """One small all-reduce: did any rank fail to prepare the batch, and is the batch the same everywhere?

    Cheaper than gathering objects every step; the full error exchange only runs when a rank failed.
    """
    ctx = model.ctx
    if not ctx.is_distributed:
        if error is not None:
            raise error
        return
    hi, lo = digest >> 31, digest & ((1 << 31) - 1)
    flags = torch.tensor([int(error is not None), hi, lo, -hi, -lo], dtype=torch.int64)
    if ctx.backend == "nccl":
        flags = flags.to(ctx.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ctx.group)
    failed, max_hi, max_lo, neg_min_hi, neg_min_lo = flags.tolist()
    if failed:
        raise_on_any_rank(ctx, error, what="checking the training batch", describe=getattr(model, "rank_label", None))
    if model.check_inputs and (max_hi != -neg_min_hi or max_lo != -neg_min_lo):
        raise InputError(
            "the training batch differs across ranks; every rank must pass the same global batch to train_step "
            "(same data order and seed everywhere; each data-parallel replica takes its share itself)"
        )


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------
def _autocast(model: PipelineCore, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    device_type = model.device.type
    if not torch.amp.is_autocast_available(device_type):
        raise InputError(f"autocast is not available on {device_type}; pass autocast=None")
    return torch.autocast(device_type=device_type, dtype=dtype)


def _run_local(
    model: PipelineCore, loss_fn: PipelineLoss, b: _Batch, loss_kwargs: dict[str, float], losses: list[torch.Tensor]
) -> None:
    # All stages on this rank (pipeline size 1): microbatch by microbatch, as the schedules would.
    targets = torch.tensor_split(b.labels, b.n_microbatches)
    for i, inputs in enumerate(split_microbatches(b.inputs, b.n_microbatches)):
        x = run_local_stages(model.stages, inputs)
        loss = loss_fn(x if len(x) > 1 else x[0], targets[i], **loss_kwargs)
        loss.backward()
        losses.append(loss.detach())


def _sync_gradients(state: TrainStepState) -> None:
    """Sum each key's gradient over its local copies, then over the ranks (and replicas) holding it."""
    for group, keys in state.buckets:
        entries: list[tuple[_LocalKey, torch.Tensor]] = []
        for e in keys:
            grads = [p.grad for p in e.params if p.grad is not None]
            if not grads:
                if not e.shared:
                    continue  # unused here, hence unused in every replica: nothing to reduce
                grads = [torch.zeros_like(e.params[0])]  # another holder may have a gradient
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            entries.append((e, total))
        if group is not None:
            # A tensor-parallel shard's gradient is reduced as the local tensor it is (same slot everywhere).
            all_reduce_flat([local_tensor(t) for _, t in entries], group)
        for e, total in entries:
            for p in e.params:
                if p.grad is None:
                    p.grad = total.clone()
                elif p.grad is not total:
                    p.grad.copy_(total)


def _agreed_batch(model: PipelineCore, state: TrainStepState, batch: Mapping[str, Any], loss: LossFunction):
    """This replica's share of ``batch``, once every rank has prepared its own and they agree."""
    error: BaseException | None = None
    b: _Batch | None = None
    try:
        b = _prepare_batch(model, state, batch, loss)
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks below, then raised everywhere
        error = e
    _agree(model, error, b.digest if b is not None else 0)  # raises on every rank if any failed
    assert b is not None
    return b


def _run_schedule(
    model: PipelineCore, loss_fn: PipelineLoss, router_aux: RouterAux | None, b: _Batch, loss_kwargs: dict[str, float],
    autocast: torch.dtype | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward and backward of this rank's stages over every microbatch: the losses and router loss terms made here.

    The step runs in model.training mode; each stage's own mode is put back afterwards."""
    modes = [(m, m.training) for stage in model.stages for m in stage.modules()]
    for stage in model.stages:
        stage.train(model.training)
    losses: list[torch.Tensor] = []
    aux = contextlib.nullcontext([]) if router_aux is None else aux_pass(
        model, router_aux, lambda: forward_only(model, b.inputs, b.n_microbatches), loss_kwargs["loss_scale"])
    try:
        with _autocast(model, autocast), aux as aux_values:
            if model.plan.pp_size == 1:
                _run_local(model, loss_fn, b, loss_kwargs, losses)
            else:
                # The loss is part of the key: a schedule keeps the loss_fn it was built with.
                key = signature(b.inputs) + (("labels", tuple(b.labels.shape), b.labels.dtype), ("loss", loss_fn.loss))
                _, schedule = model.runtime.get(key, training=True, loss_fn=loss_fn, scale_grads=False,
                                                n_microbatches=b.n_microbatches)
                # Zero-bubble: linears' weight gradients wait for the W actions (weight_pass.py).
                with weight_pass.deferring() if model.schedule.zero_bubble else contextlib.nullcontext():
                    schedule.step(
                        **b.inputs, target=b.labels, losses=losses, return_outputs=False, loss_kwargs=loss_kwargs
                    )
    finally:
        for m, mode in modes:
            m.training = mode
    return losses, aux_values


def train_step(
    model: PipelineCore,
    batch: Mapping[str, Any],
    *,
    loss_scale: float = 1.0,
    autocast: torch.dtype | None = None,
    loss: LossFunction | None = None,
) -> torch.Tensor:
    """Forward + backward of one global batch through the pipeline. Collective: every rank passes the same batch.

    Gradients are accumulated into ``.grad`` as ``loss.backward()`` does (call ``optimizer.zero_grad()``
    between optimizer steps); stages run in ``model.training`` mode (``model.train()`` / ``model.eval()``).
    A step that fails on any rank (out of memory, a stage that raises) leaves every ``.grad`` as it was.

    Args:
        model: the :class:`~hf_pipeline.model.PipelinedModel`.
        batch: a dict as a transformers data collator makes it: input tensors plus the targets under
            transformers' names (``labels``; ``start_positions`` and ``end_positions`` for question
            answering); its rows must be a multiple of ``dp_size * n_microbatches``.
        loss_scale: multiplies this step's gradients (``1/k`` for k accumulation steps); the returned
            loss is not scaled.
        autocast: e.g. ``torch.bfloat16``: run the step under ``torch.autocast`` on the model's device.
        loss: a :class:`~hf_pipeline.families.losses.LossFunction` in place of the head's (its ``targets`` are batch
            keys; e.g. DPO's over chosen / rejected rows); the same object every step (its schedule is kept).

    Returns:
        The mean loss over the real items of the global batch (what transformers reports for it),
        a detached fp32 scalar on every rank.

    Example:
        >>> loss = model.train_step({"input_ids": ids, "attention_mask": mask, "labels": ids})
    """
    if not loss_scale or loss_scale != loss_scale:
        raise InputError(f"loss_scale must be a non-zero number, got {loss_scale}")
    # The schedule's microbatch rules (loading checked only the layout): same settings, raised on every rank.
    plan = model.plan
    check_training(model.schedule, pp_size=plan.pp_size, virtual_stages=plan.virtual_stages,
                   n_microbatches=model.n_microbatches)
    state = train_state(model)
    own = loss in (None, state.loss)
    loss_fn = state.loss_fn if own else state.loss_fns.setdefault(loss, PipelineLoss(loss, model.config))
    b = _agreed_batch(model, state, batch, loss_fn.loss)
    # Gradients of earlier steps (accumulation) sit aside so the sync below only sums this step's.
    stash = [(p, p.grad) for p in state.params if p.grad is not None]
    for p, _ in stash:
        p.grad = None
    loss_kwargs = {"denominator": b.denominator, "loss_scale": float(loss_scale)}
    try:
        losses, aux_values = _run_schedule(model, loss_fn, state.router_aux, b, loss_kwargs, autocast)
        _sync_gradients(state)
    except BaseException:  # a failed step changes nothing: its partial gradients go, earlier ones come back
        kept = {id(p): old for p, old in stash}
        for p in state.params:
            p.grad = kept.get(id(p))
        raise
    for p, old in stash:
        p.grad = old if p.grad is None else old.add_(p.grad)

    # The last stage's rank of each replica holds its share of the global mean, every stage's rank its router
    # loss terms; the rest add 0 (and so do tensor-parallel peers, which computed the same values).
    if (losses or aux_values) and model.dims.tp_rank == 0:
        total = torch.stack([loss.detach().float() for loss in losses + aux_values]).sum()
    else:
        total = torch.zeros((), device=model.device)
    total = total.to(model.device)
    if loss_scale != 1.0:
        total = total / loss_scale
    if model.ctx.is_distributed:
        dist.all_reduce(total, group=model.ctx.group)
    return total
