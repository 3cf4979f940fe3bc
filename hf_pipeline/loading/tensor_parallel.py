"""Tensor parallelism inside a loaded stage, with torch's own ``parallelize_module``.

Each module a plan pattern names becomes ``ColwiseParallel`` (output features sharded) or
``RowwiseParallel`` (input features sharded, output all-reduced); its parameters become ``DTensor``
shards. The styles hand plain local tensors to the code around them (``use_local_output``), so the
attention reshapes to ``(-1, head_dim)`` and finds its share of the heads, the KV cache holds the
rank's heads, and the tensors a stage sends to the next one stay whole, plain, the same on every
tensor-parallel rank.

Example:
    >>> apply_tensor_parallel(stage, options.tp_plan, dims.tp_mesh)
    >>> stage.get_submodule("model.layers.0.mlp.up_proj").weight.to_local().shape   # (intermediate / tp, hidden)
"""

from __future__ import annotations

import re

from torch import nn

from ..errors import InternalError

__all__ = ["apply_tensor_parallel", "plan_for_stage"]


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


def apply_tensor_parallel(stage: nn.Module, plan: tuple[tuple[str, str], ...], tp_mesh) -> dict[str, str]:
    """Shard ``stage``'s planned modules over ``tp_mesh`` in place (collective-free: each rank cuts
    its own slice of the whole tensor it loaded, ``src_data_rank=None``).

    Returns:
        The module name -> style it applied.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    by_name = plan_for_stage(stage, plan)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if set(by_name.values()) - set(styles):
        raise InternalError(f"tensor-parallel styles {sorted(set(by_name.values()))} reached the stage unchecked")
    parallel = {}
    for name, style in by_name.items():
        parallel[name] = styles[style]()
        # Every tensor-parallel rank loaded the same whole tensor: slicing locally needs no scatter. The
        # slice gets its own storage (distribute_tensor copies it), so the whole tensor is freed after.
        parallel[name].src_data_rank = None
    if parallel:
        parallelize_module(stage, tp_mesh, parallel)
    return by_name
