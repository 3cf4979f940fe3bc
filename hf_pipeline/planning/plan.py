"""Stage plan: which blocks and modules each pipeline stage owns, and which rank runs it.

The plan is computed from the config alone: the model is instantiated on the meta device (no
memory, no weights read), the recipe's module paths are resolved and checked against it
(:mod:`.resolve`), each block is costed (parameters, bytes and per-token FLOPs, counting the
embedding and the LM head) and the blocks are cut into contiguous stages (:mod:`.partition`) that
balance the cost, at equal block counts or where the caller says.

Example:
    >>> plan = make_plan(meta_model, get_recipe("llama"), pp_size=2, virtual_stages=2)
    >>> print(plan)          # one row per stage: rank, blocks, parameters, bytes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from ..errors import PlanError
from ..families.recipe import Recipe
from .moe_costs import routed_shares
from .partition import CUT_GAIN, Objective, objective, stage_costs
from .resolve import COST_SEQ_LEN, ResolvedRecipe, hidden_size, module_stats, outside_blocks, resolve_recipe
from .schedules import ScheduleSpec, rank_of_stage

__all__ = ["PlanError", "StagePlan", "StageSpec", "compress_blocks", "human_count", "make_plan", "stage_flops_parts"]

LAYOUTS = ("loop", "v")


def human_count(n: float) -> str:
    """A count in three significant digits with a K/M/G/T/P suffix (``1.23M``), as the reports print it."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One pipeline stage: the blocks it runs and every module FQN it holds."""

    index: int
    rank: int  # rank inside the pipeline group
    blocks: tuple[str, ...]
    modules: tuple[str, ...]  # all owned module FQNs (embeddings, blocks, finals, head, replicas)
    stacks: tuple[str, ...]  # names of the stacks this stage runs blocks of
    params: int
    nbytes: int
    flops_per_token: float
    is_first: bool
    is_last: bool
    # Blocks this stage runs only one half of, with the half: 0 = the first (attention) half, 1 =
    # the second (MLP) half. Only a stage's first block can be a second half, only its last a first.
    halves: tuple[tuple[str, int], ...] = ()
    start: str = ""  # where the stage starts: its first block, or the first module of that block's second half

    def half_of(self, block: str) -> int | None:
        """0 or 1 if this stage runs only that half of ``block``; None if it runs the whole block."""
        return dict(self.halves).get(block)

    @property
    def attention_blocks(self) -> tuple[str, ...]:
        """Blocks whose attention (first half) this stage runs: the layers whose KV cache it keeps."""
        return tuple(b for b in self.blocks if self.half_of(b) != 1)


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """The split of one model into stages and their placement on the pipeline ranks."""

    model_class: str
    model_type: str
    pp_size: int
    virtual_stages: int
    layout: str
    dtype: torch.dtype
    stages: tuple[StageSpec, ...]
    total_params: int
    total_bytes: int
    tied: tuple[tuple[str, ...], ...] = ()
    # The mesh the plan runs on: pipeline replicas, tensor-parallel ranks per stage and what they shard.
    dp_size: int = 1
    tp_size: int = 1
    tp_plan: tuple[tuple[str, str], ...] = ()
    fsdp_size: int = 1  # of the dp_size data-parallel ranks, those sharding each stage's parameters (FSDP2)
    ep_plan: tuple[tuple[str, str], ...] = ()  # the expert rules: each of the tp_size ranks keeps 1/tp_size of them
    _by_rank: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise PlanError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        by_rank: dict[int, list[int]] = {r: [] for r in range(self.pp_size)}
        for s in self.stages:
            by_rank[s.rank].append(s.index)
        self._by_rank.update({r: tuple(v) for r, v in by_rank.items()})

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def split_points(self) -> tuple[str, ...]:
        """What starts stages 1..S-1, in the form ``make_plan(split=...)`` takes to rebuild this plan."""
        return tuple(s.start or s.blocks[0] for s in self.stages[1:])

    def stages_for_rank(self, rank: int) -> tuple[StageSpec, ...]:
        """The stages pipeline rank ``rank`` runs, in stage order."""
        return tuple(self.stages[i] for i in self._by_rank[rank])

    @property
    def first_rank(self) -> int:
        return self.stages[0].rank

    @property
    def last_rank(self) -> int:
        return self.stages[-1].rank

    def to_dict(self) -> dict:
        return {
            "model_class": self.model_class,
            "model_type": self.model_type,
            "pp_size": self.pp_size,
            "virtual_stages": self.virtual_stages,
            "layout": self.layout,
            "dtype": str(self.dtype).removeprefix("torch."),
            "total_params": self.total_params,
            "total_bytes": self.total_bytes,
            "mesh": {"dp": self.dp_size, "pp": self.pp_size, "tp": self.tp_size}, "tp_plan": dict(self.tp_plan),
            "ep_plan": dict(self.ep_plan),
            "stages": [
                {
                    "index": s.index,
                    "rank": s.rank,
                    "blocks": list(s.blocks),
                    "halves": {b: h for b, h in s.halves},
                    "modules": list(s.modules),
                    "params": s.params,
                    "bytes": s.nbytes,
                    "flops_per_token": s.flops_per_token,
                }
                for s in self.stages
            ],
        }

    def __str__(self) -> str:
        human = human_count
        head = (
            f"StagePlan: {self.model_class} ({self.model_type}), {self.num_stages} stages on {self.pp_size} "
            f"rank(s), {self.virtual_stages} per rank ({self.layout} layout), "
            f"{str(self.dtype).removeprefix('torch.')}, "
            f"{human(self.total_params)} params / {human(self.total_bytes)}B"
        )
        rows = [("stage", "rank", "blocks", "params", "bytes", "GFLOP/tok", "other modules")]
        for s in self.stages:
            blocks = compress_blocks(s.blocks)
            if s.halves:
                blocks += (
                    " ("
                    + ", ".join(f"{b.rpartition('.')[2]}: {'1st' if h == 0 else '2nd'} half" for b, h in s.halves)
                    + ")"
                )
            others = [m for m in s.modules if m not in s.blocks and not any(m.startswith(b + ".") for b in s.blocks)]
            rows.append((str(s.index), str(s.rank), blocks, human(s.params), human(s.nbytes) + "B",
                         f"{s.flops_per_token / 1e9:.3f}", ", ".join(others) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = [head]
        if self.fsdp_size > 1:  # global rank = (replica x fsdp + fsdp rank) x pp + pp rank; each runs its own rows
            dp = f"dp={self.dp_size // self.fsdp_size} x " if self.dp_size > self.fsdp_size else ""  # HSDP replicas
            tp = f" x tp={self.tp_size}, fsdp over tp's slices" if self.tp_size > 1 else ""
            lines.append(f"mesh: {dp}fsdp={self.fsdp_size} x pp={self.pp_size}{tp}; each keeps 1/{self.fsdp_size} "
                         "of a tensor")
        elif self.dp_size > 1 or self.tp_size > 1:  # global rank = (dp x pp + pp rank) x tp + tp rank
            lines.append(f"mesh: dp={self.dp_size} x pp={self.pp_size} x tp={self.tp_size}, tp innermost; "
                         + (f"each stage rank holds 1/{self.tp_size} of " + ", ".join(
                             f"{k} ({v})" for k, v in self.tp_plan + self.ep_plan) + ", the rest whole"
                            if self.tp_plan or self.ep_plan else "every rank holds its stages whole"))
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
        return "\n".join(lines)


def compress_blocks(blocks: Sequence[str]) -> str:
    """'model.layers.0', 'model.layers.1', 'model.layers.2' -> 'model.layers.0-2'."""
    out: list[str] = []
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for b in blocks:
        prefix, _, idx = b.rpartition(".")
        if prefix not in groups:
            groups[prefix] = []
            order.append(prefix)
        groups[prefix].append(int(idx))
    for prefix in order:
        idx = groups[prefix]
        out.append(f"{prefix}.{idx[0]}" if len(idx) == 1 else f"{prefix}.{idx[0]}-{idx[-1]}")
    return ", ".join(out)


@dataclass(frozen=True)
class _Unit:
    """What the partitioner places: a whole block (``half`` None) or one half of it (0, 1)."""

    stack: int
    block: str
    half: int | None


class _Units:
    """The units of a model, in execution order across stacks, and the modules each stands for.

    One unit per half of each block the recipe lets the planner cut, one per other block.
    Embeddings go with the first unit of their stack, final modules with its last, the head with
    the very last unit. A block whose two halves end up on one stage is one whole unit again.
    """

    def __init__(self, resolved: ResolvedRecipe):
        self.resolved = resolved
        self.units: list[_Unit] = []
        for si, st in enumerate(resolved.stacks):
            for b in st.blocks:
                self.units += [_Unit(si, b, 0), _Unit(si, b, 1)] if b in st.cuttable else [_Unit(si, b, None)]
        self.block_starts = [i for i, u in enumerate(self.units) if u.half != 1]  # unit indices where a block starts

    def __len__(self) -> int:
        return len(self.units)

    @property
    def n_blocks(self) -> int:
        return len(self.block_starts)

    def modules(self, unit: _Unit) -> list[str]:
        """The module FQNs one unit runs: its block, or the block's children in its half."""
        if unit.half is None:
            return [unit.block]
        return [f"{unit.block}.{c}" for c in self.resolved.stacks[unit.stack].halves[unit.half]]

    def extra_modules(self, group: Sequence[_Unit], is_last: bool) -> list[str]:
        """The modules a stage running ``group`` holds besides its blocks: embeddings, replicas, finals, head."""
        mods: list[str] = []
        for si, st in enumerate(self.resolved.stacks):
            mine = [u for u in group if u.stack == si]
            if not mine:
                continue
            if mine[0].block == st.blocks[0] and mine[0].half != 1:
                mods += st.embed
            owned = [m for u in mine for m in self.modules(u)]
            mods += [m for m in st.every_stage if not any(m == o or m.startswith(o + ".") for o in owned)]
            if mine[-1].block == st.blocks[-1] and mine[-1].half != 0:
                mods += st.final
        if is_last:
            mods += self.resolved.head.modules
        return mods

    def start_names(self) -> dict[str, int]:
        """What a stage may start at -> its unit index: a block, or the first module of a block's second half."""
        names: dict[str, int] = {}
        for i, u in enumerate(self.units):
            names[u.block if u.half != 1 else self.modules(u)[0]] = i
        return names

    def group(self, start: int, end: int) -> list[_Unit]:
        """Units ``start:end`` as one stage runs them: both halves of a block there are the whole block."""
        group: list[_Unit] = []
        for u in self.units[start:end]:
            if u.half == 1 and group and group[-1].block == u.block:
                group[-1] = _Unit(u.stack, u.block, None)  # both halves on this stage: the whole block
            else:
                group.append(u)
        return group


class _Coster:
    """(params, bytes, FLOPs per token) of a stage running a group of units."""

    def __init__(self, model: nn.Module, units: _Units, *, itemsize: int, seq_len: int, measured: Mapping[str, float]):
        self.model, self.units, self.itemsize, self.seq_len = model, units, itemsize, seq_len
        self.hidden = hidden_size(model)
        # An experts module costs what a token runs through (top_k of E experts), not what it holds.
        self.shares = routed_shares(model)
        self.measured = dict(measured)
        unknown = sorted(set(self.measured) - outside_blocks(units.resolved))
        if unknown:
            raise PlanError(
                f"measured_flops names {unknown}, which are not embeddings, final modules or the head of "
                f"{units.resolved.class_name}"
            )

    def stats(self, group: Sequence[_Unit], is_last: bool) -> tuple[int, int, float]:
        mods = [m for u in group for m in self.units.modules(u)] + self.units.extra_modules(group, is_last)
        attention = sum(1 for u in group if u.half != 1)  # the attention scores run in the first half
        params, nbytes, flops = module_stats(self.model, mods, self.itemsize, self.seq_len, self.hidden, attention,
                                             self.shares)
        for m in mods:
            if m in self.measured:  # a measured cost replaces the module's FLOP count
                flops += (
                    self.measured[m] - module_stats(self.model, [m], self.itemsize, self.seq_len, self.hidden, 0)[2]
                )
        return params, nbytes, flops


class _TooMany:
    """The refusal of more stages than a model has blocks (or block halves) to give them."""

    def __init__(self, class_name: str, pp_size: int, virtual_stages: int):
        self.class_name, self.pp_size, self.virtual_stages = class_name, pp_size, virtual_stages

    def __call__(self, available: int, what: str) -> PlanError:
        return PlanError(
            f"{self.pp_size * self.virtual_stages} stages requested ({self.pp_size} ranks x {self.virtual_stages} "
            f"virtual stages) but {self.class_name} has only {available} {what}; use fewer ranks or virtual_stages"
        )


# ----------------------------------------------------------------------------- the split modes
def _auto_starts(units: _Units, coster: _Coster, goal: Objective, num_stages: int, too_many: _TooMany) -> list[int]:
    """``split="auto"``: the whole-block split that minimises ``goal``, or one cutting blocks in
    halves where the recipe allows it and that is clearly better."""
    costs = [coster.stats([u], i == len(units) - 1)[2] for i, u in enumerate(units.units)]
    block_starts = units.block_starts
    block_costs = [sum(costs[a:b]) for a, b in zip(block_starts, block_starts[1:] + [len(units)])]
    starts = None
    if num_stages <= units.n_blocks:
        whole = goal.split(block_costs)
        starts = [block_starts[i] for i in whole]
        best = goal.score(stage_costs(block_costs, whole))[0]
    if len(units) > units.n_blocks:
        if num_stages > len(units):
            raise too_many(len(units), "block halves")
        cut = goal.split(costs)
        # Cut a block only where that makes the step clearly faster: a whole-block plan is
        # the simpler one to read, and equal cost is no reason to leave it.
        if starts is None or goal.score(stage_costs(costs, cut))[0] < (1.0 - CUT_GAIN) * best:
            starts = cut
    if starts is None:
        raise too_many(units.n_blocks, "blocks")
    return starts


def _uniform_starts(units: _Units, num_stages: int, too_many: _TooMany) -> list[int]:
    """``split="uniform"``: equal numbers of whole blocks."""
    n_blocks = units.n_blocks
    if num_stages > n_blocks:
        raise too_many(n_blocks, "blocks")
    return [units.block_starts[round(k * n_blocks / num_stages)] for k in range(num_stages)]


def _named_starts(units: _Units, split: Sequence[str], num_stages: int) -> list[int]:
    """An explicit split: the blocks (or second halves of blocks) that start stages 1..S-1."""
    first, last = units.units[0].block, units.units[-1].block
    names = units.start_names()
    split = list(split)
    if len(split) != num_stages - 1:
        raise PlanError(
            f"split lists {len(split)} block(s) to start stages at, but {num_stages} stages need "
            f"{num_stages - 1}; blocks are {first} ... {last}"
        )
    starts = [0]
    for fqn in split:
        if fqn not in names:
            halves = [n for n in names if n not in {u.block for u in units.units}]
            hint = f"; a stage can also start at a block's second half ({halves[0]}, ...)" if halves else ""
            raise PlanError(
                f"split point {fqn!r} is not a block of {units.resolved.class_name}; "
                f"blocks are {first} ... {last}{hint}"
            )
        starts.append(names[fqn])
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise PlanError(
            f"split points {split} must be distinct blocks in increasing order, none of them the first block"
        )
    return starts


# ----------------------------------------------------------------------------- the plan
def _check_placement(pp_size: int, virtual_stages: int, layout: str) -> None:
    if pp_size < 1 or virtual_stages < 1:
        raise PlanError(f"pp_size and virtual_stages must be >= 1 (got {pp_size}, {virtual_stages})")
    if layout == "v" and virtual_stages != 2:
        raise PlanError(f"the V layout places exactly 2 stages per rank; got virtual_stages={virtual_stages}")


def _stage(
    index: int, group: list[_Unit], *, units: _Units, coster: _Coster, pp_size: int, layout: str, is_last: bool
) -> StageSpec:
    """The :class:`StageSpec` of stage ``index``, which runs ``group``."""
    params, nbytes, flops = coster.stats(group, is_last)
    owned = [m for u in group for m in units.modules(u)]
    return StageSpec(
        index=index,
        rank=rank_of_stage(index, pp_size, layout),
        blocks=tuple(u.block for u in group),
        modules=tuple(dict.fromkeys(units.extra_modules(group, is_last) + owned)),
        stacks=tuple(dict.fromkeys(units.resolved.stacks[u.stack].name for u in group)),
        params=params,
        nbytes=nbytes,
        flops_per_token=flops,
        is_first=index == 0,
        is_last=is_last,
        halves=tuple((u.block, u.half) for u in group if u.half is not None),
        start=units.modules(group[0])[0] if group[0].half == 1 else group[0].block,
    )


def make_plan(
    model: nn.Module,
    recipe: Recipe | ResolvedRecipe,
    *,
    pp_size: int,
    virtual_stages: int = 1,
    layout: str = "loop",
    split: str | Sequence[str] = "auto",
    dtype: torch.dtype | None = None,
    seq_len: int = COST_SEQ_LEN,
    schedule: ScheduleSpec | str | None = None,
    n_microbatches: int | None = None,
    measured_flops: Mapping[str, float] | None = None,
) -> StagePlan:
    """Split ``model`` (on the meta device) into ``pp_size * virtual_stages`` stages.

    Args:
        model: the HF model, usually on the meta device.
        recipe: its recipe (resolved or not).
        pp_size: ranks in the pipeline.
        virtual_stages: stages per rank (interleaved schedules use 2+).
        layout: "loop" (rank r owns stages r, r+p, ...) or "v" (rank r owns r and 2p-1-r).
        split: "auto" for cost balancing (cutting a block between its attention and MLP halves
            where the recipe allows it and that balances better), "uniform" for equal block counts,
            or what starts stages 1..S-1: block FQNs (``["model.layers.4"]``) or the first module of
            a block's second half (``["model.layers.4.post_attention_layernorm"]``).
        dtype: dtype the weights will be loaded in (for the byte counts); default: the model's.
        seq_len: sequence length used to cost attention.
        schedule, n_microbatches: the training schedule and microbatch count the split is balanced
            for when a rank holds several stages (``split="auto"``; default: the layout's default
            schedule, one microbatch per stage).
        measured_flops: per-token costs, in the FLOPs of a block, that replace the FLOP count of the
            named modules (the head and loss as measured on the device:
            :func:`hf_pipeline.tools.split_advice.measure_split`).
    Returns:
        The :class:`StagePlan`.
    """
    resolved = recipe if isinstance(recipe, ResolvedRecipe) else resolve_recipe(model, recipe)
    _check_placement(pp_size, virtual_stages, layout)
    num_stages = pp_size * virtual_stages
    if dtype is None:
        dtype = next(model.parameters()).dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    units = _Units(resolved)
    coster = _Coster(model, units, itemsize=itemsize, seq_len=seq_len, measured=measured_flops or {})
    too_many = _TooMany(resolved.class_name, pp_size, virtual_stages)
    if split == "auto":
        goal = objective(
            num_stages=num_stages, pp_size=pp_size, virtual_stages=virtual_stages, layout=layout,
            schedule=schedule, n_microbatches=n_microbatches,
        )
        starts = _auto_starts(units, coster, goal, num_stages, too_many)
    elif split == "uniform":
        starts = _uniform_starts(units, num_stages, too_many)
    elif isinstance(split, str):
        raise PlanError(f"split must be 'auto', 'uniform' or a list of block names, got {split!r}")
    else:
        starts = _named_starts(units, split, num_stages)
    bounds = list(zip(starts, starts[1:] + [len(units)]))
    stages = tuple(
        _stage(s, units.group(a, b), units=units, coster=coster, pp_size=pp_size, layout=layout,
               is_last=s == num_stages - 1)
        for s, (a, b) in enumerate(bounds)
    )
    total_params = sum(p.numel() for p in model.parameters())
    return StagePlan(
        model_class=resolved.class_name,
        model_type=str(getattr(getattr(model, "config", None), "model_type", "")),
        pp_size=pp_size,
        virtual_stages=virtual_stages,
        layout=layout,
        dtype=dtype,
        stages=stages,
        total_params=total_params,
        total_bytes=total_params * itemsize,
        tied=resolved.tied,
    )


def stage_flops_parts(
    model: nn.Module, resolved: ResolvedRecipe, spec: StageSpec, *, seq_len: int
) -> tuple[float, dict[str, float]]:
    """A stage's FLOPs per token in two parts: its blocks (or block halves), and each other module it
    holds (embeddings, final modules, the head, modules every stage runs), by name."""
    extra = outside_blocks(resolved)
    hidden = hidden_size(model)
    attention = len(spec.attention_blocks)  # as make_plan counts them: a second half runs no attention
    blocks = [m for m in spec.modules if m not in extra]
    return (
        module_stats(model, blocks, 1, seq_len, hidden, attention, routed_shares(model))[2],
        {m: module_stats(model, [m], 1, seq_len, hidden, 0)[2] for m in spec.modules if m in extra},
    )
