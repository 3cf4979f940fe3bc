"""Where every checkpoint key lives under a stage plan: :class:`ParamLayout` and :func:`param_layout`.

Training (gradient sync of tied and replicated tensors, the global norm) and checkpoints (who
writes which key) read it; it is computed from the plan and the meta-device skeleton alone, so
every rank computes the same one.

Example:
    >>> layout = param_layout(skeleton, plan, resolved.tied)
    >>> layout.shared          # keys held by more than one stage -> their holders
    {'model.embed_tokens.weight': (0, 1)}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.shards import local_tensor

if TYPE_CHECKING:
    from .plan import StagePlan

__all__ = ["ParamLayout", "count_parameters", "param_layout"]


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


def param_layout(skeleton: nn.Module, plan: StagePlan, tied: Sequence[Sequence[str]]) -> ParamLayout:
    """Where every checkpoint key of ``skeleton`` lives under ``plan`` (``tied``: groups of names of one tensor).

    Training (gradient sync of tied and replicated tensors, the global norm) and checkpoints (who
    writes which key) read it; it depends on the plan alone, so it is the same on every rank.

    Args:
        skeleton: the whole model on the meta device.
        plan: the stage plan.
        tied: groups of state-dict names that are one tensor (``ResolvedRecipe.tied``).
    Returns:
        The :class:`ParamLayout`.
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


def count_parameters(
    model, only_trainable: bool = False, exclude_embeddings: bool = False, *, local: bool = False
) -> int:
    """Parameters of a pipelined model as transformers' ``num_parameters`` counts them (a tied tensor once).

    Args:
        model: a :class:`~hf_pipeline.model.PipelinedModel`.
        only_trainable: count parameters with ``requires_grad`` only. For the whole model that is
            collective (each pipeline rank counts the tensors it owns, summed over the pipeline):
            call it on every rank. So is the whole count of a model with PEFT adapters (counted as
            transformers counts them, with the base weights; each rank holds its stages' adapters).
        exclude_embeddings: leave out ``nn.Embedding`` weights, as transformers does.
        local: count this rank's stages only (a tensor held by two of them once).

    Returns:
        The count.
    """
    embeddings = {f"{n}.weight" for n, m in model.skeleton.named_modules() if isinstance(m, nn.Embedding)}
    # peft sets ``peft_config`` on every rank's model as it injects adapters (each rank into its own stages).
    adapters = bool(getattr(model, "peft_config", None))
    if not (local or only_trainable or adapters):
        # The meta-device model has every parameter's shape: no communication, the same number everywhere.
        return model.skeleton.num_parameters(exclude_embeddings=exclude_embeddings)
    layout = model.param_layout
    mine = {s.spec.index for s in model.stages}
    total = 0
    for name, p in model.checkpoint_named_parameters():
        key = layout.key_of.get(name, name)
        if exclude_embeddings and (name in embeddings or key in embeddings):
            continue
        if only_trainable and not p.requires_grad:
            continue
        # A key outside the checkpoint layout is an adapter weight: counted on the rank that holds it.
        if local or key not in layout.holders or layout.owner_stage(key) in mine:
            total += local_tensor(p).numel() if local else p.numel()  # a tensor-parallel shard: its own part
    if local or model.plan.pp_size == 1:
        return total
    device = model.device if model.ctx.backend == "nccl" else "cpu"
    count = torch.tensor([total], dtype=torch.int64, device=device)
    dist.all_reduce(count, group=model.dims.pp_group)  # the model's own group (None for one process)
    return int(count.item())
