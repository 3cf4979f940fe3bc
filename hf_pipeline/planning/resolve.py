"""Resolving a recipe on one model class, and the cost of its modules.

A :class:`~hf_pipeline.families.recipe.Recipe` names module paths with a ``{base}`` placeholder
(``"{base}layers"``). :func:`resolve_recipe` fills it in for one model class (``model.`` for
``LlamaForCausalLM``, nothing for ``LlamaModel``), checks every named module exists on the
(meta-device) model, finds the blocks that can be cut in two halves and the parameters that are
one tensor. :func:`module_stats` costs modules: parameters, bytes and FLOPs per token.

Example:
    >>> resolved = resolve_recipe(meta_model, get_recipe("llama"))
    >>> resolved.stacks[0].blocks[:2]
    ('model.layers.0', 'model.layers.1')
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from torch import nn

from ..families.recipe import HeadSpec, Recipe, RecipeError, StackSpec
from ..families.roles import ROLES, decoder_roles

__all__ = [
    "COST_SEQ_LEN", "ResolvedRecipe", "ResolvedStack", "attention_flops", "hidden_size", "module_stats",
    "outside_blocks", "resolve_recipe",
]

# The sequence length the splitter costs attention at (its scores grow with the length; the matmuls do not).
COST_SEQ_LEN = 256


@dataclass(frozen=True, kw_only=True)
class ResolvedStack:
    name: str
    blocks: tuple[str, ...]  # block FQNs in order
    embed: tuple[str, ...]
    final: tuple[str, ...]
    every_stage: tuple[str, ...]
    halves: tuple[tuple[str, ...], ...] = ()  # the recipe's block halves (names relative to a block)
    cuttable: frozenset[str] = frozenset()  # blocks whose children the two halves cover exactly

    @property
    def block_list(self) -> str:
        """The FQN of the blocks' ModuleList (``model.layers``)."""
        return self.blocks[0].rpartition(".")[0]

    @property
    def holder(self) -> str:
        """The FQN of the module holding the block list, whose forward runs it (``model``; "" for the root)."""
        return self.block_list.rpartition(".")[0]


@dataclass(frozen=True, kw_only=True)
class ResolvedRecipe:
    """A recipe with ``{base}`` filled in for one model class and every path checked to exist."""

    recipe: Recipe
    class_name: str
    base: str  # "model." / "transformer." / ""
    stacks: tuple[ResolvedStack, ...]
    head: HeadSpec  # with module paths resolved
    tied: tuple[tuple[str, ...], ...]  # groups of parameter FQNs that are one tensor in this model


