"""A shape-static stand-in for a mixture of experts' experts, so the memory planner's fake-tensor run can
price them.

transformers' experts modules pick each expert's tokens with ``nonzero`` (``torch.where`` on the routing
mask): shapes that depend on the data, which a fake tensor cannot know. While the planner runs a stage,
:func:`static_experts` makes every experts module compute a fixed number of token-expert pairs
(:func:`~hf_pipeline.planning.moe_costs.routed_rows`: ``"worst"``, an upper bound, or ``"balanced"``) of the
tokens its expert-parallel group routes (the rank's own, or with experts over ``group`` data-parallel replicas,
``ep_over="data"``, those replicas' rows: ``group`` x its own), spread evenly over the experts the rank holds,
with the ops of transformers' eager loop batched over those experts::

    x[rows]                 (E_l, n, H)   gathered tokens, saved (and the pair's token index)
    bmm(., gate_up)         (E_l, n, 2I)  saved by the gate
    gate(.)                 (E_l, n, I)   the module's own activation (``_apply_gate``), its saved tensors
    bmm(., down)            (E_l, n, H)   its input saved; its output saved by the routing-weight product
    index_add(rows, .)      (T, H)        the token index saved

What autograd keeps for backward is then what the eager loop keeps for the same pairs (the sum over
experts of the same tensors), up to a few index tensors. The router, shared experts and everything else
run as they are. A post-expert norm (``has_post_expert_norm``) is not modelled.

Example:
    >>> with static_experts(stages, config, routing="worst"):
    ...     nbytes, out = measure_saved_bytes(lambda: stage(**inputs), params)
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator, Sequence

import torch
from torch import nn

from ..compat import experts_gate
from ..errors import InputError
from ..planning.ep_plan import num_experts
from ..planning.moe_costs import experts_modules, experts_per_token, routed_rows

__all__ = ["static_experts"]


def _static_forward(module: nn.Module, top_k: int, experts: int, routing: str, group: int, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The experts' forward on a fixed number of token-expert pairs (module docstring)."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])  # (T, H)
    gate_up = module.gate_up_proj if module.has_gate else module.up_proj
    local = gate_up.shape[0]  # the experts this rank holds (E / ep_size)
    pairs = routed_rows(x.shape[0] * group, top_k=top_k, experts=experts, local_experts=local, routing=routing)
    per_expert = math.ceil(pairs / local)
    rows = torch.arange(local * per_expert, device=x.device) % x.shape[0]  # (E_l * n,) each pair's token
    picked = x[rows].view(local, per_expert, -1)  # (E_l, n, H)
    h = torch.bmm(picked, gate_up if module.is_transposed else gate_up.transpose(1, 2))  # (E_l, n, 2I)
    if module.has_bias:
        h = h + getattr(module, "gate_up_proj_bias" if module.has_gate else "up_proj_bias")[:, None, :]
    h = experts_gate(module, h) if module.has_gate else module.act_fn(h)  # (E_l, n, I)
    out = torch.bmm(h, module.down_proj if module.is_transposed else module.down_proj.transpose(1, 2))  # (E_l, n, H)
    if module.has_bias:
        out = out + module.down_proj_bias[:, None, :]
    weights = top_k_weights.reshape(-1)[rows % top_k_weights.numel()]  # (E_l * n,) a routing weight per pair
    out = out.reshape(-1, x.shape[-1]) * weights[:, None].to(out.dtype)  # (E_l * n, H)
    return torch.zeros_like(x).index_add(0, rows, out.to(x.dtype)).view(shape)  # (..., H)


@contextlib.contextmanager
def static_experts(stages: Sequence[nn.Module], config, *, routing: str = "worst", group: int = 1) -> Iterator[int]:
    """While inside, every experts module of ``stages`` (the planner's own copies) runs the stand-in on the tokens
    of ``group`` data-parallel replicas (1: the rank's own; ``PipelineOptions.ep_data``); yields how many it replaced
    (0 for a dense model).

    Raises:
        InputError: an experts module the config's ``base_model_ep_plan`` does not name, or no
            ``num_experts_per_tok``: its routing cannot be priced.
    """
    experts = num_experts(config)
    if experts is None:
        yield 0
        return
    top_k = experts_per_token(config)
    found = [(s, name) for s in stages for name in experts_modules(config, [n for n, _ in s.named_modules()])]
    # transformers names its experts classes "...Experts"; one the plan does not name would route on the fake run
    unnamed = sorted({f"{n} ({type(m).__name__})" for s in stages for n, m in s.named_modules()
                      if type(m).__name__.endswith("Experts") and (s, n) not in found})
    if unnamed or (found and top_k is None):
        raise InputError(
            f"{getattr(config, 'model_type', type(config).__name__)}: the memory planner prices a mixture of "
            "experts through the experts modules its config's base_model_ep_plan names ('ep_dispatch_experts') "
            f"and its num_experts_per_tok, and this config lacks "
            f"{f'a plan entry for {unnamed[0]}' if unnamed else 'num_experts_per_tok'}; name schedule, "
            "n_microbatches and split instead of 'auto', and load without max_memory"
        )
    modules = [s.get_submodule(name) for s, name in found]
    for m in modules:  # an instance attribute on the planner's throwaway copy, removed below
        m.forward = functools.partial(_static_forward, m, top_k, experts, routing, group)
    try:
        yield len(modules)
    finally:
        for m in modules:
            del m.forward
