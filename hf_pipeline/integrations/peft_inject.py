"""Adapter injection on this rank's stages, as if peft adapted the whole model on one process.

peft walks ``model.named_modules()`` and replaces each target with a LoRA layer whose ``lora_A``
is drawn from the global random stream in module order. On a pipelined model three things differ
from one process, and this module puts them back:

* names: a stage's module names are the checkpoint's (``model.layers.3.self_attn.q_proj``), so
  peft adapts each *stage* (not the ``stages.N.`` wrapper) and regexes written for the HF model
  match as on one process;
* which modules match: targets are matched against the whole model (its meta-device copy, the
  skeleton) on every rank; it is an error only when nothing matches anywhere, and a stage with no
  match is simply frozen (peft alone would raise on that rank);
* initial values: peft runs first on a copy of the skeleton, recording the random state before each
  target; each local target is then created from its recorded state, and the stream is left where
  one process leaves it.

Example:
    >>> peft_model = peft.get_peft_model(pipelined, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..compat import peft_create_and_replace, peft_freeze_base, peft_override_create_and_replace
from ..core import PipelineCore
from ..errors import InputError
from .peft_tensor_parallel import shard_adapters, tp_styles, whole_features

__all__ = ["AdapterState", "check_config", "inject_on_stages", "local_adapter_keys", "wrapped_module_keys"]

# init_lora_weights values that only draw from the random stream; the others (pissa, olora, loftq,
# eva, corda, ...) read the base weights, which here are spread over ranks (and meta in the skeleton).
_RANDOM_INITS = (True, False, "gaussian")
# Parts of a parameter name peft inserts below a target module.
_ADAPTER_PART = re.compile(r"\.(lora_[A-Za-z_]+|base_layer|modules_to_save|original_module)(\.|$)")


@dataclass(kw_only=True)
class AdapterState:
    """What the model keeps once an adapter is injected (``model.adapter_state``).

    Attributes:
        targets: the whole model's adapted module names, in module order (the same on every rank).
        load_hook: the handle of the ``load_state_dict`` pre-hook mapping one-process keys to stages.
    """

    targets: list[str] = field(default_factory=list)
    load_hook: Any = None


def check_config(config) -> None:
    """Refuse what cannot be reproduced stage by stage; every rank raises the same error.

    Args:
        config: the adapter's ``PeftConfig``.
    """
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA":
        raise InputError(f"a pipelined model takes LoRA adapters only; got peft_type={kind}: use peft.LoraConfig")
    if config.init_lora_weights not in _RANDOM_INITS:
        raise InputError(
            f"init_lora_weights={config.init_lora_weights!r} reads the base weights, which a pipelined model "
            f"spreads over ranks: use one of {_RANDOM_INITS}"
        )
    for name in ("use_dora", "layer_replication", "trainable_token_indices"):
        if getattr(config, name, None):
            raise InputError(
                f"LoraConfig({name}=...) is not supported on a pipelined model (it replaces or reads whole "
                f"modules a stage may not hold): leave {name} unset"
            )


def _recording(tuner, record: Callable[[str], None]):
    # peft's per-module creation, preceded by ``record(key)``; set on the tuner instance for one injection.
    create = peft_create_and_replace(tuner)

    def create_and_replace(peft_config, adapter_name, target, target_name, parent, current_key, **kwargs):
        record(current_key)
        return create(tuner, peft_config, adapter_name, target, target_name, parent, current_key=current_key, **kwargs)

    return create_and_replace


def _with_create_hook(tuner, hook, run):
    peft_override_create_and_replace(tuner, hook)
    try:
        return run()
    finally:
        peft_override_create_and_replace(tuner, None)


def _whole_model_targets(tuner, original, model: PipelineCore, adapter_name: str,
                         kwargs: dict) -> tuple[list[str], dict]:
    """Run peft on a copy of the skeleton: the whole model's targets in order, and the random state before each."""
    states: dict[str, torch.Tensor] = {}
    names = (list(tuner.targeted_module_names), list(tuner.targeted_parameter_names))
    skeleton = copy.deepcopy(model.skeleton)

    def record(key: str) -> None:
        states[key] = torch.get_rng_state()

    from peft import NoMatchingPeftModuleError

    try:
        _with_create_hook(tuner, _recording(tuner, record), lambda: original(tuner, skeleton, adapter_name, **kwargs))
    except NoMatchingPeftModuleError as exc:  # nothing matches in the whole model
        config = tuner.peft_config[adapter_name]
        raise InputError(
            f"target_modules={config.target_modules} match no module of the whole model (matched on every "
            f"rank against the full model's names, e.g. {_example_name(model)}): {exc}"
        ) from exc
    finally:
        tuner.targeted_module_names[:], tuner.targeted_parameter_names[:] = names
    return list(states), states


