"""How the model's parameter names meet one checkpoint's keys, as transformers' ``from_pretrained`` matches them.

Stage parameter names equal checkpoint keys, except where transformers itself loads a key under
another name: a tied twin, the base-model prefix dropped or added, a legacy name it renames. This
module works out, from the whole meta model and the checkpoint's index alone (no shard is read),
which key serves each name (:func:`key_plan`), what this rank's stages read (:func:`wanted_tensors`),
and reports initialised and skipped keys as transformers does (:func:`log_load_report`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch
import transformers
from torch import nn

from ..compat import transformers_load_exceptions
from ..planning.resolve import ResolvedRecipe
from .checkpoint_files import CheckpointIndex
from .key_conversions import Conversion, checkpoint_conversions, refuse_unconverted
from .key_renames import checkpoint_key_renames

__all__ = ["UNEXPECTED_HINT", "KeyPlan", "key_plan", "log_load_report", "wanted_tensors"]

# What a checkpoint with blocks the config lacks should do, said from from_pretrained's side.
UNEXPECTED_HINT = (
    "it has more blocks than the config (num_hidden_layers / num_layers): load it with its own config.json, or a "
    "config with as many layers"
)


@dataclass(frozen=True, kw_only=True)
class KeyPlan:
    """How the whole model's names meet one checkpoint's keys, as transformers' ``from_pretrained`` matches them.

    Attributes:
        variants: model name -> the checkpoint keys it may be stored under, in order (itself, the
            base-model prefix dropped or added, the legacy name transformers renames on load).
        expected: every checkpoint key the model reads or accepts (tied twins and variants included).
        ignored: checkpoint keys transformers ignores without a word (the class's
            ``_keys_to_ignore_on_load_unexpected``, old ``rotary_emb.inv_freq`` / ``position_ids`` buffers).
        unexpected: checkpoint keys transformers reports as UNEXPECTED and skips (another task's head,
            a pooler this class does not build); loaded models warn about them as transformers does.
        initialized: model names no checkpoint key serves that transformers initialises with the
            model's own ``_init_weights`` (a task head or pooler missing from a base or other-task
            checkpoint, or names the class declares in ``_keys_to_ignore_on_load_missing``).
        conversions: model name -> the :class:`~.key_conversions.Conversion` that builds it from several
            checkpoint tensors (a MoE layer's experts stored one tensor each), as transformers' conversion
            mapping for the class does.
    """

    variants: dict[str, list[str]]
    expected: set[str]
    ignored: set[str]
    unexpected: list[str]
    initialized: list[str]
    conversions: dict[str, Conversion]


def _transformers_ignores(skeleton: nn.Module, unexpected: set[str], missing: set[str]) -> tuple[set[str], set[str]]:
    """(unexpected, missing) left after transformers' own exception rules for ``skeleton``'s class."""
    left = transformers_load_exceptions(skeleton, unexpected, missing)
    if left is not None:  # transformers' own rules: class patterns plus the legacy inv_freq / position_ids buffers
        return left

    def keep(keys, attr):  # an older transformers: the class lists only
        patterns = [re.compile(p) for p in (getattr(skeleton, attr, None) or ())]
        return {k for k in keys if not any(p.search(k) for p in patterns)}

    return keep(unexpected, "_keys_to_ignore_on_load_unexpected"), keep(missing, "_keys_to_ignore_on_load_missing")


def key_plan(skeleton: nn.Module, resolved: ResolvedRecipe, index: CheckpointIndex) -> KeyPlan:
    """The :class:`KeyPlan` of ``skeleton`` (the whole meta model) against ``index`` (reads no shard)."""
    ckpt_keys = index.keys()
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    groups = {name: g for g in resolved.tied for name in g}

    # Keys transformers renames on load (LayerNorm.gamma -> .weight, ...), by the name they load as.
    legacy: dict[str, str] = {}
    renamed = checkpoint_key_renames(skeleton, ckpt_keys)
    for key, new in renamed.items():
        legacy.setdefault(new, key)

    def variants(name: str) -> list[str]:
        # A base model (BertModel) can load a head checkpoint (bert.embeddings...) and a head model a
        # base checkpoint (embeddings...), as transformers allows.
        out = [name]
        if prefix and name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        elif prefix and not resolved.base:
            out.append(f"{prefix}.{name}")
        return out + [legacy[v] for v in out if v in legacy]

    state = skeleton.state_dict(keep_vars=True)
    all_variants = {name: [v for member in groups.get(name, (name,)) for v in variants(member)] for name in state}
    # Tensors the checkpoint stores split (experts one tensor each), merged on load as transformers merges them.
    conversions = checkpoint_conversions(skeleton, ckpt_keys, all_variants, directory=index.directory)
    expected = {v for vs in all_variants.values() for v in vs} | {k for c in conversions.values() for k in c.sources}
    params = {name for name, _ in skeleton.named_parameters(remove_duplicate=False)}
    stored = {name for name in params if name in conversions or any(v in ckpt_keys for v in all_variants[name])}
    missing = params - stored
    # Unexpected keys in the model's own name space, where transformers matches its ignore patterns.
    extra = {k for k in ckpt_keys if k not in expected}
    unexpected, warned_missing = _transformers_ignores(skeleton, extra, missing)
    ignored = extra - unexpected

    # Of the missing weights, those transformers initialises and this loader follows it on: the task
    # head's modules (a head or pooler that the checkpoint's class did not have) and what the class
    # itself declares may be missing. Missing blocks, embeddings or norms mean the config does not
    # match the checkpoint: resolve_keys refuses those, naming them.
    head = tuple(m + "." for m in resolved.head.modules)
    initialized = sorted(n for n in missing if n.startswith(head) or n not in warned_missing)
    # A model tensor that is neither stored nor built from what is stored, with other tensors in its module:
    # named with the class here, on every rank, before resolve_keys' plainer "no tensor" on the stage's rank.
    refuse_unconverted(skeleton, missing - set(initialized), extra, directory=index.directory)
    tolerated = _tolerated(resolved, unexpected, prefix, renamed)
    return KeyPlan(
        variants=all_variants, expected=expected, ignored=ignored, unexpected=sorted(tolerated),
        initialized=initialized, conversions=conversions,
    )


def _tolerated(resolved: ResolvedRecipe, unexpected: set[str], prefix: str, renamed: dict[str, str]) -> set[str]:
    """The unexpected keys that transformers skips with a warning and this loader does too.

    All of them except keys of blocks the model does not have (``model.layers.7.*`` with a config of 6
    layers): transformers skips those too, but a config with fewer layers than its checkpoint is a
    mistake worth refusing, by name (``load_tensors`` raises for them).
    """
    stacks = [(s.blocks[0].rpartition(".")[0] + ".", set(s.blocks)) for s in resolved.stacks if s.blocks]
    out = set()
    for key in unexpected:
        name = renamed.get(key, key)
        names = {name, f"{prefix}.{name}" if prefix else name, name.removeprefix(f"{prefix}.") if prefix else name}
        beyond = False
        for container, blocks in stacks:
            for n in names:
                if n.startswith(container):
                    block = container + n[len(container) :].split(".", 1)[0]
                    beyond = beyond or block not in blocks
        if not beyond:
            out.add(key)
    return out


def wanted_tensors(
    skeleton: nn.Module, resolved: ResolvedRecipe, stages: Sequence[nn.Module], index: CheckpointIndex,
    dtype: torch.dtype,
):
    """What to read for these stages: names + (shape, dtype), alternative keys, the whole model's keys, keys to ignore.

    Returns:
        ``(wanted, aliases, expected, ignore)``: checkpoint name -> (shape, load dtype) of every
        parameter (and every buffer the checkpoint stores) of ``stages``, except the weights that
        are initialised instead (:attr:`KeyPlan.initialized`) and those built from several checkpoint
        tensors (:attr:`KeyPlan.conversions`: their source keys are wanted instead, under their own
        names, and :func:`~.key_conversions.convert_tensors` makes the stage's tensor of them); name ->
        other keys the same tensor may be stored under (a tied twin, the base-model prefix added or
        dropped, a legacy name transformers renames on load); every key the whole model may load from or skips as
        transformers does; and the regexes of unexpected keys to accept (none left over: the keys
        transformers ignores are in ``expected``).
    """
    plan = key_plan(skeleton, resolved, index)
    ckpt_keys = index.keys()
    skip = set(plan.initialized)
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    aliases: dict[str, list[str]] = {}
    for stage in stages:
        sd = stage.state_dict(keep_vars=True)
        for name, t in sd.items():
            conversion = plan.conversions.get(name)
            if conversion is not None:  # read its checkpoint tensors: convert_tensors merges them
                for key, shape in zip(conversion.sources, conversion.shapes):
                    wanted[key] = (shape, dtype if t.is_floating_point() else t.dtype)
                continue
            is_param = isinstance(t, nn.Parameter)
            alts = plan.variants.get(name, [name])
            if name in skip or (not is_param and not any(a in ckpt_keys for a in alts)):
                continue  # initialised like transformers, or a buffer the checkpoint does not store (kept as built)
            wanted[name] = (tuple(t.shape), dtype if t.is_floating_point() else t.dtype)
            aliases[name] = [a for a in alts if a != name]
    return wanted, aliases, plan.expected | plan.ignored | set(plan.unexpected), []


def log_load_report(skeleton: nn.Module, path, plan: KeyPlan) -> None:
    """Warn about initialised and skipped keys as transformers does (its report, on its logger)."""
    if not (plan.initialized or plan.unexpected):
        return
    logger = transformers.utils.logging.get_logger("transformers.modeling_utils")
    try:
        from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report

        info = LoadStateDictInfo(
            missing_keys=set(plan.initialized), unexpected_keys=set(plan.unexpected), mismatched_keys=set(),
            error_msgs=[], conversion_errors={}, skipped_pp_keys=set(),
        )
        log_state_dict_report(
            model=skeleton, pretrained_model_name_or_path=str(path), ignore_mismatched_sizes=False,
            loading_info=info, logger=logger,
        )
    except ImportError:  # an older transformers: the same facts, plainly
        logger.warning(
            f"{type(skeleton).__name__} from {path}: newly initialized (missing from the checkpoint): "
            f"{plan.initialized}; unexpected (skipped): {plan.unexpected}"
        )
