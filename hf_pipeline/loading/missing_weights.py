"""Weights the checkpoint lacks, initialised as transformers' ``from_pretrained`` initialises them.

A task head or pooler missing from a base or other-task checkpoint gets the model's own
``_init_weights`` values, drawn from the same generator state on every rank (global rank 0's), so
each tensor holds what transformers gives it after the same ``torch.manual_seed``, whichever rank
keeps it.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from ..compat import mark_hf_initialized
from ..distributed.context import RankContext
from ..distributed.exchange import broadcast_random_state

__all__ = ["agreed_rng_state", "initialize_missing"]


def initialize_missing(
    skeleton: nn.Module, names: Sequence[str], *, dtype: torch.dtype, rng_state: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Initialise ``names`` (missing from the checkpoint) with the model's own ``_init_weights``, on CPU.

    As transformers' ``from_pretrained``: every other parameter counts as loaded (``_is_hf_initialized``),
    ``initialize_weights()`` walks the whole model in its own order and draws from torch's CPU
    generator. Every rank initialises every missing tensor of the whole model from the same
    ``rng_state`` (global rank 0's at load time), so each tensor gets the values transformers gives
    it after the same ``torch.manual_seed``, whichever rank keeps it, and a replica on two ranks is
    one value. The caller's generator is left as it was.

    Returns:
        name -> tensor, one tensor for the names of a tied group.
    """
    if not names:
        return {}
    model = copy.deepcopy(skeleton)  # meta parameters: cheap; the skeleton itself stays untouched
    wanted = set(names)
    made: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if name in wanted or id(param) in made:
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=param.requires_grad)
            setattr(owner, attr, made[id(param)])
        else:
            mark_hf_initialized(param)
    for buf in model.buffers():
        mark_hf_initialized(buf)  # buffers keep the values the model was built with
    for module in model.modules():
        mark_hf_initialized(module, False)  # set when the meta model was built; the walk must visit every module
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        model.initialize_weights()
    values = dict(model.named_parameters(remove_duplicate=False))
    return {name: values[name].detach() for name in names}


def agreed_rng_state(ctx: RankContext) -> torch.Tensor:
    """Global rank 0's CPU generator state, on every rank (collective when distributed)."""
    return broadcast_random_state(ctx, torch.device("cpu"), 0)