def _example_name(model: PipelineCore) -> str:
    blocks = [b for stack in model.resolved.stacks for b in stack.blocks]
    first = blocks[0] + "." if blocks else ""
    linear = [n for n, m in model.skeleton.named_modules() if isinstance(m, nn.Linear) and n.startswith(first)]
    return linear[0] if linear else first.rstrip(".")


def _check_targets(model: PipelineCore, targets: list[str]) -> None:
    # LoRA lives in the repeated blocks: embeddings, final modules and heads are held by reference in
    # the stage's glue (and may be tied across stages), modules every stage copies would diverge.
    blocks = tuple(b + "." for stack in model.resolved.stacks for b in stack.blocks)
    replicated = tuple(m + "." for stack in model.resolved.stacks for m in stack.every_stage)
    outside = [t for t in targets if not t.startswith(blocks) or (t + ".").startswith(replicated)]
    if outside:
        raise InputError(
            f"target_modules match {outside[:4]}, outside the model's repeated blocks; a pipelined model adapts "
            "modules inside the blocks only (attention and MLP projections): narrow target_modules"
        )


def _check_saved_modules(model: PipelineCore, config) -> None:
    # modules_to_save (peft's SEQ_CLS task adds the classifier): peft wraps every module whose name
    # ends with one of them in a trainable copy. The glue looks head modules up by name on every call,
    # so a wrapped head module is run; embeddings and final modules are held by reference (and copies
    # of modules every stage holds would diverge), so those are refused.
    names = list(getattr(config, "modules_to_save", None) or [])
    heads = tuple(model.resolved.head.modules)
    blocks = tuple(b + "." for stack in model.resolved.stacks for b in stack.blocks)
    replicated = tuple(m for stack in model.resolved.stacks for m in stack.every_stage)
    matched = [n for n, _ in model.skeleton.named_modules() if n and any(n.endswith(m) for m in names)]
    bad = [
        n for n in matched
        if not (n in heads or n.startswith(tuple(h + "." for h in heads)) or n.startswith(blocks))
        or n.startswith(replicated)
    ]
    if bad:
        raise InputError(
            f"modules_to_save={names} matches {bad[:4]}: a pipelined model trains copies of its head modules "
            f"({', '.join(heads)}) and of modules inside its blocks only; leave the others out of modules_to_save"
        )