def _get(root: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return root.get_submodule(fqn)
    except AttributeError:
        return None


class _PathFiller:
    """Fills ``{base}`` (or a role) into a recipe's module paths for one model and checks each names a module."""

    def __init__(self, model: nn.Module, recipe: Recipe, base: str):
        self.model, self.recipe, self.base = model, recipe, base
        self.class_name = type(model).__name__
        self.roles = decoder_roles(model) if recipe.roles else None

    def many(self, paths: Sequence[str], where: str) -> tuple[str, ...]:
        """Each path filled in; a role stands for the zero or more modules it finds on this model."""
        out: list[str] = []
        for path in paths:
            out.extend(self.roles.paths(path) if self.roles is not None and path in ROLES else (self(path, where),))
        return tuple(out)

    def __call__(self, path: str, where: str) -> str:
        fqn = path.replace("{base}", self.base)
        if _get(self.model, fqn) is None:
            children = [n for n, _ in self.model.named_children()]
            raise RecipeError(
                f"{self.recipe.source}: field {where!r} names module {fqn!r}, which {self.class_name} does not have. "
                f"Fix the path in the recipe (top-level children of {self.class_name}: {children})."
            )
        return fqn


def _cuttable_blocks(
    model: nn.Module, recipe: Recipe, index: int, stack: StackSpec, blocks: Sequence[str]
) -> frozenset[str]:
    """The blocks of a stack whose children the recipe's two halves cover exactly."""
    if not stack.halves:
        return frozenset()
    wanted = set(stack.halves[0]) | set(stack.halves[1])
    cut = []
    for b in blocks:
        block = model.get_submodule(b)
        children = [n for n, _ in block.named_children()]
        missing = wanted - set(children)
        if missing:
            raise RecipeError(
                f"{recipe.source}: field 'stacks[{index}].halves' names {sorted(missing)}, which block {b!r} "
                f"({type(block).__name__}) does not have; its children: {children}"
            )
        # A block with children outside the halves (GPT-2 or BERT with cross-attention) stays whole.
        if set(children) == wanted:
            cut.append(b)
    return frozenset(cut)


def _resolve_stack(model: nn.Module, recipe: Recipe, index: int, stack: StackSpec, fill: _PathFiller) -> ResolvedStack:
    where = f"stacks[{index}]"
    (blocks_fqn,) = fill.many((stack.blocks,), f"{where}.blocks")
    container = model.get_submodule(blocks_fqn)
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
        raise RecipeError(
            f"{recipe.source}: field '{where}.blocks' names {blocks_fqn!r}, which is a "
            f"{type(container).__name__}, not a non-empty ModuleList of blocks"
        )
    blocks = tuple(f"{blocks_fqn}.{name}" for name, _ in container.named_children())
    return ResolvedStack(
        name=stack.name,
        blocks=blocks,
        halves=stack.halves,
        cuttable=_cuttable_blocks(model, recipe, index, stack, blocks),
        embed=fill.many(stack.embed, f"{where}.embed"),
        final=fill.many(stack.final, f"{where}.final"),
        every_stage=fill.many(stack.every_stage, f"{where}.every_stage"),
    )


def _tied_groups(model: nn.Module, recipe: Recipe, base: str) -> tuple[tuple[str, ...], ...]:
    # Tied groups: only the members this model has, and only where they really are one tensor
    # (LLaMA ties lm_head to the embedding only when config.tie_word_embeddings says so).
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    shared = [tuple(names) for names in by_id.values() if len(names) > 1]
    declared = [tuple(g.replace("{base}", base) for g in group) for group in recipe.tied]
    tied = []
    for names in shared:
        # A roles recipe names no parameters: what transformers' own tie_weights made one tensor is tied.
        if not recipe.roles and not any(set(names) & set(group) for group in declared):
            raise RecipeError(
                f"{recipe.source}: parameters {list(names)} of {type(model).__name__} are one tensor, but field "
                f"'tied.groups' does not declare them; add them to a tied group"
            )
        tied.append(names)
    return tuple(tied)


def resolve_recipe(model: nn.Module, recipe: Recipe) -> ResolvedRecipe:
    """Fill in ``{base}`` for ``model``'s class and check every named module exists.

    Args:
        model: the HF model, usually on the meta device.
        recipe: its family's recipe.
    Returns:
        The :class:`ResolvedRecipe`.
    Raises:
        RecipeError: naming the recipe file, the field and the missing module.
    """
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    class_name = type(model).__name__
    fill = _PathFiller(model, recipe, base)
    stacks = tuple(_resolve_stack(model, recipe, i, stack, fill) for i, stack in enumerate(recipe.stacks))
    head = recipe.head_for(class_name, type(getattr(model, "base_model", model)).__name__)
    head = replace(head, modules=fill.many(head.modules, f"heads.{head.suffix}.modules"))
    return ResolvedRecipe(
        recipe=recipe,
        class_name=class_name,
        base=base,
        stacks=stacks,
        head=head,
        tied=_tied_groups(model, recipe, base),
    )


def hidden_size(model: nn.Module) -> int:
    """The model's hidden size (``hidden_size`` or T5's ``d_model``; 0 when its config has neither)."""
    config = getattr(model, "config", None)
    return int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 0)


def outside_blocks(resolved: ResolvedRecipe) -> set[str]:
    """The modules a stage may hold besides its blocks: embeddings, final modules, modules every
    stage runs, the head."""
    return {m for st in resolved.stacks for m in st.embed + st.final + st.every_stage} | set(resolved.head.modules)


def module_stats(
    model: nn.Module, fqns: Sequence[str], itemsize: int, seq_len: int, hidden: int, attention: int,
    shares: Mapping[str, float] | None = None,
) -> tuple[int, int, float]:
    """(params, bytes, FLOPs per token) of the given modules, ``attention`` of them attention layers.

    Shared tensors count once. ``shares``: module name -> the share of its parameters a token runs
    through (a mixture of experts' experts module: ``top_k / E``, :func:`~.moe_costs.routed_shares`);
    its FLOPs count that share, its parameters all of them.
    """
    seen: set[int] = set()
    params = 0
    flops = 0.0
    shares = shares or {}
    for fqn in fqns:
        mod = model.get_submodule(fqn)
        for sub_name, sub in mod.named_modules():
            lookup = isinstance(sub, nn.Embedding)
            share = shares.get(f"{fqn}.{sub_name}" if sub_name else fqn, 1.0)
            for p in sub.parameters(recurse=False):
                # A tied embedding / LM head is one tensor: its bytes count once, but the LM head's
                # matmul costs compute while the embedding lookup does not.
                if not lookup and p.dim() >= 2:
                    flops += 2.0 * p.numel() * share
                if id(p) in seen:
                    continue
                seen.add(id(p))
                params += p.numel()
    flops += attention_flops(attention, seq_len, hidden)
    return params, params * itemsize, flops


def attention_flops(attention: int, seq_len: int, hidden: int) -> float:
    """FLOPs per token of ``attention`` layers' scores and weighted sum (QK^T and AV), beyond their projections."""
    return attention * 4.0 * seq_len * hidden
