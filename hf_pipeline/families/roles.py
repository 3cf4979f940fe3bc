"""The module roles of a standard transformers decoder, found on the model itself.

transformers 5 builds most causal LMs one way: a base model holding an input embedding, a
``ModuleList`` of ``config.num_hidden_layers`` decoder layers, a final norm and modules without
weights (the rotary embedding), under a head class that adds the LM head (or a score head). The
generic decoder recipe (``model_recipes/decoder.toml``) names these roles instead of module paths;
:func:`decoder_roles` finds them on one model class so the recipe needs no per-family names:

* ``{blocks}``: the base model's ``ModuleList`` of ``num_hidden_layers`` blocks (or its decoder's:
  OPTModel keeps them in ``decoder``, whose forward then runs them);
* ``{before}`` / ``{after}``: the weighted children of the module holding the blocks that its
  ``forward`` uses before / after the blocks (read from the forward's source: embeddings and an
  embedding norm before, the final norm after); the first stage / last stage holds them;
* ``{unweighted}``: its children without weights (rotary embeddings, dropout), which
  every stage runs;
* ``{head}``: the head class's children other than its base model (``lm_head``, ``score``).

Example:
    >>> roles = decoder_roles(meta_model(Qwen3Config(...), "AutoModelForCausalLM"))
    >>> roles.paths("{blocks}"), roles.paths("{after}")
    (('model.layers',), ('model.norm',))
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn

from ..errors import RecipeError

__all__ = ["ROLES", "DecoderRoles", "decoder_roles"]

# The placeholders a roles recipe may use in its module paths.
ROLES = ("{blocks}", "{before}", "{after}", "{unweighted}", "{head}")


@dataclass(frozen=True, kw_only=True)
class DecoderRoles:
    """The module paths of each role in one model class (see the module docstring)."""

    base: str  # "model." in a head class, "" in the base model class itself
    blocks: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    unweighted: tuple[str, ...]
    head: tuple[str, ...]

    def paths(self, role: str) -> tuple[str, ...]:
        """The module paths a role placeholder (one of :data:`ROLES`) stands for."""
        if role == "{blocks}":
            return (self.blocks,)
        return getattr(self, role.strip("{}"))


def _weighted(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _holder(base_model: nn.Module, layers: int) -> tuple[str, list[str]]:
    """The path (relative to the base model, "" or "decoder.") of the module holding the layer list,
    and the names of its ModuleLists of ``layers`` blocks: the base model itself, else the first
    descendant holding one (OPTModel keeps its layers in OPTDecoder)."""
    for path, module in base_model.named_modules():
        stacks = [n for n, c in module.named_children() if isinstance(c, nn.ModuleList) and len(c) == layers]
        if stacks:
            return (path + "." if path else ""), stacks
    return "", []


def _forward_order(holder: nn.Module, names: list[str]) -> dict[str, float]:
    """Where each child is first used in the holder's own ``forward`` (its source), as a sort key.

    The forward's order, not the registration order: OPTDecoder registers its final norm before its
    layers and runs it after them. A child the source never names keeps its registration place.
    """
    try:
        source = inspect.getsource(inspect.unwrap(type(holder).forward))
    except (OSError, TypeError):
        source = ""
    order: dict[str, float] = {}
    place = -1.0
    for name in names:
        found = re.search(rf"self\.{re.escape(name)}\b", source)
        place = float(found.start()) if found else place + 1e-3  # unnamed: just after the child before it
        order[name] = place
    return order


def decoder_roles(model: nn.Module) -> DecoderRoles:
    """Find the roles of ``model``'s modules (a transformers decoder, usually on the meta device).

    Raises:
        RecipeError: naming the class when its base model has no ``ModuleList`` of
            ``config.num_hidden_layers`` blocks (it is not laid out as a standard decoder).
    """
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    base_model = inner if isinstance(inner, nn.Module) else model
    base = f"{prefix}." if base_model is not model else ""
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    inside, stacks = _holder(base_model, layers)
    holder = base_model.get_submodule(inside.rstrip(".")) if inside else base_model
    children = list(holder.named_children())
    if len(stacks) != 1:
        raise RecipeError(
            f"{type(base_model).__name__} is not laid out as a standard decoder: the generic decoder recipe needs "
            f"exactly one ModuleList of config.num_hidden_layers={layers} blocks, found {stacks} among the children "
            f"{[n for n, _ in children]}; load with split_method='trace'"
        )
    order = _forward_order(holder, [n for n, _ in children])
    at = order[stacks[0]]
    others = [(order[n], n, c) for n, c in children if n != stacks[0]]
    path = base + inside
    return DecoderRoles(
        base=base,
        blocks=path + stacks[0],
        before=tuple(path + n for i, n, c in others if i < at and _weighted(c)),
        after=tuple(path + n for i, n, c in others if i > at and _weighted(c)),
        unweighted=tuple(path + n for _, n, c in others if not _weighted(c)),
        head=tuple(n for n, c in model.named_children() if c is not base_model) if base else (),
    )
