"""The routers' load-balancing loss of a mixture of experts (``config.output_router_logits=True``), split.

transformers adds ``router_aux_loss_coef x aux`` to the training loss, where (``load_balancing_loss_func``,
the same function in every MoE decoder family that has one)

    aux = E * sum_e (T_e / R) * (P_e / R)

over every MoE layer's router logits for the WHOLE batch: ``T_e`` counts the (layer, token) top-k choices
of expert ``e``, ``P_e`` sums its softmax probabilities and ``R`` counts the (layer, token) rows, each
weighted by the attention mask. ``T`` has no gradient (top-k choices), so once ``T`` and ``R`` are known
``aux`` is a sum of terms, one per stage and microbatch, each with its own gradient:

    aux = sum over stages s, microbatches m of  E * <T, P_(s, m)> / R^2

:class:`RouterAux` computes the parts of one router call; ``training/router_aux.py`` runs the two passes
that need them. transformers' function stays the reference: :func:`router_aux_of` runs it beside this
decomposition on random logits, values and gradients, and refuses by name a family whose function differs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..compat import router_logits_recorder
from ..errors import InputError

__all__ = ["RouterAux", "router_aux_of", "training_randomness"]


@dataclass(frozen=True)
class RouterAux:
    """How a model's routers feed transformers' load-balancing loss."""

    router_class: type  # the module whose output ``index`` transformers records as router logits
    index: int
    num_experts: int
    top_k: int
    coef: float  # router_aux_loss_coef

    @staticmethod
    def routing(logits: torch.Tensor) -> torch.Tensor:
        """The routing probabilities of one router call's logits, as transformers' loss recomputes them."""
        return torch.softmax(logits, dim=-1)

    def counts(self, routing: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, R) of one router call's routing probabilities: top-k choices per expert and rows, mask-weighted
        (transformers' ops)."""
        _, chosen = torch.topk(routing, self.top_k, dim=-1)
        if mask is None:
            ones = torch.ones(chosen.numel(), dtype=torch.float32, device=routing.device)
            rows = torch.tensor(float(routing.shape[0]), device=routing.device)
        else:
            ones, rows = mask.repeat_interleave(self.top_k), mask.sum()
        t = torch.zeros(self.num_experts, dtype=torch.float32, device=routing.device)
        return t.scatter_add_(0, chosen.reshape(-1), ones), rows

    @staticmethod
    def probabilities(routing: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """P of one router call: its routing probabilities per expert summed over its (masked) rows."""
        routing = routing.float()
        return (routing if mask is None else routing * mask.unsqueeze(-1)).sum(dim=0)


@torch.enable_grad()  # a forward may ask under no_grad
def _probe(reference: Callable, aux: RouterAux) -> float:
    """Largest difference between transformers' loss (value and gradient) and the decomposition above,
    on random logits of 3 layers x 2 microbatches, with and without a mask."""
    g = torch.Generator(device="cpu").manual_seed(0)  # on the CPU whatever the default device (meta at load)
    worst = 0.0
    for masked in (False, True):
        logits = [torch.randn(2, 6, aux.num_experts, generator=g, device="cpu", requires_grad=True) for _ in range(3)]
        mask = (torch.rand(2, 6, generator=g, device="cpu") > 0.3).float() if masked else None
        flat = [x.reshape(-1, aux.num_experts) for x in logits]
        want = reference(tuple(flat), aux.num_experts, aux.top_k, mask.reshape(2 * 6) if masked else None)
        want_grads = torch.autograd.grad(want, logits)
        t, r = torch.zeros(aux.num_experts, device="cpu"), torch.zeros((), device="cpu")
        parts = [(x[i], None if mask is None else mask[i]) for x in logits for i in range(2)]  # (layer, microbatch)
        for x, m in parts:
            dt, dr = aux.counts(aux.routing(x.detach()), m)
            t, r = t + dt, r + dr
        got = sum(aux.num_experts * torch.dot(t, aux.probabilities(aux.routing(x), m)) / (r * r) for x, m in parts)
        got_grads = torch.autograd.grad(got, logits)
        gaps = [float((a - b).abs().max()) for a, b in zip(got_grads, want_grads)]
        worst = max([worst, abs(float((got - want).detach())), *gaps])
    return worst


def router_aux_of(root: nn.Module, config: Any) -> RouterAux | None:
    """The load-balancing loss ``root`` (a transformers head model) adds to its loss, or None when it adds none.

    Raises InputError when ``config.output_router_logits`` asks for a loss this module cannot reproduce.
    """
    if not getattr(config, "output_router_logits", False) or not hasattr(root, "router_aux_loss_coef"):
        return None  # transformers adds no auxiliary loss (e.g. DeepSeek-V3 balances by a routing bias)
    name = type(root).__name__
    reference = getattr(sys.modules.get(type(root).__module__), "load_balancing_loss_func", None)
    recorded = router_logits_recorder(type(root))
    experts = getattr(root, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(root, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
    if reference is None or recorded is None or not experts or not top_k:
        raise InputError(
            f"{name}: config.output_router_logits=True adds a router loss that pipelined training cannot locate "
            f"(load_balancing_loss_func, recorded router logits, num_experts and top-k); set "
            f"config.output_router_logits=False"
        )
    aux = RouterAux(router_class=recorded[0], index=recorded[1], num_experts=int(experts), top_k=int(top_k),
                    coef=float(root.router_aux_loss_coef))
    # Relative to values of order 1 (the loss is ~top_k at uniform routing): fp32 summation order moves it
    # ~1e-7; a different formula (another normalisation, no mask, squared terms) moves it by 1e-2 or more.
    if _probe(reference, aux) > 1e-5:
        raise InputError(
            f"{name}: its load_balancing_loss_func (config.output_router_logits=True) is not the load-balancing "
            f"loss pipelined training splits over stages and microbatches; set config.output_router_logits=False"
        )
    return aux


def training_randomness(config: Any) -> list[str]:
    """Config fields that make a training-mode forward random before or at the routers (dropout, jitter)."""
    found = []
    for key, value in sorted(config.to_dict().items()):
        if ("dropout" in key or "jitter" in key) and isinstance(value, (int, float)) and value > 0:
            found.append(f"{key}={value}")
    return found
