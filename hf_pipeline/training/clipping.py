"""Gradient clipping of a pipelined model: the global norm over every stage, as on the unsplit model."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import PipelineCore
from ..distributed.shards import is_sharded, mesh_norm_power, norm_power
from ..errors import TrainingError
from .step import train_state

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    model: PipelineCore, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip every gradient by the global norm over all stages (keys held by several stages counted once).

    Collective over the pipeline; replicas hold the same (synced) gradients, so each computes the same
    norm. Same semantics as ``torch.nn.utils.clip_grad_norm_`` on the unsplit model.

    Args:
        model: the :class:`~hf_pipeline.model.PipelinedModel`, after ``train_step``.
        max_norm: the largest allowed norm.
        norm_type: p of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise if the total norm is nan or inf.

    Returns:
        The total norm before clipping (a scalar tensor, the same on every rank).
    """
    state = train_state(model)
    norm_type = float(norm_type)
    grads = [p.grad for p in state.norm_params if p.grad is not None]
    # Shards of two meshes: (fsdp, tp) and fsdp alone, or tp and the experts' ep mesh (each counted once over its own).
    if (model.dims.fsdp_size > 1 and model.dims.tp_size > 1) or model.dims.ep_data > 1:
        local = mesh_norm_power(grads, norm_type, device=model.device)
    else:
        local = norm_power(grads, norm_type, device=model.device, tp_group=model.dims.shard_group)
    group = model.dims.pp_group if model.dims.pp_group is not None else model.ctx.group
    inf = norm_type == float("inf")
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    total = local if inf else local ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise TrainingError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); lower the learning "
            "rate or use bf16 autocast with care, or pass error_if_nonfinite=False"
        )
    params = [p for p in state.params if p.grad is not None and not is_sharded(p.grad)]
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    # Tensor-parallel shards are scaled as local tensors, by the coefficient clip_grads_with_norm_ uses:
    # DTensor refuses a plain-tensor factor, and the norm is already the whole model's.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in state.params:
        if p.grad is not None and is_sharded(p.grad):
            p.grad.to_local().mul_(coef.to(p.grad.device))
    return total

