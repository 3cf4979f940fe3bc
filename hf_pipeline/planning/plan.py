"""Stage plan: which blocks and modules each pipeline stage owns, and which rank runs it.

The plan is computed from the config alone: the model is instantiated on the meta device (no
memory, no weights read), the recipe's module paths are resolved and checked against it, each
block is costed (parameters, bytes and per-token FLOPs, counting the embedding and the LM head)
and the blocks are cut into contiguous stages that balance the cost.

Example:
    >>> plan = make_plan(meta_model, get_recipe("llama"), pp_size=2, virtual_stages=2)
    >>> print(plan)          # one row per stage: rank, blocks, parameters, bytes
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import PlanError
from ..families.recipe import HeadSpec, Recipe, RecipeError
from .schedules import SCHEDULES, ScheduleSpec, default_schedule, get_schedule, rank_of_stage, simulate_step

__all__ = ["ParamLayout", "PlanError", "ResolvedRecipe", "StagePlan", "StageSpec", "make_plan", "param_layout", "resolve_recipe", "stage_flops_parts"]

LAYOUTS = ("loop", "v")
# ``split="auto"`` cuts a block in two only when that lowers what the split minimises (the costliest
# stage; with several stages per rank, the simulated training step) by more than this.
CUT_GAIN = 0.02


def _get(root: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return root.get_submodule(fqn)
    except AttributeError:
        return None


@dataclass(frozen=True, kw_only=True)
class ResolvedStack:
    name: str
    blocks: tuple[str, ...]  # block FQNs in order
    embed: tuple[str, ...]
    final: tuple[str, ...]
    every_stage: tuple[str, ...]
    halves: tuple[tuple[str, ...], ...] = ()  # the recipe's block halves (names relative to a block)
    cuttable: frozenset[str] = frozenset()  # blocks whose children the two halves cover exactly


@dataclass(frozen=True, kw_only=True)
class ResolvedRecipe:
    """A recipe with ``{base}`` filled in for one model class and every path checked to exist."""

    recipe: Recipe
    class_name: str
    base: str  # "model." / "transformer." / ""
    stacks: tuple[ResolvedStack, ...]
    head: HeadSpec  # with module paths resolved
    tied: tuple[tuple[str, ...], ...]  # groups of parameter FQNs that are one tensor in this model


def resolve_recipe(model: nn.Module, recipe: Recipe) -> ResolvedRecipe:
    """Fill in ``{base}`` for ``model``'s class and check every named module exists.

    Raises:
        RecipeError: naming the recipe file, the field and the missing module.
    """
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    class_name = type(model).__name__

    def fill(path: str, where: str) -> str:
        fqn = path.replace("{base}", base)
        if _get(model, fqn) is None:
            raise RecipeError(
                f"{recipe.source}: field {where!r} names module {fqn!r}, which {class_name} does not have. "
                f"Fix the path in the recipe (top-level children of {class_name}: {[n for n, _ in model.named_children()]})."
            )
        return fqn

    stacks = []
    for i, stack in enumerate(recipe.stacks):
        blocks_fqn = fill(stack.blocks, f"stacks[{i}].blocks")
        container = model.get_submodule(blocks_fqn)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
            raise RecipeError(
                f"{recipe.source}: field 'stacks[{i}].blocks' names {blocks_fqn!r}, which is a "
                f"{type(container).__name__}, not a non-empty ModuleList of blocks"
            )
        blocks = tuple(f"{blocks_fqn}.{name}" for name, _ in container.named_children())
        cuttable = frozenset()
        if stack.halves:
            wanted = set(stack.halves[0]) | set(stack.halves[1])
            cut = []
            for b in blocks:
                block = model.get_submodule(b)
                children = [n for n, _ in block.named_children()]
                missing = wanted - set(children)
                if missing:
                    raise RecipeError(
                        f"{recipe.source}: field 'stacks[{i}].halves' names {sorted(missing)}, which block {b!r} "
                        f"({type(block).__name__}) does not have; its children: {children}"
                    )
                # A block with children outside the halves (GPT-2 or BERT with cross-attention) stays whole.
                if set(children) == wanted:
                    cut.append(b)
            cuttable = frozenset(cut)
        stacks.append(
            ResolvedStack(
                name=stack.name,
                blocks=blocks,
                halves=stack.halves,
                cuttable=cuttable,
                embed=tuple(fill(p, f"stacks[{i}].embed") for p in stack.embed),
                final=tuple(fill(p, f"stacks[{i}].final") for p in stack.final),
                every_stage=tuple(fill(p, f"stacks[{i}].every_stage") for p in stack.every_stage),
            )
        )
    head = recipe.head_for(class_name, type(getattr(model, "base_model", model)).__name__)
    head = replace(head, modules=tuple(fill(p, f"heads.{head.suffix}.modules") for p in head.modules))
    # Tied groups: only the members this model has, and only where they really are one tensor
    # (LLaMA ties lm_head to the embedding only when config.tie_word_embeddings says so).
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    shared = [tuple(names) for names in by_id.values() if len(names) > 1]
    declared = [tuple(g.replace("{base}", base) for g in group) for group in recipe.tied]
    tied = []
    for names in shared:
        if not any(set(names) & set(group) for group in declared):
            raise RecipeError(
                f"{recipe.source}: parameters {list(names)} of {class_name} are one tensor, but field 'tied.groups' "
                f"does not declare them; add them to a tied group"
            )
        tied.append(names)
    return ResolvedRecipe(recipe=recipe, class_name=class_name, base=base, stacks=tuple(stacks), head=head, tied=tuple(tied))


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 0)


def _outside_blocks(resolved: ResolvedRecipe) -> set[str]:
    """The modules a stage may hold besides its blocks: embeddings, final modules, modules every stage runs, the head."""
    return {m for st in resolved.stacks for m in st.embed + st.final + st.every_stage} | set(resolved.head.modules)


def module_stats(model: nn.Module, fqns: Sequence[str], itemsize: int, seq_len: int, hidden: int, attention: int) -> tuple[int, int, float]:
    """(params, bytes, FLOPs per token) of the given modules, ``attention`` of them attention layers; shared tensors count once."""
    seen: set[int] = set()
    params = 0
    flops = 0.0
    for fqn in fqns:
        mod = model.get_submodule(fqn)
        for sub in mod.modules():
            lookup = isinstance(sub, nn.Embedding)
            for p in sub.parameters(recurse=False):
                # A tied embedding / LM head is one tensor: its bytes count once, but the LM head's
                # matmul costs compute while the embedding lookup does not.
                if not lookup and p.dim() >= 2:
                    flops += 2.0 * p.numel()
                if id(p) in seen:
                    continue
                seen.add(id(p))
                params += p.numel()
    flops += attention * 4.0 * seq_len * hidden  # attention scores and weighted sum: QK^T and AV, per layer
    return params, params * itemsize, flops


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
        def human(n: float) -> str:
            for unit in ("", "K", "M", "G", "T"):
                if abs(n) < 1000:
                    return f"{n:.3g}{unit}"
                n /= 1000
            return f"{n:.3g}P"

        head = (
            f"StagePlan: {self.model_class} ({self.model_type}), {self.num_stages} stages on {self.pp_size} "
            f"rank(s), {self.virtual_stages} per rank ({self.layout} layout), {str(self.dtype).removeprefix('torch.')}, "
            f"{human(self.total_params)} params / {human(self.total_bytes)}B"
        )
        rows = [("stage", "rank", "blocks", "params", "bytes", "GFLOP/tok", "other modules")]
        for s in self.stages:
            blocks = compress_blocks(s.blocks)
            if s.halves:
                blocks += " (" + ", ".join(f"{b.rpartition('.')[2]}: {'1st' if h == 0 else '2nd'} half" for b, h in s.halves) + ")"
            others = [m for m in s.modules if m not in s.blocks and not any(m.startswith(b + ".") for b in s.blocks)]
            rows.append(
                (str(s.index), str(s.rank), blocks, human(s.params), human(s.nbytes) + "B", f"{s.flops_per_token / 1e9:.3f}", ", ".join(others) or "-")
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = [head]
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


def _partition(costs: Sequence[float], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous non-empty groups minimising the largest group cost."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # best[k][i]: minimal max-cost splitting the first i items into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-9 * abs(v):
                    best[k][i] = v
                    cut[k][i] = j
    starts = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        starts.append(j)
        i = j
    return sorted(starts)


def _stage_costs(costs: Sequence[float], starts: Sequence[int]) -> list[float]:
    bounds = list(starts) + [len(costs)]
    return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


def _split_score(ranks: Sequence[int], schedule: ScheduleSpec, n_microbatches: int) -> Callable[[Sequence[float]], tuple[float, ...]]:
    """What ``split="auto"`` minimises when a rank holds several stages, given the stages' costs
    (smaller is better, compared in order): the simulated training step of ``schedule``
    (:func:`simulate_step`), then the busiest rank's total, then the costliest stage.

    The min-max split of the stages alone (right for one stage per rank, where every microbatch
    waits for the costliest stage) does not minimise the step here: its stages may all stay under
    the costliest one (the LM head's) while one rank holds the heavier ones, and a first stage
    lighter than the rest shortens the warm-up. On the benchmark's 12-layer model at 2 stages per
    rank the simulated step of interleaved 1F1B is 0.901 of perfect overlap with the min-max split,
    0.956 with this one.
    """
    pp_size = len(set(ranks))
    virtual = len(ranks) // pp_size

    def score(stage: Sequence[float]) -> tuple[float, ...]:
        total = float(sum(stage)) or 1.0
        step, busy = simulate_step(schedule, pp_size=pp_size, virtual_stages=virtual, n_microbatches=n_microbatches, stage_cost=stage)
        # relative and rounded: ties do not hang on float noise
        return round(step / total, 9), round(max(busy.values()) / total, 9), round(max(stage) / total, 9)

    return score


def _balance(costs: Sequence[float], parts: int, score: Callable[[Sequence[float]], tuple[float, ...]]) -> list[int]:
    """Start indices of ``parts`` contiguous non-empty groups of ``costs`` with the lowest ``score``.

    Starts from the min-max split (:func:`_partition`) and from the split at equal shares of the
    total; from each, boundaries move one or two units at a time (or two neighbouring boundaries
    together) while that lowers the score; the better end wins.
    """
    minmax = _partition(costs, parts)
    n, total = len(costs), float(sum(costs))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # Equal shares: group k starts where the running total first reaches k/parts of the whole.
    shares = [0] + [min(max(next(i for i in range(n + 1) if prefix[i] >= k * total / parts), k), n - parts + k) for k in range(1, parts)]
    shares = shares if all(b > a for a, b in zip(shares, shares[1:])) else minmax

    def key(starts: list[int]) -> tuple[float, ...]:
        return score(_stage_costs(costs, starts))

    def search(starts: list[int]) -> list[int]:
        best = key(starts)
        while True:
            moves = [
                starts[:k] + [starts[k] + d] + starts[k + 1:] for k in range(1, parts) for d in (-2, -1, 1, 2)
            ] + [  # two neighbouring boundaries together: a group keeps its units and moves
                starts[:k] + [starts[k] + d, starts[k + 1] + d] + starts[k + 2:] for k in range(1, parts - 1) for d in (-1, 1)
            ]
            scored = [(key(m), m) for m in moves if all(b > a for a, b in zip(m, m[1:])) and m[-1] < n]
            found = min(scored, default=None)
            if found is None or found[0] >= best:
                return starts
            best, starts = found

    return min((search(minmax), search(shares)), key=key)


@dataclass(frozen=True)
class _Unit:
    """What the partitioner places: a whole block (``half`` None) or one half of it (0, 1)."""

    stack: int
    block: str
    half: int | None


def _training_schedule(
    schedule: ScheduleSpec | str | None, *, layout: str, pp_size: int, virtual_stages: int, n_microbatches: int | None,
) -> tuple[ScheduleSpec, int]:
    """The schedule and microbatch count a split is balanced for: the given ones where they train
    these stages, else the layout's default schedule and one microbatch per stage (which always trains)."""
    spec = get_schedule(schedule) if schedule is not None else None
    if spec is None or spec.layout != layout or not spec.accepts_virtual(virtual_stages):
        spec = get_schedule(default_schedule(virtual_stages))
        if spec.layout != layout:
            spec = next(s for s in SCHEDULES.values() if s.layout == layout and s.accepts_virtual(virtual_stages))
    m = n_microbatches or pp_size * virtual_stages
    if spec.training_problem(pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=m) is not None:
        m = pp_size * virtual_stages
    return spec, m


def make_plan(
    model: nn.Module,
    recipe: Recipe | ResolvedRecipe,
    *,
    pp_size: int,
    virtual_stages: int = 1,
    layout: str = "loop",
    split: str | Sequence[str] = "auto",
    dtype: torch.dtype | None = None,
    seq_len: int = 256,
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
            named modules (the head and loss as measured on the device: :func:`hf_pipeline.tools.autotune.measure_split`).
    Returns:
        The :class:`StagePlan`.
    """
    resolved = recipe if isinstance(recipe, ResolvedRecipe) else resolve_recipe(model, recipe)
    if pp_size < 1 or virtual_stages < 1:
        raise PlanError(f"pp_size and virtual_stages must be >= 1 (got {pp_size}, {virtual_stages})")
    if layout == "v" and virtual_stages != 2:
        raise PlanError(f"the V layout places exactly 2 stages per rank; got virtual_stages={virtual_stages}")
    num_stages = pp_size * virtual_stages
    if dtype is None:
        dtype = next(model.parameters()).dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    config = getattr(model, "config", None)
    hidden = _hidden_size(model)

    # Units, in execution order across stacks: one per half of each block the recipe lets the
    # planner cut, one per other block. Embeddings go with the first unit of their stack, final
    # modules with its last, the head with the very last unit. A block whose two halves end up on
    # one stage is one whole unit again.
    units: list[_Unit] = []
    for si, st in enumerate(resolved.stacks):
        for b in st.blocks:
            units += [_Unit(si, b, 0), _Unit(si, b, 1)] if b in st.cuttable else [_Unit(si, b, None)]
    block_starts = [i for i, u in enumerate(units) if u.half != 1]  # unit indices where a block starts
    n_blocks = len(block_starts)

    def unit_modules(u: _Unit) -> list[str]:
        if u.half is None:
            return [u.block]
        return [f"{u.block}.{c}" for c in resolved.stacks[u.stack].halves[u.half]]

    def extra_modules(group: Sequence[_Unit], is_last: bool) -> list[str]:
        mods: list[str] = []
        for si, st in enumerate(resolved.stacks):
            mine = [u for u in group if u.stack == si]
            if not mine:
                continue
            if mine[0].block == st.blocks[0] and mine[0].half != 1:
                mods += st.embed
            owned = [m for u in mine for m in unit_modules(u)]
            mods += [m for m in st.every_stage if not any(m == o or m.startswith(o + ".") for o in owned)]
            if mine[-1].block == st.blocks[-1] and mine[-1].half != 0:
                mods += st.final
        if is_last:
            mods += resolved.head.modules
        return mods

    measured = dict(measured_flops or {})
    unknown = sorted(set(measured) - _outside_blocks(resolved))
    if unknown:
        raise PlanError(f"measured_flops names {unknown}, which are not embeddings, final modules or the head of {resolved.class_name}")

    def stats(group: Sequence[_Unit], is_last: bool) -> tuple[int, int, float]:
        mods = [m for u in group for m in unit_modules(u)] + extra_modules(group, is_last)
        attention = sum(1 for u in group if u.half != 1)  # the attention scores run in the first half
        params, nbytes, flops = module_stats(model, mods, itemsize, seq_len, hidden, attention)
        for m in mods:
            if m in measured:  # a measured cost replaces the module's FLOP count
                flops += measured[m] - module_stats(model, [m], itemsize, seq_len, hidden, 0)[2]
        return params, nbytes, flops

    def too_many(available: int, what: str) -> PlanError:
        return PlanError(
            f"{num_stages} stages requested ({pp_size} ranks x {virtual_stages} virtual stages) but "
            f"{resolved.class_name} has only {available} {what}; use fewer ranks or virtual_stages"
        )

    if isinstance(split, str):
        if split == "auto":
            costs = [stats([u], i == len(units) - 1)[2] for i, u in enumerate(units)]
            block_costs = [sum(costs[a:b]) for a, b in zip(block_starts, block_starts[1:] + [len(units)])]

            if virtual_stages == 1:  # every microbatch waits for the costliest stage: the min-max split
                score = lambda stage: (max(stage),)  # noqa: E731
                split_of = lambda cs: _partition(cs, num_stages)  # noqa: E731
            else:  # the split with the shortest simulated step of the training schedule
                score = _split_score([rank_of_stage(s, pp_size, layout) for s in range(num_stages)], *_training_schedule(
                    schedule, layout=layout, pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=n_microbatches))
                split_of = lambda cs: _balance(cs, num_stages, score)  # noqa: E731
            starts = None
            if num_stages <= n_blocks:
                whole = split_of(block_costs)
                starts = [block_starts[i] for i in whole]
                best = score(_stage_costs(block_costs, whole))[0]
            if len(units) > n_blocks:
                if num_stages > len(units):
                    raise too_many(len(units), "block halves")
                cut = split_of(costs)
                # Cut a block only where that makes the step clearly faster: a whole-block plan is
                # the simpler one to read, and equal cost is no reason to leave it.
                if starts is None or score(_stage_costs(costs, cut))[0] < (1.0 - CUT_GAIN) * best:
                    starts = cut
            if starts is None:
                raise too_many(n_blocks, "blocks")
        elif split == "uniform":
            if num_stages > n_blocks:
                raise too_many(n_blocks, "blocks")
            starts = [block_starts[round(k * n_blocks / num_stages)] for k in range(num_stages)]
        else:
            raise PlanError(f"split must be 'auto', 'uniform' or a list of block names, got {split!r}")
    else:
        names: dict[str, int] = {}
        for i, u in enumerate(units):
            if u.half != 1:
                names[u.block] = i
            else:
                names[unit_modules(u)[0]] = i  # the stage starts at this block's second half
        split = list(split)
        if len(split) != num_stages - 1:
            raise PlanError(
                f"split lists {len(split)} block(s) to start stages at, but {num_stages} stages need "
                f"{num_stages - 1}; blocks are {units[0].block} ... {units[-1].block}"
            )
        starts = [0]
        for fqn in split:
            if fqn not in names:
                halves = [n for n in names if n not in {u.block for u in units}]
                raise PlanError(
                    f"split point {fqn!r} is not a block of {resolved.class_name}; blocks are {units[0].block} ... "
                    f"{units[-1].block}" + (f"; a stage can also start at a block's second half ({halves[0]}, ...)" if halves else "")
                )
            starts.append(names[fqn])
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise PlanError(f"split points {split} must be distinct blocks in increasing order, none of them the first block")

    stages = []
    bounds = list(zip(starts, starts[1:] + [len(units)]))
    for s, (a, b) in enumerate(bounds):
        group: list[_Unit] = []
        for u in units[a:b]:
            if u.half == 1 and group and group[-1].block == u.block:
                group[-1] = _Unit(u.stack, u.block, None)  # both halves on this stage: the whole block
            else:
                group.append(u)
        is_last = s == num_stages - 1
        blocks = tuple(u.block for u in group)
        extras = extra_modules(group, is_last)
        params, nbytes, flops = stats(group, is_last)
        stages.append(
            StageSpec(
                index=s,
                rank=rank_of_stage(s, pp_size, layout),
                blocks=blocks,
                modules=tuple(dict.fromkeys(extras + [m for u in group for m in unit_modules(u)])),
                stacks=tuple(dict.fromkeys(resolved.stacks[u.stack].name for u in group)),
                params=params,
                nbytes=nbytes,
                flops_per_token=flops,
                is_first=s == 0,
                is_last=is_last,
                halves=tuple((u.block, u.half) for u in group if u.half is not None),
                start=unit_modules(group[0])[0] if group[0].half == 1 else group[0].block,
            )
        )
    total_params = sum(p.numel() for p in model.parameters())
    return StagePlan(
        model_class=resolved.class_name,
        model_type=str(getattr(config, "model_type", "")),
        pp_size=pp_size,
        virtual_stages=virtual_stages,
        layout=layout,
        dtype=dtype,
        stages=tuple(stages),
        total_params=total_params,
        total_bytes=total_params * itemsize,
        tied=resolved.tied,
    )


def stage_flops_parts(model: nn.Module, resolved: ResolvedRecipe, spec: StageSpec, *, seq_len: int) -> tuple[float, dict[str, float]]:
    """A stage's FLOPs per token in two parts: its blocks (or block halves), and each other module it
    holds (embeddings, final modules, the head, modules every stage runs), by name."""
    extra = _outside_blocks(resolved)
    hidden = _hidden_size(model)
    attention = len(spec.attention_blocks)  # as make_plan counts them: a second half runs no attention
    blocks = [m for m in spec.modules if m not in extra]
    return (
        module_stats(model, blocks, 1, seq_len, hidden, attention)[2],
        {m: module_stats(model, [m], 1, seq_len, hidden, 0)[2] for m in spec.modules if m in extra},
    )


# ----------------------------------------------------------------------------- parameter layout
@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """Where every checkpoint key of the model lives, computed from the plan alone (same on every rank).

    Attributes:
        key_of: every state-dict name of the model (tied aliases included) -> its checkpoint key,
            the one name transformers' ``save_pretrained`` writes for that tensor.
        holders: checkpoint key -> indices of the stages holding it, ascending (two or more for
            tied weights split across stages and for replicas such as T5's relative bias).
        stage_rank: stage index -> pipeline rank.
        saved: the keys ``save_pretrained`` of the unsplit model writes.
        parameters: the checkpoint keys that are parameters (the rest are persistent buffers).
    """

    key_of: dict[str, str]
    holders: dict[str, tuple[int, ...]]
    stage_rank: tuple[int, ...]
    saved: frozenset[str]
    parameters: frozenset[str]

    def owner_stage(self, key: str) -> int:
        """The stage that writes ``key`` to a checkpoint and counts it in the gradient norm: its first holder."""
        return self.holders[key][0]

    def pp_ranks(self, key: str) -> tuple[int, ...]:
        """Pipeline ranks holding ``key``, ascending."""
        return tuple(sorted({self.stage_rank[s] for s in self.holders[key]}))

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """Keys held by more than one stage -> their holders."""
        return {k: h for k, h in self.holders.items() if len(h) > 1}


def _hf_saved_keys(skeleton: nn.Module) -> set[str]:
    # Exactly what transformers' save_pretrained keeps: its own tie removal (which works on the
    # meta-device skeleton, tied tensors being the same Parameter object), minus ignored keys.
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    kept = set(remove_tied_weights_from_state_dict(dict(skeleton.state_dict()), skeleton))
    for key in getattr(skeleton, "_keys_to_ignore_on_save", None) or ():
        kept.discard(key)
    return kept


def param_layout(skeleton: nn.Module, plan: "StagePlan", tied: Sequence[Sequence[str]]) -> ParamLayout:
    """Where every checkpoint key of ``skeleton`` lives under ``plan`` (``tied``: groups of names of one tensor).

    Training (gradient sync of tied and replicated tensors, the global norm) and checkpoints (who
    writes which key) read it; it depends on the plan alone, so it is the same on every rank.
    """
    state_names = list(skeleton.state_dict(keep_vars=True).keys())
    saved = _hf_saved_keys(skeleton)
    key_of = {name: name for name in state_names}
    for group in tied:
        kept = sorted(n for n in group if n in saved)
        key = kept[0] if kept else sorted(group)[0]
        for name in group:
            key_of[name] = key
    holders: dict[str, set[int]] = {}
    for name in state_names:
        module = name.rpartition(".")[0]
        for spec in plan.stages:
            if any(module == m or module.startswith(m + ".") for m in spec.modules):
                holders.setdefault(key_of[name], set()).add(spec.index)
    param_names = {n for n, _ in skeleton.named_parameters(remove_duplicate=False)}
    return ParamLayout(
        key_of=key_of,
        holders={k: tuple(sorted(v)) for k, v in sorted(holders.items())},
        stage_rank=tuple(s.rank for s in plan.stages),
        saved=frozenset(saved),
        parameters=frozenset(key_of[n] for n in param_names),
    )
