"""LoRA on expert parameters split by expert parallelism, equal to peft's on one process.

peft adapts a stacked expert parameter (``mlp.experts.gate_up_proj``, shape ``(E, a, b)``, targeted by
``LoraConfig(target_parameters=...)``) with a ``lora.ParamWrapper``: ``lora_A`` holds ``r * E`` rows read as
``(E, r, in)``, ``lora_B`` ``r * E`` columns read as ``(out, r, E)`` (the expert index fastest), and the
per-expert delta ``(E, ., .)`` is added to the parameter through ``torch.nn.utils.parametrize`` (folded into a
``baddbmm`` with the factors ``lhs`` ``(E, ., r)`` and ``rhs`` ``(E, r, .)`` for one adapter, or as a whole
delta). Under expert parallelism the parameter is a ``DTensor`` with ``Shard(0)`` (this rank's ``E / ep``
experts). Here ``lora_A`` / ``lora_B`` stay whole on every rank (small, ``r * E`` rows; their names, shapes and
saved tensors are peft's), and each expert-stacked tensor peft derives from them (the factors, the delta)
is put on the parameter's mesh with the parameter's placements before it meets the parameter:

* experts within a stage (the stage's ranks share one batch, the parameter's mesh is the stage's
  tensor-parallel mesh): the whole tensor is a ``Replicate`` DTensor redistributed to ``Shard(0)``, this
  rank's experts' part taken with no communication; in backward DTensor gathers the parts' gradients over
  the mesh, so every rank holds the whole ``lora_A`` / ``lora_B`` gradient, as for any other parameter those
  ranks replicate (``train_step`` sums nothing over them);
* experts over data-parallel replicas (``ep_over="data"``, the ``("ep",)`` mesh: the ranks' rows differ):
  this rank's experts' slice is wrapped as its local shard, so the other experts' rows of the gradient are
  zero here, and ``train_step``'s sum of every replicated parameter's gradient over the replicas adds the
  other ranks' experts (each expert's own gradient already holds every token of the ep group: the all-to-all
  brought them), which is the whole gradient.

Example (every rank; ``ep_size=2``):
    >>> config = LoraConfig(r=8, target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"])
    >>> peft_model = peft.get_peft_model(model, config)   # lora_A / lora_B whole; the experts' deltas local
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..compat import PARAMETRIZE_CACHE
from ..distributed.shards import on_expert_mesh
from ..errors import InputError

__all__ = ["on_parameter_mesh", "run_locally"]


def on_parameter_mesh(wrapper: Any, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` (one tensor per expert along dim 0, all ``E`` experts: a factor or the delta of ``wrapper``'s
    parameter) as a ``DTensor`` laid out as the parameter; ``whole`` itself when the parameter is plain.

    Args:
        wrapper: peft's ``lora.ParamWrapper``.
        whole: ``(E, ., .)``, computed from the whole ``lora_A`` / ``lora_B``.

    Returns:
        A ``DTensor`` on the parameter's mesh with its placements (``Shard(0)``), whose local part is this
        rank's experts' rows of ``whole``.
    """
    param = wrapper.get_param()
    if not isinstance(param, DTensor) or whole.dim() != 3 or whole.shape[0] != param.shape[0]:
        return whole
    mesh, placements = param.device_mesh, tuple(param.placements)
    if placements != (Shard(0),):
        raise InputError(
            f"a LoRA adapter on the expert parameter {wrapper.parameter_name!r} laid out as {placements} over mesh "
            f"{mesh.mesh_dim_names} is not supported: only experts split whole (Shard(0), expert parallelism) are; "
            "load the model without tensor parallelism of the experts, or leave target_parameters unset"
        )
    if on_expert_mesh(param):
        # Replicas' rows differ: no gradient is gathered here, the replicas' sum completes it (see the module doc).
        local = whole.chunk(mesh.size(), dim=0)[mesh.get_local_rank()]  # Shard(0)'s split: torch.chunk
        return DTensor.from_local(local, mesh, placements, run_check=False)  # ep divides E: even shards
    return DTensor.from_local(whole, mesh, (Replicate(),), run_check=False).redistribute(mesh, placements)


def run_locally(wrapper: Any) -> None:
    """Inside peft's ``ParamWrapper._activate_lora`` (its parametrization registered, ``parametrize.cached()``
    entered): the adapted parameter, a ``DTensor`` (the parameter plus the delta on its mesh), is read as its
    local part for the rest of the forward, as transformers' expert-parallel forward reads every ``DTensor``
    parameter of the experts (its ``_use_local_dtensor_params`` swaps only unparametrized ones). The local part
    keeps the autograd link to ``lora_A`` / ``lora_B``. Nothing for a plain parameter."""
    base, name = wrapper.get_base_layer(), wrapper.parameter_name
    parametrizations = getattr(base, "parametrizations", None)
    if parametrizations is None or name not in parametrizations:
        return  # no active adapter on this parameter: peft registered nothing
    if isinstance(parametrizations[name].original, DTensor):
        module, cache = PARAMETRIZE_CACHE  # rebound when the outermost cached() ends: looked up now
        getattr(importlib.import_module(module), cache)[(id(base), name)] = getattr(base, name).to_local()
