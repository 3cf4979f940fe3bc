"""Expert parallelism inside a loaded stage: each of the stage's ranks keeps whole experts, and the
experts modules reach their tokens through transformers' own dispatch (``planning/ep_plan.py``).

A ``"grouped_gemm"`` parameter (the experts' stacked ``gate_up_proj`` / ``down_proj``, and gpt-oss's
biases) is cut along its expert dim: rank ``r`` of ``ep_size`` reads and keeps experts
``[r E / ep_size, (r + 1) E / ep_size)`` and holds them as a ``DTensor`` ``Shard(0)``, so norms, the
optimizer and the checkpoint writer see the whole tensor (``full_tensor()`` is the checkpoint's layout).
Its module then counts only its own experts (``num_experts``, as transformers' ``MoEParamShard`` sets
it) and skips the routes to other ranks' experts (``_is_expert_parallel``). An ``"ep_dispatch_experts"``
module's forward becomes transformers' ``EpDispatchExpertsParallel`` over the stage's ranks (or, with
``ep_over="data"``, over the ep mesh of several replicas' ranks: their batches differ, so the routed tokens go
all-to-all)
(:func:`~hf_pipeline.compat.install_expert_dispatch`): the router and everything else run whole on every
rank, and only the experts' tokens move.

Example:
    >>> parts = expert_parts([stage], options.ep_plan, dims.tp_mesh)   # name -> (0, rank, ep_size)
    >>> apply_expert_parallel(stage, options.ep_plan, dims.tp_mesh, options.ep_implementation)
"""

from __future__ import annotations

from torch import nn

from ..compat import install_expert_dispatch
from ..errors import InputError
from ..planning.mesh_rules import match_plan

__all__ = ["apply_expert_parallel", "expert_parts"]


def _by_name(stage: nn.Module, plan) -> dict[str, str]:
    """Module or parameter name in ``stage`` -> style, for every name a pattern of ``plan`` matches (an ep
    plan names parameters, ``layers.*.mlp.experts.gate_up_proj``, and modules, ``layers.*.mlp.experts``)."""
    names = [n for n, _ in stage.named_modules()] + [n for n, _ in stage.named_parameters()]
    return match_plan(names, plan)


def _cut_params(stage: nn.Module, by_name: dict[str, str]) -> dict[str, tuple[nn.Module, str]]:
    """Stage parameter name -> (its module, its attribute), for every ``grouped_gemm`` name of ``by_name``
    (:func:`_by_name`)."""
    params = dict(stage.named_parameters())
    out = {}
    for name, style in by_name.items():
        if style == "grouped_gemm" and name in params:
            module_name, _, attr = name.rpartition(".")
            out[name] = (stage.get_submodule(module_name), attr)
    return out


def expert_parts(stages, plan, mesh) -> dict[str, tuple[int, int, int]]:
    """Stage parameter name -> ``(0, rank, ep_size)``: the whole experts this rank reads of each cut tensor."""
    if not plan:
        return {}
    rank, count = mesh.get_local_rank(), mesh.size()
    return {name: (0, rank, count) for stage in stages for name in _cut_params(stage, _by_name(stage, plan))}


def apply_expert_parallel(stage: nn.Module, plan, mesh, implementation: str, *, batch_mesh=None) -> None:
    """Split ``stage``'s experts over ``mesh`` in place. Their cut parameters hold this rank's experts
    already (read with :func:`expert_parts`); no communication. ``batch_mesh``: the ranks sharing this rank's
    batch when ``mesh`` spans replicas too (transformers' tp_mesh; default ``mesh``: they share one batch)."""
    from torch.distributed.tensor import DTensor, Shard

    if not plan:
        return
    ep_size = mesh.size()
    by_name = _by_name(stage, plan)
    for module, attr in _cut_params(stage, by_name).values():
        p = getattr(module, attr)
        if not isinstance(p, DTensor):
            shard = DTensor.from_local(p.detach(), mesh, [Shard(0)], run_check=False)
            module.register_parameter(attr, nn.Parameter(shard, requires_grad=p.requires_grad))
    dispatch = [n for n, s in by_name.items() if s == "ep_dispatch_experts"]
    for name in dispatch:
        experts = stage.get_submodule(name)
        total = getattr(experts, "num_experts", None)
        if not isinstance(total, int) or total % ep_size:
            raise InputError(
                f"{name} ({type(experts).__name__}) has num_experts={total!r}, which ep_size={ep_size} does not "
                "divide; expert parallelism splits whole experts evenly over the stage's ranks"
            )
        experts.num_experts = total // ep_size  # transformers' MoEParamShard: the experts' forward counts its own
        experts._is_expert_parallel = True  # and skips the routes that name another rank's experts
        install_expert_dispatch(experts, mesh, implementation, batch_mesh=batch_mesh)
