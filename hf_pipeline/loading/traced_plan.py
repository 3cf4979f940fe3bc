"""How the tracer front end plans a model it has no recipe for: blocks, costing, stage contents.

The repeated blocks are found from the module tree alone (:func:`find_blocks`), the stage plan is
made from a recipe-shaped description of the model (:func:`costing_recipe`), and after the load-time
trace each stage's spec is rewritten to what the traced stage really holds (:func:`traced_spec`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from torch import nn

from ..errors import TraceError
from ..families.recipe import HeadSpec, Recipe, StackSpec
from ..planning.plan import StageSpec
from ..planning.resolve import ResolvedRecipe, ResolvedStack, module_stats

__all__ = ["RECIPE_HOWTO", "costing_recipe", "find_blocks", "split_fqn", "tied_groups", "traced_spec"]

_LOSSES = {
    "ForCausalLM": "causal_lm",
    "ForMaskedLM": "masked_lm",
    "ForSequenceClassification": "sequence_classification",
    "ForTokenClassification": "token_classification",
    "ForQuestionAnswering": "question_answering",
    "ForConditionalGeneration": "seq2seq_lm",
}

RECIPE_HOWTO = (
    "load it with split_method='auto' if its model_type is one model_recipes/decoder.toml claims; a standard "
    "transformers decoder (a base model holding a ModuleList of config.num_hidden_layers layers) not listed there "
    "needs only a copy of decoder.toml naming its model_type, registered with hf_pipeline.register_recipe(path) "
    "(each stage then runs the model class's own forward); another layout needs a recipe like "
    "model_recipes/llama.toml and its glue in hf_pipeline/families/glue/"
)


def find_blocks(model: nn.Module) -> str:
    """FQN of the model's repeated blocks: its largest ``nn.ModuleList`` of same-class modules.

    "Largest" is by parameter count (a model may hold several lists: T5 has an encoder and a
    decoder stack, some models keep small lists of heads or norms).

    Example:
        >>> find_blocks(meta_model(opt_config, "AutoModelForCausalLM"))
        'model.decoder.layers'
    """
    best: tuple[int, str] | None = None
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(child) for child in mod}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size and (best is None or size > best[0]):
            best = (size, fqn)
    if best is None:
        raise TraceError(
            f"{type(model).__name__} has no nn.ModuleList of same-class blocks with parameters, so there is nothing "
            f"to cut between pipeline stages; {RECIPE_HOWTO}"
        )
    return best[1]


def tied_groups(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The names of each parameter the model holds under several names (tied embeddings)."""
    # Parameters that are one tensor in the model (tied embeddings): the loader reads any member's
    # checkpoint key for all of them, and a stage holding several makes them one Parameter again.
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return tuple(tuple(names) for names in by_id.values() if len(names) > 1)


def costing_recipe(model: nn.Module, blocks_fqn: str) -> ResolvedRecipe:
    """A recipe-shaped description of ``model`` from its module tree, for the stage plan.

    Modules registered before the block list are costed to the first block, those after it to the
    last (HF models register their modules in execution order). This only balances the split: what
    each stage really holds comes from the trace (:func:`traced_spec`).
    """
    container = model.get_submodule(blocks_fqn)
    blocks = tuple(f"{blocks_fqn}.{name}" for name, _ in container.named_children())
    before: list[str] = []
    after: list[str] = []
    seen_blocks = False
    for fqn, mod in model.named_modules():
        if fqn == blocks_fqn:
            seen_blocks = True
            continue
        if fqn.startswith(blocks_fqn + ".") or not any(True for _ in mod.parameters(recurse=False)):
            continue
        (after if seen_blocks else before).append(fqn)
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    class_name = type(model).__name__
    suffix = (
        getattr(model, "loss_type", None)
        or (re.search(r"For\w+$", class_name) or re.search(r"Model$", class_name) or [class_name])[0]
    )
    head = HeadSpec(
        suffix=suffix,
        modules=(),
        outputs=(),
        output_class="",
        loss=_LOSSES.get(getattr(model, "loss_type", None) or ""),
    )
    tied = tied_groups(model)
    config = model.config
    recipe = Recipe(
        source=f"<torch.export trace of {class_name}>",
        model_types=(str(getattr(config, "model_type", "")),),
        glue="",
        flows=(),
        stacks=(StackSpec(name="blocks", blocks=blocks_fqn),),
        heads={suffix: head},
        tied=tied,
    )
    stack = ResolvedStack(name="blocks", blocks=blocks, embed=tuple(before), final=tuple(after), every_stage=())
    return ResolvedRecipe(recipe=recipe, class_name=class_name, base=base, stacks=(stack,), head=head, tied=tied)


