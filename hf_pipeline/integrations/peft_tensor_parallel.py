"""LoRA on tensor-parallel modules (``tp_size > 1``), equal to peft's on one process.

peft wraps a target in a ``lora.Linear`` whose ``lora_A`` (r, in) and ``lora_B`` (out, r) it sizes by the base
layer's features (by a ``DTensor`` layer's local shard: while peft injects into a tensor-parallel stage it is given
the whole layer's, :func:`whole_features`), and adds ``lora_B(lora_A(dropout(x))) * scaling`` to the base layer's
output. Here ``lora_A`` / ``lora_B`` stay whole, the same on every tensor-parallel rank (their names, shapes,
initial values and saved tensors are peft's on one process; the adapter is saved from the first tp rank), and each
rank uses the part of them its base layer's shard meets, as Megatron's LoRA on parallel linears does:

* ``colwise`` (the base gives this rank's output features): ``lora_A`` runs on the whole input, ``lora_B``'s rows
  of this rank's features. Each rank's backward sees its rows only, so the gradient reaching ``lora_A``'s output
  and ``lora_B``'s weight is summed over the tp ranks (:func:`~hf_pipeline.loading.tensor_parallel.copy_to_ranks`):
  both become the whole gradient on every rank;
* ``rowwise`` (the base reads this rank's input features, its output summed): ``lora_A``'s columns of those
  features, the ``r`` outputs summed over the tp ranks before ``lora_B`` (``sum_over_ranks``); ``lora_A``'s
  gradient (its columns on each rank) is summed over the ranks, ``lora_B`` sees the whole sum and its gradient
  is whole already;
* ``colwise_gather_output`` / ``rowwise_split_input`` (whole input and output) and modules outside the plan run
  peft's LoRA as it is.

Merging (``merge_adapter``, ``merge_and_unload``) adds peft's whole delta to the sharded weight laid out as the
weight (this rank's part). ``train_step`` sums nothing over tp ranks: the sums above make every LoRA gradient
whole, and the loss on every tp rank is the same single loss, so the sums are exact. Refused by name at
injection: tensor parallelism together with ``fsdp_size``, ``lora_bias``, and targets whose plan style is
``replicated_with_grad_allreduce`` or packed, or that are not ``nn.Linear`` (GPT-2's ``Conv1D``).

Example (every rank; ``tp_size=2``):
    >>> peft_model = peft.get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "o_proj"]))
    >>> model.train_step(batch)   # every lora_A / lora_B gradient whole on each tp rank
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import PEFT_FEATURES
from ..core import PipelineCore
from ..errors import InputError
from ..loading.tensor_parallel import copy_to_ranks, local_slice, sum_over_ranks
from ..planning.mesh_rules import match_plan, parse_style

__all__ = ["refuse_unsupported", "shard_adapters", "tp_styles", "whole_features"]

_ADAPTED_KINDS = ("colwise", "rowwise", "colwise_gather", "rowwise_split")
_LOAD_WHOLE = "load the model without tp_size (pipeline and data parallelism take any adapter)"


def _tp(model: PipelineCore) -> int:
    options = getattr(model, "options", None)
    tp = getattr(model.dims, "tp_size", 1)
    return tp if tp > 1 and options is not None and getattr(options, "tp_plan", ()) else 1


def refuse_unsupported(model: PipelineCore, config: Any) -> None:
    """Refuse, before injection and on every rank (no communication), an adapter config tensor parallelism does not
    take here: with ``fsdp_size`` too, or with ``lora_bias`` (the sharded base bias cannot take peft's merge)."""
    tp = _tp(model)
    if tp == 1:
        return
    fsdp = getattr(model.dims, "fsdp_size", 1)
    if fsdp > 1:
        raise InputError(
            f"a PEFT adapter on a model loaded with tp_size={tp} and fsdp_size={fsdp} is not supported: its lora_A / "
            f"lora_B would be whole tensors beside FSDP's shards; load with tp_size alone, or {_LOAD_WHOLE}"
        )
    if getattr(config, "lora_bias", False):
        raise InputError(
            f"LoraConfig(lora_bias=True) on a model loaded with tp_size={tp} (tensor parallelism) is not supported: "
            f"merging would add lora_B's bias to a sharded base bias; leave lora_bias unset, or {_LOAD_WHOLE}"
        )


def tp_styles(model: PipelineCore, targets: list[str]) -> dict[str, str]:
    """The whole model's adapted module names -> their plan style (those the plan names); refuses, on every rank
    (the names and the plan are the same everywhere), a target tensor parallelism runs that LoRA cannot follow.

    Args:
        model: the pipelined model.
        targets: the whole model's adapted module names (from its skeleton).
    """
    if _tp(model) == 1:
        return {}
    styles = match_plan(targets, model.options.tp_plan)
    bad = {}
    for name, style in styles.items():
        kind, packs = parse_style(style) or ("", 1)
        module = model.skeleton.get_submodule(name)
        # Packed blocks (GPT-2's fused q, k, v) and Conv1D layers are left to a later, tested version.
        if kind not in _ADAPTED_KINDS or packs > 1 or type(module) is not nn.Linear:
            bad[name] = f"{type(module).__name__}, {style!r}"
    if bad:
        raise InputError(
            f"target_modules match {dict(list(bad.items())[:3])} (module -> class, tensor-parallel style), which a "
            f"LoRA adapter on a model loaded with tp_size={model.dims.tp_size} does not take: only nn.Linear layers "
            f"sharded {list(_ADAPTED_KINDS)} (or outside the plan) are adapted; narrow target_modules, or {_LOAD_WHOLE}"
        )
    return styles


@contextlib.contextmanager
def whole_features():
    """While peft injects into a stage: a linear layer whose weight is a ``DTensor`` reports its whole features to
    peft, which sizes the factors by the local shard on any mesh with a dim besides ``"fsdp"`` (a tensor-parallel
    stage's, and HSDP's ``("dp", "fsdp")``: peft's own tensor parallelism, whose factors hold this rank's part, drawn
    from the random stream in that shape, not one process's values); any other layer peft's own answer."""
    module_name, name = PEFT_FEATURES
    module = importlib.import_module(module_name)
    features = getattr(module, name)

    def get_in_out_features(layer: nn.Module):
        from torch.distributed.tensor import DTensor

        if isinstance(layer, nn.Linear) and isinstance(layer.weight, DTensor):
            return layer.in_features, layer.out_features
        return features(layer)

    setattr(module, name, get_in_out_features)
    try:
        yield
    finally:
        setattr(module, name, features)


def shard_adapters(model: PipelineCore, styles: dict[str, str]) -> None:
    """After injection: make every LoRA layer of this rank's stages whose base is tensor-parallel use its share of
    ``lora_A`` / ``lora_B`` (see the module doc), and every one whose base weight is a ``DTensor`` (a tp shard, or
    FSDP's chunk: ``peft_fsdp.py``) merge its part of the delta; idempotent, so each new adapter's modules are set
    up too.

    Args:
        model: the pipelined model, with adapters injected.
        styles: :func:`tp_styles` of the whole model's targets.
    """
    from torch.distributed.tensor import DTensor

    for stage in model.stages:
        for name, module in stage.named_modules():
            # peft's lora.Linear (a ParamWrapper, on expert parameters, has a parameter_name: peft_experts.py)
            if not hasattr(module, "lora_A") or hasattr(module, "parameter_name"):
                continue
            weight = getattr(module.get_base_layer(), "weight", None)
            if isinstance(weight, DTensor):  # a tp shard or FSDP's chunk: merging adds this rank's part of the delta
                module.get_delta_weight = types.MethodType(_delta_on_mesh(type(module).get_delta_weight), module)
            if name not in styles:
                continue
            kind, packs = parse_style(styles[name])
            mesh = weight.device_mesh
            rank, size = mesh.get_local_rank(), mesh.size()
            for adapter in module.lora_A:
                lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
                if kind == "colwise":  # lora_B's rows of this rank's output features, in each packed block
                    lora_b.forward = types.MethodType(_rows_forward((0, rank, size, packs), mesh), lora_b)
                elif kind == "rowwise":  # lora_A's columns of this rank's input features
                    lora_a.forward = types.MethodType(_columns_forward((1, rank, size), mesh), lora_a)


def _rows_forward(part: tuple, mesh):
    def forward(lora_b: nn.Linear, h: torch.Tensor) -> torch.Tensor:  # h: (..., r), the same on every tp rank
        # Each rank's backward gives the part of h's gradient (and lora_B's) from its rows: summed over the ranks.
        return F.linear(copy_to_ranks(h, mesh), local_slice(copy_to_ranks(lora_b.weight, mesh), part))

    return forward


def _columns_forward(part: tuple, mesh):
    def forward(lora_a: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # x: (..., in / tp), this rank's features
        # This rank's columns' share of A x, summed; A's gradient is this rank's columns only: summed over the ranks.
        return sum_over_ranks(F.linear(x, local_slice(copy_to_ranks(lora_a.weight, mesh), part)), mesh)

    return forward


def _delta_on_mesh(get_delta_weight):
    from torch.distributed.tensor import DTensor, distribute_tensor

    def delta(module: nn.Module, adapter: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        whole = get_delta_weight(module, adapter, *args, **kwargs)  # (out, in) as the base weight, every rank's
        weight = module.get_base_layer().weight  # read now: FSDP swaps its parameters as it gathers and reshards
        if not isinstance(weight, DTensor):
            return whole
        # this rank's part (a tp slice, FSDP's torch.chunk of rows), sliced from the whole delta every rank holds:
        # no communication (src_data_rank=None, as checkpointing/state_shards.py lays out a saved state)
        return distribute_tensor(whole, weight.device_mesh, weight.placements, src_data_rank=None)

    return delta