def inject_on_stages(tuner, original, model: PipelineCore, adapter_name: str, **kwargs: Any) -> list[str]:
    """peft's ``inject_adapter`` for a pipelined ``model``: each local stage adapted as one process would.

    Args:
        tuner: peft's tuner (``LoraModel``) wrapping ``model``.
        original: peft's own ``BaseTuner.inject_adapter``.
        model: the pipelined model.
        adapter_name: the adapter's name.
        kwargs: the rest of ``inject_adapter``'s arguments.

    Returns:
        The whole model's adapted module names, in module order.
    """
    check_config(tuner.peft_config[adapter_name])
    _check_saved_modules(model, tuner.peft_config[adapter_name])
    start = torch.get_rng_state()
    try:
        targets, states = _whole_model_targets(tuner, original, model, adapter_name, kwargs)
        _check_targets(model, targets)
        styles = tp_styles(model, targets)  # refuses what tensor parallelism's LoRA does not take
    finally:
        end = torch.get_rng_state()
        torch.set_rng_state(start)  # a refusal leaves the random stream as it found it
    try:
        for stage in model.stages:
            # a target is a module name, or a parameter's (target_parameters: ``...mlp.experts.gate_up_proj``)
            mine = {n for n, _ in stage.named_modules()} | {n for n, _ in stage.named_parameters()}
            if any(t in mine for t in targets):
                hook = _recording(tuner, lambda key: torch.set_rng_state(states[key]))
                with whole_features():  # lora_A / lora_B whole on DTensor layers (tp, HSDP)
                    _with_create_hook(tuner, hook, lambda s=stage: original(tuner, s, adapter_name, **kwargs))
            else:
                peft_freeze_base(tuner, stage)
    finally:
        torch.set_rng_state(end)  # where one process leaves the stream
    shard_adapters(model, styles)  # each tp rank's share of lora_A / lora_B, merges into shards
    return targets


def _without_adapter_name(key: str, adapter_name: str) -> str:
    # peft's checkpoint key of a model key: the adapter name dropped where it names a parameter's
    # container (``lora_A.default.weight`` -> ``lora_A.weight``; a bare parameter ends with it).
    return re.sub(rf"\.{re.escape(adapter_name)}(?=\.[^.]+$|$)", "", key, count=1)


def local_adapter_keys(model: PipelineCore, state_dict: dict, prefix: str) -> None:
    """Map one-process keys in ``state_dict`` to this rank's stage keys, in place: ``prefix +
    "model.layers.3...lora_A.default.weight"`` (or, while ``model.adapter_loading`` names an adapter, the
    file's ``...lora_A.weight``) becomes ``prefix + "stages.0.model.layers.3...lora_A.default.weight"``; keys of
    modules another rank holds are dropped.

    A ``load_state_dict`` pre-hook of the pipelined model, so peft's and transformers' adapter loading
    (which call ``load_state_dict(strict=False)`` with the file's keys) fill the local stages.
    """
    homes: dict[str, list[str]] = {}
    loading = model.adapter_loading
    for j, stage in enumerate(model.stages):
        for name in stage.state_dict():
            homes.setdefault(name, []).append(f"stages.{j}.{name}")
            if loading is not None and _ADAPTER_PART.search(name):
                alias = _without_adapter_name(name, loading)
                if alias != name:
                    homes.setdefault(alias, []).append(f"stages.{j}.{name}")
    whole = {n for n, _ in model.skeleton.named_modules()}
    checkpoint = model.param_layout.key_of
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        if rest.startswith("stages."):
            continue
        if rest in homes:
            value = state_dict.pop(key)
            for home in homes[rest]:
                state_dict[prefix + home] = value
        elif _ADAPTER_PART.search(rest) and _ADAPTER_PART.split(rest)[0] in whole:
            del state_dict[key]  # an adapter tensor of a module another rank holds
        elif rest in checkpoint:
            del state_dict[key]  # a modules_to_save copy of a module another rank holds (its checkpoint key)


def wrapped_module_keys(model: PipelineCore, weights: dict) -> dict:
    """An adapter file's tensors with, for each ``modules_to_save`` copy on this rank, its keys also under
    the stage's name (``base_model.model.classifier.weight`` -> ``base_model.model.stages.1.classifier.weight``),
    which is where peft looks them up."""
    weights = dict(weights)
    for j, stage in enumerate(model.stages):
        for name, module in stage.named_modules():
            if not hasattr(module, "modules_to_save"):
                continue
            for key in [k for k in weights if k.startswith(f"base_model.model.{name}.")]:
                weights[key.replace("base_model.model.", f"base_model.model.stages.{j}.", 1)] = weights[key]
    return weights