def split_fqn(name: str) -> tuple[str, str]:
    """``("a.b", "weight")`` for ``"a.b.weight"``: the owning module's name and the attribute."""
    owner, _, attr = name.rpartition(".")
    return owner, attr


def traced_spec(
    model: nn.Module, spec: StageSpec, state: Sequence[str], blocks: Sequence[str], itemsize: int, seq_len: int = 256
) -> StageSpec:
    """``spec`` with ``modules``, sizes and FLOPs of what the traced stage really holds."""
    # Name each held tensor by the shallowest module the stage holds entirely (a block, an
    # embedding, T5's whole encoder), as a recipe's module list does.
    held = set(state)
    under: dict[str, set[str]] = {}
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + [
        n for n, _ in model.named_buffers(remove_duplicate=False)
    ]
    for n in names:
        parts = n.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            under.setdefault(".".join(parts[:i]), set()).add(n)
    known = set(names)
    # A tied tensor is held under all its names (BERT's word embeddings are also the MLM decoder's
    # weight). An alias whose module the stage holds only in part (the decoder without its bias) is
    # not named: a module in ``modules`` claims every tensor under it, and claiming the decoder's
    # bias on this stage would make the gradient sync of this rank and the bias' real holders
    # disagree on which tensors they reduce.
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for n, t in tensors.items():
        aliases.setdefault(id(t), []).append(n)

    def whole(name: str) -> bool:
        owner, _ = split_fqn(name)
        return any(owner == b or owner.startswith(b + ".") for b in blocks) or under.get(owner, {name}) <= held

    modules: dict[str, None] = {}
    for name in state:
        if (
            name in known
            and not whole(name)
            and any(a != name and a in held and whole(a) for a in aliases[id(tensors[name])])
        ):
            continue  # held, and named, through another alias
        owner, _ = split_fqn(name)
        if name not in known:
            continue  # a constant the trace lifted: it lives in the graph only
        if not owner:
            modules[""] = None  # a tensor of the root module itself
            continue
        block = next((b for b in blocks if owner == b or owner.startswith(b + ".")), None)
        if block is not None and block not in spec.blocks:
            raise TraceError(f"the trace put {name!r} on stage {spec.index}, which does not run {block}")
        if block is not None:
            modules[block] = None
            continue
        parts = owner.split(".")
        modules[
            next((a for a in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if under[a] <= held), owner)
        ] = None
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    mods = tuple(sorted(modules, key=lambda m: order.get(m, len(order))))
    lookup = dict(model.named_parameters(remove_duplicate=False))
    distinct = {id(lookup[n]): lookup[n] for n in state if n in lookup}  # a tied tensor counts once
    nparams = sum(t.numel() for t in distinct.values())
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 0)
    _, _, f_blocks = module_stats(model, list(spec.blocks), itemsize, seq_len, hidden, len(spec.blocks))
    others = [m for m in mods if m and m not in spec.blocks]
    _, _, f_other = module_stats(model, others, itemsize, seq_len, hidden, 0)
    return dataclasses.replace(
        spec, modules=mods, params=nparams, nbytes=nparams * itemsize, flops_per_token=f_blocks + f_other
    )
