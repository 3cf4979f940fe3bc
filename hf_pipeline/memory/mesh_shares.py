"""What one rank of a mesh holds of a stage's parameters: tensor-parallel slices, expert-parallel experts,
fsdp's units; and the compute per token those shares leave it (:func:`rank_flops_per_token`).

Used by the memory planner (:mod:`.planner`, which runs the stages on these shapes), by
:mod:`.mesh_report` (the per-rank report of a mesh) and by the automatic schedule choice
(:mod:`.auto_choice_costs`, which costs a stage by one of its ranks).

Example:
    >>> tp_local_shapes(stage, options.tp_plan, 2)["model.layers.0.self_attn.q_proj.weight"]   # (heads*hd/2, hidden)
"""

from __future__ import annotations

import math
from typing import Container, Mapping

from torch import nn

from ..loading.expert_parallel import expert_parts
from ..loading.tensor_parallel import shard_parts
from ..planning.resolve import COST_SEQ_LEN, attention_flops

__all__ = ["ep_local_shapes", "fsdp_unit_bytes", "human_bytes", "local_shapes", "rank_flops_per_token",
           "tp_local_shapes"]


def human_bytes(n: float) -> str:
    """``n`` bytes as B, KiB, MiB, GiB or TiB (two decimals above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class _PlannedMesh:
    """The two things :func:`shard_parts` asks of a tensor-parallel mesh, for planning without one (rank 0)."""

    def __init__(self, size: int):
        self._size = size

    def get_local_rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size


def tp_local_shapes(stage: nn.Module, tp_plan: tuple[tuple[str, str], ...], tp_size: int) -> dict[str, tuple]:
    """Parameter name -> the shape one tensor-parallel rank holds, for the parameters ``tp_plan`` shards.

    Args:
        stage: a stage module (meta or real).
        tp_plan: ``(module pattern, style)`` pairs, as ``PipelineOptions.tp_plan``.
        tp_size: tensor-parallel ranks per stage.

    Returns:
        Only the sharded parameters' names (the others are held whole).
    """
    if tp_size == 1 or not tp_plan:
        return {}
    out = {}
    for name, (dim, _, count) in shard_parts([stage], tp_plan, _PlannedMesh(tp_size)).items():
        shape = list(stage.get_parameter(name).shape)
        shape[dim] //= count
        out[name] = tuple(shape)
    return out


def ep_local_shapes(stage: nn.Module, ep_plan: tuple[tuple[str, str], ...], ep_size: int) -> dict[str, tuple]:
    """Parameter name -> the shape one expert-parallel rank holds (its ``E / ep_size`` whole experts, the
    loader's :func:`~hf_pipeline.loading.expert_parallel.expert_parts`), for the parameters ``ep_plan`` cuts."""
    if ep_size == 1 or not ep_plan:
        return {}
    out = {}
    for name, (dim, _, count) in expert_parts([stage], ep_plan, _PlannedMesh(ep_size)).items():
        shape = list(stage.get_parameter(name).shape)
        shape[dim] //= count
        out[name] = tuple(shape)
    return out


def local_shapes(stage: nn.Module, options) -> dict[str, tuple]:
    """Parameter name -> the shape one rank of a stage holds under ``options`` (``PipelineOptions``): its
    tensor-parallel slices and its experts; only the parameters it does not hold whole."""
    return {**tp_local_shapes(stage, options.tp_plan, options.tp_size),
            **ep_local_shapes(stage, options.ep_plan, options.ep_size)}


def rank_flops_per_token(stage: nn.Module, options, *, flops: float, attention: int, hidden: int,
                         shares: Mapping[str, float]) -> float:
    """FLOPs per token one rank of a stage computes under ``options``: the stage's ``flops`` (the splitter's count,
    ``StageSpec.flops_per_token``) less what its ``tp_size`` / ``ep_size`` peers compute instead.

    A matmul with a tensor-parallel slice or a rank's experts costs the rank its local share (the plan's slices
    and ``E / ep_size`` experts of every experts module, weighed as the splitter does by ``shares``: ``top_k / E``
    per token; with experts over ``ep_data`` replicas, ``ep_over="data"``, those experts run the tokens of that
    many replicas). Every rank of a stage runs the same tokens (the stage's batch is not split over them), so
    what is whole (embeddings, norms, a router, with ep alone attention too) costs each rank all of it, and the
    experts' share assumes routing spread evenly over the ranks (what the load-balancing loss aims at). Attention
    scores run on heads / tp when a tensor-parallel plan splits the stage (every plan cuts the attention
    projections by heads). The collectives (tp's all-reduces, ep's token exchange) are not counted here: the
    choice's per-action overhead stands in for them.

    Args:
        stage: a stage module (meta), its parameter names the skeleton's.
        options: ``PipelineOptions`` with the stage's ``tp_plan`` / ``ep_plan`` and sizes.
        flops: the stage's FLOPs per token as the splitter counts them (at ``COST_SEQ_LEN``).
        attention: attention layers of the stage (``StageSpec.attention_blocks``).
        hidden: the model's hidden size.
        shares: experts module name -> share a token runs through (``routed_shares``).
    """
    cut = 0.0
    experts = ep_local_shapes(stage, options.ep_plan, options.ep_size)
    for name, shape in local_shapes(stage, options).items():
        p = stage.get_parameter(name)
        runs = math.prod(shape) * (options.ep_data if name in experts else 1)  # elements x replicas' tokens
        if p.dim() >= 2:  # as module_stats counts a matmul: 2 x its elements x the routed share
            cut += 2.0 * (p.numel() - runs) * shares.get(name.rpartition(".")[0], 1.0)
    if options.tp_plan and options.tp_size > 1:
        cut += attention_flops(attention, COST_SEQ_LEN, hidden) * (1 - 1 / options.tp_size)
    return flops - cut


def fsdp_unit_bytes(stage: nn.Module, local_shapes: dict[str, tuple], itemsize: int, *,
                    skip: Container[str] = ()) -> list[int]:
    """Bytes of each unit fsdp gathers whole at once: every block, and the stage's other modules together.

    Args:
        stage: a stage module (meta).
        local_shapes: :func:`tp_local_shapes` of the stage (the tensor-parallel rank's slices).
        itemsize: bytes per parameter element (the model's dtype).
        skip: names of parameters fsdp leaves out (``ignored_params``: the experts with ``ep_over="data"``).
    """
    size = {id(p): itemsize * _numel(local_shapes.get(n, tuple(p.shape))) for n, p in stage.named_parameters()
            if n not in skip}
    blocks = [{id(p) for p in m.parameters() if id(p) in size} for _, m in stage.blocks]
    rest = set(size) - set().union(*blocks)
    return [sum(size[i] for i in unit) for unit in [*blocks, rest]]


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
