"""Per-rank memory on a mesh: pipeline ranks x tensor-parallel ranks x fsdp ranks x replicas, from the config alone.

:func:`mesh_report` plans the pipeline with :func:`~hf_pipeline.memory.planner.plan_report` run on
what one tensor-parallel rank holds, then shards it over fsdp. What a rank holds:

* parameters: each module the tensor-parallel plan names (``colwise`` / ``rowwise``, the config's
  ``base_model_tp_plan``) holds 1/tp of its sharded weights (:func:`tp_local_shapes`, the slices the
  loader reads); the rest (embeddings, norms, the LM head, a row-parallel bias) is whole. With
  fsdp, every parameter is then split in fsdp equal parts (FSDP2 shards dim 0; its padding of a dim
  0 that fsdp does not divide is left out).
* experts (a mixture of experts with ``ep_size``): each of a stage's ``ep_size`` ranks holds ``E / ep_size``
  whole experts of each MoE layer (the loader's cut), the router, shared experts and dense layers whole
  (when ep stands alone) or as the tensor-parallel plan slices them (``ep_size == tp_size``). With experts over
  data-parallel ranks (``ep_over="data"``: the ep group a stage's ``tp_size`` ranks in k = ep_size / tp_size
  consecutive replicas or fsdp ranks) a rank still holds ``E / ep_size`` experts, whole under fsdp too (FSDP
  leaves them out), its other parameters as tp and fsdp cut them.
* gradients: as the parameters (same dtype; reduce-scattered to the shard under fsdp).
* AdamW: ``exp_avg`` and ``exp_avg_sq`` as ``torch.optim.AdamW`` makes them (``zeros_like`` of the
  parameter: same dtype and shard), 2 x the rank's parameter bytes.
* fsdp's all-gathers: the whole (tp-local) parameters of the largest unit it gathers at once (a
  block, or the stage's other modules together: embeddings, norm, LM head), twice (the one running
  and the one prefetched), in forward, backward and decoding.
* activations: the stage run on fake tensors with the tp-local parameter shapes (so attention runs
  on heads / tp, the MLP on intermediate / tp, as on a real tensor-parallel rank), for the rows of
  one pipeline: the global batch split over dp x fsdp. A mixture of experts' experts compute a fixed
  number of token-expert pairs on the experts the rank holds (:mod:`.routed_experts`), of the tokens its ep
  group routes: its pipeline's rows, or with ``ep_over="data"`` the k replicas' rows (k x its own).
* KV cache: the rank's heads, (KV heads / tp) per layer.

Example:
    >>> print(mesh_report("meta-llama/Llama-3-70B", num_processes=16, tp_size=4, fsdp_size=2, batch=16, seq=4096))
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..errors import InputError
from ..planning.tp_plan import EP_OVER, ParallelRequest, ep_data_ranks
from .mesh_shares import fsdp_unit_bytes, human_bytes, tp_local_shapes
from .planner import plan_report

__all__ = [
    "MeshRankMemory", "MeshReport", "MeshShape", "fsdp_share", "fsdp_unit_bytes", "mesh_layout", "mesh_report",
    "mesh_shape", "tp_local_shapes", "with_fsdp",
]  # fsdp_unit_bytes and tp_local_shapes live in .mesh_shares (the planner uses them too)


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    """The job's mesh: ``dp`` replicas of an ``fsdp`` x ``pp`` x ``tp`` block of ranks; ``ep`` of a stage's
    ranks split its experts (``tp`` of them, or, given alone, the stage's ``ep`` ranks), or with ``ep_over="data"``
    a stage's ``tp`` ranks in ``ep / tp`` consecutive replicas (fsdp ranks under fsdp)."""

    dp: int
    fsdp: int
    pp: int
    tp: int
    ep: int = 1
    ep_over: str = "stage"

    def __post_init__(self) -> None:
        for name in ("dp", "fsdp", "pp", "tp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} size must be a positive integer, got {value!r}")
        if self.ep_over not in EP_OVER:
            raise InputError(f"ep_over must be one of {list(EP_OVER)}, got {self.ep_over!r}")

    @property
    def ep_data(self) -> int:
        """Replicas (or fsdp ranks) one ep group spans: ``ep / tp`` with ``ep_over="data"``, else 1."""
        return ep_data_ranks(self.ep, self.tp, self.ep_over)

    @property
    def stage_ranks(self) -> int:
        """Ranks sharing one stage's batch: its tensor-parallel ranks, or its expert-parallel ones given alone
        (experts over data-parallel ranks: the tensor-parallel ones)."""
        return self.tp if self.ep_over == "data" else max(self.tp, self.ep)

    @property
    def world(self) -> int:
        return self.dp * self.fsdp * self.pp * self.stage_ranks

    def __str__(self) -> str:
        dims = f"tp={self.tp}" + (f" (ep={self.ep})" if self.ep > 1 and self.tp > 1 else "")
        dims = f"ep={self.ep}" if self.tp == 1 and self.ep > 1 else dims
        if self.ep_over == "data":
            over = "fsdp" if self.fsdp > 1 else "dp"
            return (f"dp={self.dp} x fsdp={self.fsdp} x pp={self.pp} x tp={self.tp} = {self.world} ranks, experts over "
                    f"ep={self.ep} = tp x {self.ep_data} {over} ranks")
        return f"dp={self.dp} x fsdp={self.fsdp} x pp={self.pp} x {dims} = {self.world} ranks"


def mesh_shape(num_processes: int, *, pp_size: int, tp_size: int = 1, fsdp_size: int = 1,
               ep_size: int = 1, ep_over: str = "stage") -> MeshShape:
    """The mesh of ``num_processes`` ranks with these sizes; the replicas (dp) are what is left.

    Raises:
        InputError: ``pp_size x tp_size (or ep_size alone) x fsdp_size`` does not divide ``num_processes``; with
            ``ep_over="data"``, an ``ep_size`` that is not a multiple k > 1 of ``tp_size``, or k data-parallel ranks
            that the replicas (or each sharded pipeline's fsdp ranks) cannot form.
    """
    ParallelRequest(tp_size=tp_size, ep_size=ep_size, ep_over=ep_over)  # ep_over and ep_size vs tp_size, by name
    stage = tp_size if ep_over == "data" else max(tp_size, ep_size)
    block = pp_size * stage * fsdp_size
    if num_processes < 1 or num_processes % block:
        what = "tp" if ep_size == 1 or ep_over == "data" else "ep" if tp_size == 1 else "tp (= ep)"
        raise InputError(
            f"--num-processes {num_processes} is not a multiple of pp x {what} x fsdp = {pp_size} x {stage} x "
            f"{fsdp_size} = {block}; pass a multiple of {block}, or change --stages / --tp-size / --ep-size / "
            "--fsdp-size"
        )
    mesh = MeshShape(dp=num_processes // block, fsdp=fsdp_size, pp=pp_size, tp=tp_size, ep=ep_size, ep_over=ep_over)
    k = mesh.ep_data
    if k > 1 and (mesh.fsdp % k if mesh.fsdp > 1 else mesh.dp % k):
        # as the loader's options: an ep group is k replicas, or k fsdp ranks of each fsdp-sharded pipeline
        fix = (f"pass --fsdp-size a multiple of {k}" if fsdp_size > 1 else
               f"pass --num-processes a multiple of pp x tp x {k} = {pp_size * tp_size * k} (or fewer --stages: pp is "
               f"{pp_size})")
        raise InputError(
            f"--ep-over data with --ep-size {ep_size}: an ep group spans ep / tp = {k} "
            f"{'fsdp ranks' if fsdp_size > 1 else 'replicas'}, and the mesh has {mesh.dp} replica(s) x fsdp "
            f"{mesh.fsdp}; {fix}, or change --ep-size"
        )
    return mesh


@dataclass(frozen=True, kw_only=True)
class MeshRankMemory:
    """What every rank at pipeline rank ``pp_rank`` holds (the same at every tp / fsdp / dp slot), bytes."""

    pp_rank: int
    params: int  # parameters this rank holds (tp slices, fsdp shard)
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq
    fsdp_gather_bytes: int  # whole parameters of the largest unit, twice (running + prefetched); 0 without fsdp
    activation_bytes: int  # peak live activations of its in-flight microbatches
    p2p_buffer_bytes: int
    train_peak_bytes: int  # all of the above
    checkpointed_activation_bytes: int  # the same with activation checkpointing (the pipeline report's every_n_layers)
    checkpointed_train_peak_bytes: int
    kv_cache_bytes: int
    generate_peak_bytes: int  # weights + fsdp gather + KV cache


@dataclass(frozen=True, kw_only=True)
class MeshReport:
    """:func:`mesh_report`'s answer: the mesh, the pipeline plan of one tensor-parallel rank, per-rank memory."""

    mesh: MeshShape
    batch: int  # the global batch; each pipeline (dp x fsdp of them) takes batch / (dp x fsdp) rows
    pipeline: Any  # the MemoryReport of one tensor-parallel rank's pipeline (weights before fsdp)
    ranks: tuple[MeshRankMemory, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": {**asdict(self.mesh), "world": self.mesh.world}, "batch": self.batch,
                "pipeline": self.pipeline.to_dict(), "ranks": [asdict(r) for r in self.ranks]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), **kwargs)

    def _rows(self) -> list[tuple[str, ...]]:
        p = self.pipeline
        ckpt = f"ckpt every {p.checkpoint_every_n_layers}"
        rows = [("pp rank", "params", "weights", "grads", "AdamW", "fsdp gather", "activations", "train peak",
                 f"activations ({ckpt})", f"train peak ({ckpt})", f"KV cache ({p.batch}x{p.seq})", "generate peak")]
        for r in self.ranks:
            rows.append((str(r.pp_rank), _count(r.params), *(human_bytes(b) for b in (
                r.weight_bytes, r.grad_bytes, r.optimizer_bytes, r.fsdp_gather_bytes, r.activation_bytes,
                r.train_peak_bytes, r.checkpointed_activation_bytes, r.checkpointed_train_peak_bytes,
                r.kv_cache_bytes, r.generate_peak_bytes))))
        return rows

    def _summary(self) -> str:
        m, p = self.mesh, self.pipeline
        rows = max(1, self.batch // (m.dp * m.fsdp))
        return (
            f"mesh: {m}; each of the {m.pp} pipeline ranks is {_stage_ranks(m)} x {m.fsdp} fsdp rank(s), "
            f"{m.dp} replica(s); global batch {self.batch} = {rows} rows per pipeline x {m.dp * m.fsdp}, "
            f"seq {p.seq}, {p.n_microbatches} microbatches, {p.dtype}"
        )

    def __str__(self) -> str:
        rows = self._rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
        return "\n".join([
            str(self.pipeline), "", self._summary(), "Per rank (every tp / fsdp / dp slot of a pipeline rank alike):",
            table,
            _pipeline_note(self.mesh),
            "note: train peak = weights + grads + AdamW (exp_avg, exp_avg_sq: zeros_like(parameter), its dtype and "
            "shard) + fsdp gather + activations + P2P buffers; fsdp's padding of dim 0 is not counted",
            "note: generate peak = weights + fsdp gather (decoding gathers one unit at a time too) + KV cache",
        ])


def _pipeline_note(m: MeshShape) -> str:
    if m.ep_data > 1:
        over = "fsdp ranks" if m.fsdp > 1 else "replicas"
        return (f"note: the table above is one rank's pipeline, its replica's rows: 1/{m.ep} of each MoE layer's "
                f"experts, priced on the tokens the {m.ep_data} {over} of its ep group route to them; the rest "
                f"{'whole' if m.tp == 1 else 'as its tensor-parallel slices'}, before fsdp (which leaves the experts "
                "whole)")
    if m.tp == 1 and m.ep > 1:
        return (f"note: the table above is one expert-parallel rank's pipeline (1/{m.ep} of each MoE layer's experts, "
                "attention and dense layers whole), before fsdp")
    return ("note: the table above is one tensor-parallel rank's pipeline (its parameter slices, heads / tp), "
            "before fsdp")


def _stage_ranks(m: MeshShape) -> str:
    if m.ep == 1 or m.ep_data > 1:
        return f"{m.tp} tensor-parallel"
    return f"{m.ep} expert-parallel" if m.tp == 1 else f"{m.tp} tensor- and expert-parallel"


def _count(n: int) -> str:
    from ..planning.plan import human_count

    return human_count(n)


def mesh_layout(num_processes: int | None, stages: int | None, *, virtual_stages: int | None, tp_size: int,
                fsdp_size: int, ep_size: int, ep_over: str) -> tuple[int, int]:
    """``(stages, world)`` of a planned mesh, as ``from_pretrained`` places it: ``stages`` given, or what the world
    leaves a stage's ranks and fsdp (2 pipeline ranks without ``num_processes``), x ``virtual_stages``; the world
    given, or one replica of that pipeline, or the replicas an ep group over data spans (``ep_over="data"``). A
    layout :func:`mesh_shape` refuses comes out as the plain one, for it to refuse by name."""
    per_rank = virtual_stages or 1
    data = ep_over == "data" and ep_size > tp_size and ep_size % tp_size == 0
    stage_ranks, group = (tp_size, ep_size // tp_size) if data else (max(tp_size, ep_size), 1)
    if stages is None:  # as from_pretrained: the pipeline takes what the stage's ranks and fsdp leave
        stages = (2 if num_processes is None else max(1, num_processes // (stage_ranks * fsdp_size))) * per_rank
    return stages, num_processes or max(1, stages // per_rank) * stage_ranks * max(fsdp_size, group)


def mesh_report(
    path_or_config: Any,
    *,
    num_processes: int | None = None,
    tp_size: int = 1,
    fsdp_size: int = 1,
    ep_size: int = 1,
    ep_over: str = "stage",
    stages: int | None = None,
    virtual_stages: int | None = None,
    batch: int = 1,
    **plan_kwargs: Any,
) -> MeshReport:
    """Predict every rank's memory on a pp x tp x fsdp (x dp) mesh, from the config alone.

    Args:
        path_or_config: as :func:`~hf_pipeline.memory.planner.plan_report`.
        num_processes: ranks in the job (default: one replica, stages x tp x fsdp; with ``ep_over="data"`` the
            replicas one ep group spans).
        tp_size: tensor-parallel ranks per stage.
        fsdp_size: ranks each parameter is sharded over (FSDP2), per pipeline rank.
        ep_size: ranks of a stage splitting a mixture of experts' experts (each keeps ``E / ep_size`` of a
            layer's): its ``tp_size`` ranks, or, alone, ``ep_size`` ranks per stage running the rest whole.
        ep_over: ``"data"``: ``ep_size`` is ``tp_size`` x k consecutive replicas (or fsdp ranks) instead.
        stages: total pipeline stages (default: what the world leaves, num_processes / (tp x fsdp),
            x virtual_stages; 2 without num_processes).
        virtual_stages: stages per pipeline rank.
        batch: the global batch (sequences per step), split over dp x fsdp pipelines.
        plan_kwargs: the rest of :func:`~hf_pipeline.memory.planner.plan_report`'s arguments (dtype, seq, ...).

    Returns:
        :class:`MeshReport`.

    Raises:
        InputError: sizes that do not divide the world, a batch that does not split over dp x fsdp,
            or tensor parallelism for a family without a plan (named by the options' checks).
    """
    if fsdp_size < 1 or tp_size < 1 or ep_size < 1:
        raise InputError(f"--tp-size, --ep-size and --fsdp-size must be >= 1, got {tp_size}, {ep_size} and {fsdp_size}")
    stages, world = mesh_layout(num_processes, stages, virtual_stages=virtual_stages, tp_size=tp_size,
                                fsdp_size=fsdp_size, ep_size=ep_size, ep_over=ep_over)
    mesh = mesh_shape(world, pp_size=max(1, stages // (virtual_stages or 1)), tp_size=tp_size, fsdp_size=fsdp_size,
                      ep_size=ep_size, ep_over=ep_over)
    pipelines = mesh.dp * mesh.fsdp
    if batch % pipelines:
        raise InputError(
            f"--batch {batch} does not split over dp x fsdp = {mesh.dp} x {mesh.fsdp} = {pipelines} data-parallel "
            f"ranks; pass a multiple of {pipelines}"
        )
    pipeline = plan_report(path_or_config, stages=stages, virtual_stages=virtual_stages, batch=batch // pipelines,
                           tp_size=tp_size, ep_size=ep_size, ep_over=ep_over, **plan_kwargs)
    return MeshReport(mesh=mesh, batch=batch, pipeline=pipeline,
                      ranks=tuple(_rank(r, pipeline, mesh) for r in pipeline.ranks))


def fsdp_share(nbytes: int, fsdp_size: int) -> int:
    """One fsdp rank's share of ``nbytes`` of parameters (or their gradients / optimizer states)."""
    return -(-nbytes // fsdp_size)


def _rank(r, pipeline, mesh: MeshShape) -> MeshRankMemory:
    """One pipeline rank's figures under fsdp (``mesh.fsdp`` 1: the pipeline's own); with experts over data FSDP
    leaves the rank's experts whole (``ignored_params``) and shards the rest."""
    fsdp_size = mesh.fsdp
    mine = [s for s in pipeline.stages if s.rank == r.rank]
    whole = sum(s.expert_bytes for s in mine) if mesh.ep_data > 1 else 0
    weights = fsdp_share(r.weight_bytes - whole, fsdp_size) + whole
    params = sum(s.params for s in mine)
    whole_params = whole // getattr(torch, pipeline.dtype).itemsize if whole else 0
    gather = 2 * max(s.largest_unit_bytes for s in mine) if fsdp_size > 1 else 0
    held = 4 * weights + gather + r.p2p_buffer_bytes  # weights, grads, 2 AdamW states, gathers, P2P buffers
    return MeshRankMemory(
        pp_rank=r.rank, params=fsdp_share(params - whole_params, fsdp_size) + whole_params, weight_bytes=weights,
        grad_bytes=weights, optimizer_bytes=2 * weights, fsdp_gather_bytes=gather, activation_bytes=r.activation_bytes,
        p2p_buffer_bytes=r.p2p_buffer_bytes, train_peak_bytes=held + r.activation_bytes,
        checkpointed_activation_bytes=r.checkpointed_activation_bytes,
        checkpointed_train_peak_bytes=held + r.checkpointed_activation_bytes, kv_cache_bytes=r.kv_cache_bytes,
        generate_peak_bytes=weights + gather + r.kv_cache_bytes,
    )


def with_fsdp(report: MeshReport, fsdp_size: int) -> MeshReport:
    """``report`` re-sharded over ``fsdp_size`` (the arithmetic alone: the pipeline plan is kept)."""
    mesh = replace(report.mesh, fsdp=fsdp_size)
    return replace(report, mesh=mesh, ranks=tuple(_rank(r, report.pipeline, mesh) for r in report.pipeline.ranks))
