"""Tensor parallelism inside each stage: the sizes the user asked for, and the plan that shards a stage.

Three ways to ask, as transformers' ``from_pretrained`` takes them: ``tp_size=`` / ``fsdp_size=``,
``distributed_config=DistributedConfig(pp_size=..., tp_size=...)`` or ``DistributedConfig(fsdp_size=...)``
(transformers' own class, which refuses ``fsdp_size`` together with ``pp_size``: the pipeline depth then
comes from ``num_stages``) and ``device_mesh=`` (a torch ``DeviceMesh`` with dims named ``"pp"``,
``"tp"`` and optionally ``"dp"`` or ``"fsdp"``).
:func:`parallel_request` turns any of them into one :class:`ParallelRequest`; :func:`tp_plan` gives
the module patterns and styles (``"colwise"`` / ``"rowwise"`` / ``"packed_colwise[:K]"`` and the others of
``mesh_rules.STYLES``) that shard a stage, from the config's ``base_model_tp_plan`` (LLaMA, Mistral, Qwen2 and
most of the generic decoder recipe's families), the recipe's ``[tp]`` plan
(GPT-2, BERT, T5) or the caller's ``tp_plan``, after checking that ``tp_size`` divides the heads.

Example:
    >>> dc = DistributedConfig(pp_size=2, tp_size=2)
    >>> req = parallel_request(tp_size=None, distributed_config=dc, device_mesh=None, world_size=4)
    >>> req.tp_size, req.pp_size
    (2, 2)
    >>> tp_plan(llama_config, 2)[:1]
    (('layers.*.mlp.down_proj', 'rowwise'),)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from ..errors import InputError

__all__ = ["EP_OVER", "ParallelRequest", "ep_data_ranks", "parallel_request", "tp_plan"]

# The styles of transformers' plans this version applies are planning/mesh_rules.STYLES and packed colwise.

# DistributedConfig fields this version cannot honour, with what a value other than the default asks for.
_UNSUPPORTED = {
    "fsdp_plan": "a custom FSDP plan (each block is one FSDP unit here)", "fsdp_cpu_offload": "FSDP CPU offload",
    "fsdp_mixed_precision": "FSDP mixed precision", "enable_sequence_parallel": "sequence parallelism",
}
_MESH_DIMS = ("dp", "fsdp", "pp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelRequest:
    """What the caller asked for: tensor-parallel ranks per stage, ranks per pipeline (None: from
    ``num_stages``), pipeline replicas (None: whatever the world leaves) and a plan override.

    Attributes:
        tp_size: tensor-parallel ranks per stage (1: none).
        pp_size: pipeline ranks, or None to take them from ``num_stages`` / the world size.
        dp_size: pipeline replicas the caller named (``dp_replicate_size``, a mesh's ``"dp"``), else None.
        plan: ``(module pattern, style)`` pairs replacing the config's plan, or None.
        fsdp_size: data-parallel ranks sharding each stage's parameters with FSDP2 (1: none).
        ep_size: expert-parallel ranks per stage (1: none). They are the stage's ranks that share its batch,
            the tensor-parallel ranks: ``ep_size`` equals ``tp_size``, or is given alone, and then the stage's
            ``ep_size`` ranks shard only the experts (transformers' ``ep_size=tp_size, tp_plan={}``).
        ep_plan: ``(module or parameter pattern, style)`` pairs overriding the config's ``base_model_ep_plan``.
        ep_implementation: how tokens reach the experts (transformers' ``DistributedConfig.ep_implementation``).
        ep_over: ``"stage"`` (default): the ``ep_size`` expert-parallel ranks share one batch, as above;
            ``"data"``: they are a stage's ``tp_size`` ranks times ``ep_size / tp_size`` consecutive data-parallel
            ranks, whose batches differ (transformers' ``ep_size > tp_size``: the routed tokens are exchanged
            all-to-all among them).
    """

    tp_size: int = 1
    pp_size: int | None = None
    dp_size: int | None = None
    plan: tuple[tuple[str, str], ...] | None = None
    fsdp_size: int = 1
    ep_size: int = 1
    ep_plan: tuple[tuple[str, str], ...] | None = None
    ep_implementation: str = "auto"
    ep_over: str = "stage"

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "fsdp_size", "ep_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        _check_ep_over(self.ep_size, self.tp_size, self.ep_over, self.ep_implementation)

    @property
    def ep_data(self) -> int:
        """Data-parallel ranks one expert-parallel group spans (:func:`ep_data_ranks`)."""
        return ep_data_ranks(self.ep_size, self.tp_size, self.ep_over)

    @property
    def stage_ranks(self) -> ParallelRequest:
        """This request with ``tp_size`` counting every rank of a stage: an ``ep_size`` given alone makes
        ``ep_size`` ranks per stage with no tensor-parallel rule (transformers' ``tp_plan={}``)."""
        if self.ep_size > 1 and self.tp_size == 1 and self.ep_over == "stage":
            return dataclasses.replace(self, tp_size=self.ep_size, plan=())
        return self


EP_OVER = ("stage", "data")


def ep_data_ranks(ep_size: int, tp_size: int, ep_over: str) -> int:
    """Data-parallel ranks one expert-parallel group spans: ``ep_size / tp_size`` with ``ep_over="data"``, else 1
    (the experts split within each stage)."""
    return ep_size // tp_size if ep_over == "data" else 1


def _check_ep_over(ep_size: int, tp_size: int, ep_over: Any, implementation: str) -> None:
    """Which ranks an ``ep_size`` spans: a stage's batch-sharing ranks, or (``ep_over="data"``) ``ep_size / tp_size``
    data-parallel ranks of ``tp_size`` ranks each; refused by name otherwise."""
    if ep_over not in EP_OVER:
        raise InputError(f"ep_over must be one of {list(EP_OVER)}, got {ep_over!r}")
    if ep_over == "stage" and ep_size > 1 and tp_size not in (1, ep_size):
        raise InputError(
            f"ep_size={ep_size} with tp_size={tp_size}: a stage's experts are split over the ranks that share its "
            "batch, its tensor-parallel ranks, so ep_size must equal tp_size (or be given alone); for experts across "
            "data-parallel ranks pass ep_over='data' with ep_size a multiple of tp_size"
        )
    if ep_over != "data":
        return
    if ep_size <= tp_size or ep_size % tp_size:
        raise InputError(
            f"ep_over='data' with ep_size={ep_size} and tp_size={tp_size}: the experts span tp_size ranks times "
            "ep_size / tp_size > 1 data-parallel ranks, so ep_size must be a multiple k > 1 of tp_size; pass such an "
            "ep_size, or leave ep_over unset to split the experts over each stage's own ranks"
        )
    if implementation == "all_reduce":
        raise InputError(
            "ep_over='data' with ep_implementation='all_reduce': all-reduce needs every expert-parallel rank to hold "
            "the same batch, and replicas hold different rows; use ep_implementation='auto' or 'all_to_all'"
        )


def _from_distributed_config(dc: Any, ep_over: str | None = None) -> ParallelRequest:
    """transformers' ``DistributedConfig`` as a request; fields this version lacks are refused by name."""
    defaults = {f.name: f.default for f in fields(dc)}
    for name, what in _UNSUPPORTED.items():
        value = getattr(dc, name, None)
        unset = value is None or value == defaults.get(name) or (name.endswith("_size") and value == 1)
        if name in defaults and not unset:
            raise InputError(
                f"distributed_config.{name}={value!r} asks for {what}, which pipeline=True does not do yet; "
                f"leave {name} unset (pipeline replicas come from world size / (pp_size x tp_size x fsdp_size))"
            )
    plan = dc.tp_plan
    if plan is not None and plan != "auto" and not isinstance(plan, dict):
        raise InputError(f"distributed_config.tp_plan must be 'auto', None or a dict of module -> style, got {plan!r}")
    ep_plan = getattr(dc, "ep_plan", None)
    # Its __post_init__ turns unset sizes into 1: a 1 says nothing here, so the pipeline depth comes from
    # num_stages (default world / tp_size) and the replicas from what the world leaves, as with tp_size=.
    # ep_size > tp_size > 1, or ep_size > tp_size with fsdp_size, can only mean experts over data-parallel (its fsdp)
    # ranks (transformers' meaning); with tp_size 1 and no fsdp an ep_size stays the stage's own ranks unless ep_over
    # says otherwise.
    ep_size, tp_size = getattr(dc, "ep_size", None) or 1, dc.tp_size or 1
    if ep_over is None:
        ep_over = "data" if ep_size > tp_size and (tp_size > 1 or (dc.fsdp_size or 1) > 1) else "stage"
    return ParallelRequest(
        tp_size=tp_size, pp_size=dc.pp_size if (dc.pp_size or 1) > 1 else None,
        dp_size=dc.dp_replicate_size if (dc.dp_replicate_size or 1) > 1 else None,
        plan=tuple(plan.items()) if isinstance(plan, dict) else None, fsdp_size=dc.fsdp_size or 1,
        ep_size=ep_size, ep_plan=tuple(ep_plan.items()) if ep_plan else None,
        ep_implementation=getattr(dc, "ep_implementation", "auto"), ep_over=ep_over,
    )


def _from_mesh(mesh: Any, world_size: int) -> ParallelRequest:
    """A torch ``DeviceMesh`` with named dims as a request; its layout must be the one the package builds."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not names or set(names) - set(_MESH_DIMS) or len(set(names)) != len(names) or "pp" not in names:
        raise InputError(
            f"device_mesh must have named dims among {list(_MESH_DIMS)} including 'pp' (e.g. init_device_mesh('cpu', "
            f"(2, 2), mesh_dim_names=('pp', 'tp'))), got mesh_dim_names={names or None}"
        )
    sizes = dict(zip(names, mesh.mesh.shape))
    if mesh.mesh.numel() != world_size:
        raise InputError(f"device_mesh has {mesh.mesh.numel()} ranks {sizes}, but the world size is {world_size}")
    order = [n for n in _MESH_DIMS if n in names]
    if list(names) != order or mesh.mesh.flatten().tolist() != list(range(world_size)):
        raise InputError(
            f"device_mesh dims must be in the order {order} over ranks 0..{world_size - 1} in order (tensor "
            f"parallelism innermost), got mesh_dim_names={names} over ranks {mesh.mesh.flatten().tolist()}"
        )
    return ParallelRequest(
        tp_size=sizes.get("tp", 1), pp_size=sizes["pp"], dp_size=sizes.get("dp"), fsdp_size=sizes.get("fsdp", 1)
    )


def parallel_request(
    *, tp_size: int | None, distributed_config: Any, device_mesh: Any, world_size: int | None,
    fsdp_size: int | None = None, ep_size: int | None = None, ep_over: str | None = None,
) -> ParallelRequest:
    """One :class:`ParallelRequest` from ``from_pretrained``'s ``tp_size`` / ``fsdp_size`` / ``ep_size``
    (together or alone), ``distributed_config`` and ``device_mesh``.

    Raises:
        InputError: more than one of them given, a field this version does not support, a mesh of
            other dims or layout, naming the argument.
    """
    sizes = " / ".join(
        n for n, v in (("tp_size", tp_size), ("fsdp_size", fsdp_size), ("ep_size", ep_size)) if v is not None
    )
    given = [n for n, v in ((sizes, sizes or None), ("distributed_config", distributed_config),
                            ("device_mesh", device_mesh)) if v is not None]
    if len(given) > 1:
        raise InputError(
            f"pass one of tp_size / fsdp_size / ep_size, distributed_config and device_mesh, not {' and '.join(given)}"
        )
    if distributed_config is not None:
        from transformers.distributed import DistributedConfig

        if not isinstance(distributed_config, DistributedConfig):
            raise InputError(
                f"distributed_config must be a transformers.distributed.DistributedConfig, got "
                f"{type(distributed_config).__name__}"
            )
        return _from_distributed_config(distributed_config, ep_over)
    if device_mesh is not None:
        if ep_over is not None:
            raise InputError("ep_over needs ep_size (or distributed_config=DistributedConfig(ep_size=...)), not "
                             "device_mesh; pass ep_size=... and ep_over='data' instead of device_mesh")
        return _from_mesh(device_mesh, world_size or 1)
    return ParallelRequest(
        tp_size=1 if tp_size is None else tp_size, fsdp_size=1 if fsdp_size is None else fsdp_size,
        ep_size=1 if ep_size is None else ep_size, ep_over="stage" if ep_over is None else ep_over,
    )


def _check_divides(config, tp_size: int, extra: tuple[str, ...] = ()) -> None:
    """``tp_size`` must divide every dimension a plan shards, named by its config field (``extra``: the
    family's own fields, from its recipe: GPT-2's ``n_inner``, T5's ``d_ff``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", *extra):
        value = getattr(text, name, None)
        if isinstance(value, int) and value % tp_size:
            kv = name == "num_key_value_heads"
            raise InputError(
                f"tp_size={tp_size} does not divide config.{name}={value}: each tensor-parallel rank holds an equal "
                f"share{' (k/v projections replicated across ranks are not supported yet)' if kv else ''}; "
                f"choose a tp_size that divides it"
            )


def tp_plan(
    config, tp_size: int, *, override=None, traced: bool = False, schedule: str | None = None,
    model_class: str | None = None,
) -> tuple[tuple[str, str], ...]:
    """``(module pattern, style)`` pairs sharding a stage over ``tp_size`` ranks (empty for 1).

    Patterns are module names, ``*`` standing for one block index, matched against the end of a
    stage's module names (``"layers.*.mlp.up_proj"`` matches ``model.layers.3.mlp.up_proj``), as the
    config's ``base_model_tp_plan`` names modules of the base model. A family transformers has no
    plan for (GPT-2, BERT, T5) takes its recipe's ``[tp] plan``.

    Args:
        config: the transformers config.
        tp_size: tensor-parallel ranks per stage.
        override: the caller's plan (``DistributedConfig.tp_plan`` as pairs), else the config's or the recipe's.
        traced: the stages come from the tracer, which has no module names to shard.
        schedule: the pipeline schedule's name, checked against the schedules tensor parallelism runs.
        model_class: the model class's name, for messages (default: the family).

    Raises:
        InputError: no plan for the family, a style this version does not apply, a schedule that cannot
            run tensor-parallel stages, or ``tp_size`` not dividing the heads / kv heads / MLP width
            (naming the config field).
    """
    if tp_size == 1 or (override is not None and not override):  # tp_plan={}: no rule (transformers' meaning)
        return ()
    from ..families.recipe import list_recipes
    from .mesh_rules import REFUSED_STYLES, STYLES, check_tp_schedule, parse_style

    family = getattr(config, "model_type", type(config).__name__)
    recipe = list_recipes().get(family)
    plan = dict(override) if override is not None else None
    if plan is None:
        base = getattr(config, "base_model_tp_plan", None) or (dict(recipe.tp_plan) if recipe is not None else None)
        if traced or not base:
            raise InputError(
                f"{model_class or family} with tp_size={tp_size}: the {family} family has no tensor-parallel plan "
                f"(transformers' base_model_tp_plan is empty and no recipe carries one); load it with tp_size=1, or "
                f"pass distributed_config=DistributedConfig(tp_size=..., tp_plan={{module: 'colwise' | 'rowwise'}})"
            )
        plan = dict(base)
    bad = {k: v for k, v in plan.items() if parse_style(v) is None}
    if bad:
        why = "; ".join(f"{v!r}: {REFUSED_STYLES[v]}" for v in sorted(set(bad.values())) if v in REFUSED_STYLES)
        raise InputError(
            f"{model_class or family}: tp_plan styles {bad} are not supported with pipeline=True"
            f"{f' ({why})' if why else ''}; load with tp_size=1, or pass a plan (DistributedConfig(tp_plan=...)) "
            f"of the styles {[*STYLES, 'packed_colwise', 'packed_colwise:K']} (packed: K blocks side by side, "
            f"each sharded)"
        )
    if schedule is not None:
        check_tp_schedule(schedule, tp_size)
    _check_divides(config, tp_size, recipe.tp_divides if recipe is not None else ())
    return tuple(sorted(plan.items()))
