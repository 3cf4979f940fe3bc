"""What a mixture of experts costs a stage: the routed share of its experts' compute, and the tokens one
rank's experts take, from the config (no routing is run).

A token runs through ``top_k`` of an MoE layer's ``E`` routed experts (``config.num_experts_per_tok``),
plus its shared experts and the router, which are ordinary modules. So per token an experts module
costs ``top_k / E`` of the FLOPs its parameters would in a dense layer (:func:`routed_shares`, which the
splitter weighs it by, ``plan.py``), while its parameters are all held (``E / ep_size`` of them on each
of a stage's expert-parallel ranks).

Which experts a token picks depends on the data, so the memory planner does not run the routing: it
gives each experts module a fixed number of token-expert pairs (:func:`routed_rows`):

* ``"worst"`` (the default, an upper bound): every token's ``top_k`` experts are this rank's as far as it
  holds that many, ``tokens x min(top_k, E / ep_size)`` pairs. Without expert parallelism every routing
  gives exactly ``tokens x top_k`` pairs, so the bound is the count.
* ``"balanced"``: the router spreads tokens evenly, ``tokens x top_k / ep_size`` pairs on each rank (what
  load-balancing losses aim at; a skewed batch goes above it).

The experts modules are the ones the config's ``base_model_ep_plan`` names ``"ep_dispatch_experts"``
(transformers' own list of where tokens are dispatched to experts).

Example:
    >>> routed_shares(meta_model)     # experts module -> share of its parameters a token runs through
    {'model.layers.0.mlp.experts': 0.25, ...}
    >>> routed_rows(4096, top_k=8, experts=256, local_experts=32, routing="balanced")
    4096
"""

from __future__ import annotations

import math

from torch import nn

from ..errors import InputError
from .ep_plan import num_experts
from .mesh_rules import match_plan

__all__ = ["ROUTINGS", "experts_modules", "experts_per_token", "routed_rows", "routed_shares"]

# How the planner counts the tokens an experts module computes (module docstring).
ROUTINGS = ("worst", "balanced")
# Config fields giving the routed experts each token runs through.
_TOP_K_FIELDS = ("num_experts_per_tok",)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def experts_per_token(config) -> int | None:
    """The routed experts each token runs through (None: not a mixture of experts)."""
    text = _text_config(config)
    for name in _TOP_K_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def experts_modules(config, names) -> tuple[str, ...]:
    """Those of ``names`` (module names) that are experts modules: the config's ``base_model_ep_plan``
    names them ``"ep_dispatch_experts"``."""
    plan = getattr(_text_config(config), "base_model_ep_plan", None) or {}
    dispatch = tuple((k, v) for k, v in plan.items() if v == "ep_dispatch_experts")
    return tuple(match_plan(names, dispatch)) if dispatch else ()


def routed_shares(model: nn.Module) -> dict[str, float]:
    """Experts module name -> the share of its parameters one token runs through (``top_k / E``); empty for
    a dense model, and for a mixture of experts whose config names no experts module or no
    ``num_experts_per_tok`` (its experts then count whole, as any module)."""
    config = getattr(model, "config", None)
    experts = num_experts(config) if config is not None else None
    top_k = experts_per_token(config) if experts is not None else None
    if top_k is None:
        return {}
    names = experts_modules(config, [n for n, _ in model.named_modules()])
    return {name: min(1.0, top_k / experts) for name in names}


def routed_rows(tokens: int, *, top_k: int, experts: int, local_experts: int, routing: str = "worst") -> int:
    """Token-expert pairs one rank's ``local_experts`` (of ``experts``) compute for ``tokens`` tokens.

    Raises:
        InputError: an unknown ``routing``.
    """
    if routing not in ROUTINGS:
        raise InputError(f"moe routing must be one of {list(ROUTINGS)}, got {routing!r}")
    if routing == "worst":
        return tokens * min(top_k, local_experts)
    return math.ceil(tokens * top_k * local_experts / experts)
