"""Tensor parallelism inside a loaded stage, with torch's own ``parallelize_module``.

Each module a plan pattern names becomes ``ColwiseParallel`` (output features sharded) or
``RowwiseParallel`` (input features sharded, output all-reduced); its parameters become ``DTensor``
shards. The styles hand plain local tensors to the code around them (``use_local_output``), so the
attention reshapes to ``(-1, head_dim)`` and finds its share of the heads, the KV cache holds the
rank's heads, and the tensors a stage sends to the next one stay whole, plain, the same on every
tensor-parallel rank.

Loading stays per rank: each rank reads only its slice of a sharded tensor (:func:`shard_parts` tells
the reader which), so a stage's whole tensors are never in one rank's memory.

Example:
    >>> parts = shard_parts([stage], options.tp_plan, dims.tp_mesh)   # name -> (dim, index, count)
    >>> apply_tensor_parallel(stage, options.tp_plan, dims.tp_mesh)
    >>> stage.get_submodule("model.layers.0.mlp.up_proj").weight.to_local().shape   # (intermediate / tp, hidden)
"""

from __future__ import annotations

import re

from torch import nn

from ..errors import InternalError

__all__ = ["apply_tensor_parallel", "plan_for_stage", "shard_parts"]


def _pattern(text: str) -> re.Pattern:
    """A plan key as a regex over the end of a module name (``*`` is one block index)."""
    return re.compile(r"(?:^|.*\.)" + re.escape(text).replace(r"\*", r"\d+") + "$")


def plan_for_stage(stage: nn.Module, plan: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Module name in ``stage`` -> style, for every module a pattern of ``plan`` names."""
    compiled = [(_pattern(k), style) for k, style in plan]
    out: dict[str, str] = {}
    for name, _ in stage.named_modules():
        for pattern, style in compiled:
            if name and pattern.match(name):
                out[name] = style
                break
    return out


# The dim each style shards a Linear's parameters along (torch's ColwiseParallel / RowwiseParallel);
# a rowwise bias is whole on every rank.
_SHARD_DIMS = {"colwise": {"weight": 0, "bias": 0}, "rowwise": {"weight": 1}}


def shard_parts(stages, plan: tuple[tuple[str, str], ...], tp_mesh) -> dict[str, tuple[int, int, int]]:
    """Stage parameter name -> ``(dim, index, count)``: the slice this tensor-parallel rank reads of it."""
    if not plan:
        return {}
    rank, count = tp_mesh.get_local_rank(), tp_mesh.size()
    out = {}
    for stage in stages:
        for module, style in plan_for_stage(stage, plan).items():
            for attr, dim in _SHARD_DIMS[style].items():
                if getattr(stage.get_submodule(module), attr, None) is not None:
                    out[f"{module}.{attr}"] = (dim, rank, count)
    return out


def _wrap_read_slices(stage: nn.Module, by_name: dict[str, str], tp_mesh) -> None:
    """The slices read from the checkpoint become the DTensor shards ``parallelize_module`` would cut
    (it keeps a DTensor of the right placement as it is)."""
    from torch.distributed.tensor import DTensor, Shard

    for module_name, style in by_name.items():
        module = stage.get_submodule(module_name)
        for attr, dim in _SHARD_DIMS[style].items():
            p = getattr(module, attr, None)
            if p is not None and not isinstance(p, DTensor):
                shard = DTensor.from_local(p.detach(), tp_mesh, [Shard(dim)], run_check=False)
                module.register_parameter(attr, nn.Parameter(shard, requires_grad=p.requires_grad))


def apply_tensor_parallel(stage: nn.Module, plan: tuple[tuple[str, str], ...], tp_mesh) -> dict[str, str]:
    """Shard ``stage``'s planned modules over ``tp_mesh`` in place. Their sharded parameters hold this
    rank's slices already (read with :func:`shard_parts`); no communication.

    Returns:
        The module name -> style it applied.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    by_name = plan_for_stage(stage, plan)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if set(by_name.values()) - set(styles):
        raise InternalError(f"tensor-parallel styles {sorted(set(by_name.values()))} reached the stage unchecked")
    _wrap_read_slices(stage, by_name, tp_mesh)
    parallel = {}
    for name, style in by_name.items():
        parallel[name] = styles[style]()
        parallel[name].src_data_rank = None  # a whole tensor left (a rowwise bias) is the same on every rank
    if parallel:
        parallelize_module(stage, tp_mesh, parallel)
    return by_name
