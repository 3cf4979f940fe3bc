"""Which mesh dims go with which families and schedules, as data.

Tensor parallelism inside a stage needs a plan naming the modules to shard: the config's
``base_model_tp_plan`` (transformers has one for LLaMA, Mistral, Qwen2) or, for a family transformers
has none for, its recipe's ``[tp]`` table (GPT-2, BERT, T5). Every schedule runs tensor-parallel stages
except those in :data:`TP_REFUSED_SCHEDULES`, each with the reason it is refused.

Example:
    >>> tp_plan_source(gpt2_config)
    'recipe'
    >>> check_tp_schedule("zbv-zero-bubble", 2)   # raises InputError naming the schedule, or passes
    >>> check_fsdp_schedule("dualpipev", 2)       # likewise for FSDP stages
"""

from __future__ import annotations

import re

from ..errors import InputError
from ..families.recipe import list_recipes

__all__ = [
    "FSDP_REFUSED_SCHEDULES", "REFUSED_STYLES", "STYLES", "TP_REFUSED_SCHEDULES", "check_fsdp_schedule",
    "check_tp_schedule", "match_plan", "parse_style", "plan_pattern", "tp_families", "tp_plan_source",
]

# Schedules a tensor-parallel stage cannot run, with why. None today: every schedule of
# planning/schedules.py (gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zero-bubble,
# zbv-zero-bubble, dualpipev) trains the tiny LLaMA at pp2 x tp2 to transformers' loss and parameters:
# the zero-bubble schedules' split backward (input gradients first, weight gradients later) goes
# through the DTensor shards unchanged. A schedule found not to is added here with its reason.
TP_REFUSED_SCHEDULES: dict[str, str] = {}

# Schedules FSDP stages cannot train with, each with the reason (none: every schedule runs, the zero-bubble
# ones included, since torch's runtime reduce-scatters a stage's gradients once, at the REDUCE_GRAD action
# it places after the stage's last W (``PipelineStage.perform_reduce_grad``), so the deferred weight
# gradients of ``runtime/weight_pass.py`` are in it; tests/training/test_fsdp_zero_bubble.py).
FSDP_REFUSED_SCHEDULES: dict[str, str] = {}


def plan_pattern(text: str) -> re.Pattern:
    """A plan key (``layers.*.mlp.experts``) as a regex over the end of a module or parameter name (``*`` is
    one block index)."""
    return re.compile(r"(?:^|.*\.)" + re.escape(text).replace(r"\*", r"\d+") + "$")


def match_plan(names, plan: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Name -> style of the first pattern of ``plan`` matching it, for every name of ``names`` one matches."""
    compiled = [(plan_pattern(k), style) for k, style in plan]
    out: dict[str, str] = {}
    for name in names:
        for pattern, style in compiled:
            if name and pattern.match(name):
                out[name] = style
                break
    return out


# transformers' plan styles this version applies, as ``(kind, packs)`` (a kind is how
# loading/tensor_parallel.py shards and runs the module). The two "gather" / "split" styles keep the
# activations between them whole on every rank (OLMo 2 normalises q and k over all heads, Phi-3 splits a
# fused projection's output), so the attention runs every head and only the matmuls are shared.
STYLES: dict[str, tuple[str, int]] = {
    "colwise": ("colwise", 1),
    "rowwise": ("rowwise", 1),
    "colwise_gather_output": ("colwise_gather", 1),  # colwise, output gathered whole
    "rowwise_split_input": ("rowwise_split", 1),  # a whole input cut to this rank's share, then rowwise
    "embedding_rowwise": ("rowwise", 1),  # an embedding's vocabulary rows; the lookups summed
    "replicated_with_grad_allreduce": ("replicated", 1),  # whole on every rank, gradient summed (per-head norms)
}

# transformers' styles refused, with why (any other style outside STYLES is refused as unknown here).
REFUSED_STYLES: dict[str, str] = {
    "mla_kv_a_proj": "multi-latent attention's shared rotary key (the tail of kv_a_proj_with_mqa's output, which "
    "every rank's heads read) would need its gradient summed over the ranks, which is not done yet",
    "sequence_parallel": "sequence parallelism is not done yet",
    "moe_tp_experts": "experts sharded by tensor parallelism are not done yet",
}


def parse_style(style: str) -> tuple[str, int] | None:
    """A plan style as ``(kind, packs)``: one of :data:`STYLES`, ``"packed_colwise"`` (transformers' two
    blocks side by side, each sharded) or ``"packed_colwise:K"`` (K blocks: GPT-2's fused q, k, v is
    ``"packed_colwise:3"``). None for a style this version does not apply."""
    if style in STYLES:
        return STYLES[style]
    match = re.fullmatch(r"packed_colwise(?::(\d+))?", style)
    if match is None or (match.group(1) is not None and int(match.group(1)) < 2):
        return None
    return "colwise", int(match.group(1) or 2)


def tp_plan_source(config) -> str | None:
    """Where ``config``'s tensor-parallel plan comes from: ``"config"`` (its ``base_model_tp_plan``),
    ``"recipe"`` (its recipe's ``[tp]`` table) or None (no plan: tensor parallelism is refused)."""
    if getattr(config, "base_model_tp_plan", None):
        return "config"
    recipe = list_recipes().get(getattr(config, "model_type", None))
    return "recipe" if recipe is not None and recipe.tp_plan else None


def tp_families() -> dict[str, str]:
    """``model_type`` -> where its plan comes from, for every family with a recipe that tensor parallelism can shard."""
    from transformers import AutoConfig

    out = {}
    for model_type in sorted(list_recipes()):
        source = tp_plan_source(AutoConfig.for_model(model_type))
        if source is not None:
            out[model_type] = source
    return out


def check_tp_schedule(schedule: str, tp_size: int) -> None:
    """Raise :class:`InputError` if ``schedule`` cannot run tensor-parallel stages (``tp_size`` > 1)."""
    if tp_size > 1 and schedule in TP_REFUSED_SCHEDULES:
        raise InputError(
            f"schedule={schedule!r} with tp_size={tp_size}: {TP_REFUSED_SCHEDULES[schedule]}; use one of "
            f"{_allowed(TP_REFUSED_SCHEDULES)}, or tp_size=1"
        )


def check_fsdp_schedule(schedule: str, fsdp_size: int) -> None:
    """Raise :class:`InputError` if ``schedule`` cannot train FSDP stages (``fsdp_size`` > 1)."""
    if fsdp_size > 1 and schedule in FSDP_REFUSED_SCHEDULES:
        raise InputError(
            f"fsdp_size={fsdp_size} with the schedule {schedule!r} is not supported "
            f"({FSDP_REFUSED_SCHEDULES[schedule]}); use one of {_allowed(FSDP_REFUSED_SCHEDULES)}, or fsdp_size=1"
        )


def _allowed(refused: dict[str, str]) -> str:
    """The schedules ``refused`` leaves, quoted, for a message."""
    return ", ".join(repr(s) for s in _schedules() if s not in refused)


def _schedules() -> list[str]:
    from .schedules import SCHEDULES

    return list(SCHEDULES)
