"""Stage modules: a pruned copy of the HF model holding only what one stage owns.

The full model is instantiated once on the meta device. For each local stage a copy is pruned to
the stage's module FQNs (see :class:`~hf_pipeline.planning.plan.StageSpec`), keeping HF's own module
objects and the model's attribute tree, so ``stage.named_parameters()`` yields exactly the
checkpoint keys (``model.layers.3.mlp.up_proj.weight``). Weights are then materialised straight
onto the stage device from the safetensors shards (see ``weights.py``).

Example:
    >>> meta = meta_model(config, "AutoModelForCausalLM")
    >>> stage = build_stage(meta, resolved, plan.stages[1])
    >>> sorted(n for n, _ in stage.named_parameters())[:1]
    ['model.layers.4.input_layernorm.weight']
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import transformers
from accelerate import init_empty_weights
from torch import nn

from ..compat import module_registries, no_init_weights
from ..errors import InternalError
from ..families.glue import Glue, get_glue
from ..families.recipe import get_recipe
from ..planning.options import PipelineOptions, model_class_for
from ..planning.plan import StagePlan, StageSpec, make_plan
from ..planning.resolve import ResolvedRecipe, resolve_recipe
from .tensor_parallel import check_plan

__all__ = ["StageMaker", "StageModule", "build_stage", "materialize", "meta_model", "prune", "recipe_front_end"]


def meta_model(config, model_class: str | type) -> nn.Module:
    """Instantiate ``model_class`` for ``config`` with parameters on the meta device.

    Buffers stay real (they are small and not all of them are in checkpoints: rotary ``inv_freq``,
    position id ranges), so a pruned stage only needs its parameters loaded.
    """
    cls = model_class_for(config, model_class)
    # No initialisation: parameters are meta (nothing to fill) and the real values come from the
    # checkpoint, or, for weights it lacks, from transformers' own init at load (missing_weights.initialize_missing).
    with no_init_weights(), init_empty_weights(include_buffers=False):
        model = cls._from_config(config)
    # init_empty_weights swaps parameters as they are registered, which undoes the ties that
    # post_init made; tie again so shared tensors are one Parameter, as in a real model.
    model.tie_weights()
    return model.eval()


def prune(module: nn.Module, keep: set[str], prefix: str = "") -> None:
    # Delete every child not kept and not an ancestor of a kept module. Containers keep their
    # class and attributes (a ModuleList of layers 4..7 still iterates them), and parameter names
    # stay the model's own. The walk reads nn.Module's own registries (not named_children /
    # named_parameters): they alone show None entries and a child registered under two names.
    parameters, children = module_registries(module)
    for name in list(parameters):
        if prefix.rstrip(".") not in keep:
            del parameters[name]
    for name, child in list(children.items()):
        fqn = prefix + name
        if child is None or fqn in keep:
            continue
        if any(k.startswith(fqn + ".") for k in keep):
            prune(child, keep, fqn + ".")
        else:
            del children[name]


@dataclass
class StackRun:
    """The part of one stack (encoder, decoder, ...) that a stage runs."""

    name: str
    starts: bool  # the stage runs this stack's first block (and its embeddings)
    ends: bool  # ... and its last block (and its final modules)
    blocks: list[str]
    modules: list[nn.Module]
    embeds: list[nn.Module]
    finals: list[nn.Module]
    replicas: list[str]  # FQNs of modules replicated on this stage (e.g. T5's relative bias)
    container: nn.Module  # the module holding the stack (T5Stack; the base model otherwise)

    def embed(self, ids):
        return self.embeds[0](ids)

    @property
    def config(self):
        return self.container.config

    @property
    def dropout(self):
        return getattr(self.container, "dropout", nn.Identity())


class StageModule(nn.Module):
    """One pipeline stage. Its children are the pruned top-level children of the HF model."""

    def __init__(
        self, root: nn.Module, spec: StageSpec, resolved: ResolvedRecipe, glue: Glue, absent: tuple[str, ...] = ()
    ):
        super().__init__()
        for name, child in root.named_children():
            self.add_module(name, child)
        # The pruned HF model itself (its class's forward, for a glue that runs it), kept out of the
        # module registry so parameter names stay the checkpoint's; and the base model's children it lacks.
        self.__dict__["hf_root"] = root
        self.absent_holder_children = absent
        self.config = root.config
        # As the HF model's: code handed a stage as a model (peft, through transformers' weight conversion
        # mapping) reads it to scope what applies under a nested sub-model (DeepseekV3Model under the stage).
        self.base_model_prefix = getattr(root, "base_model_prefix", "")
        self.spec = spec
        self.resolved = resolved
        self.glue = glue
        self.compiled_blocks = 0  # blocks compiled with torch.compile (loading/compiled.py): decode caches follow
        self.stack_runs: list[StackRun] = []
        for stack in resolved.stacks:
            owned = [b for b in stack.blocks if b in spec.blocks]
            if not owned:
                continue
            self.stack_runs.append(
                StackRun(
                    name=stack.name,
                    starts=owned[0] == stack.blocks[0] and spec.half_of(owned[0]) != 1,
                    ends=owned[-1] == stack.blocks[-1] and spec.half_of(owned[-1]) != 0,
                    blocks=owned,
                    modules=[self.get_submodule(b) for b in owned],
                    embeds=[self.get_submodule(m) for m in stack.embed if m in spec.modules],
                    finals=[self.get_submodule(m) for m in stack.final if m in spec.modules],
                    replicas=[m for m in stack.every_stage if m in spec.modules],
                    container=self.get_submodule(stack.holder) if stack.holder else self,
                )
            )
        glue.check(self)  # refuse at load what the glue cannot compute as the HF model does

    # Shortcuts for single-stack glues.
    @property
    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(b, m) for run in self.stack_runs for b, m in zip(run.blocks, run.modules)]

    @property
    def block_halves(self) -> list[int | None]:
        """Parallel to :attr:`blocks`: None for a whole block, 0 / 1 for its first / second half only."""
        return [self.spec.half_of(b) for run in self.stack_runs for b in run.blocks]

    @property
    def attention_blocks(self) -> tuple[str, ...]:
        """The blocks whose attention this stage runs (and whose KV cache it keeps), in order."""
        return self.spec.attention_blocks

    @property
    def embeds(self) -> list[nn.Module]:
        return self.stack_runs[0].embeds

    @property
    def finals(self) -> list[nn.Module]:
        return self.stack_runs[-1].finals

    @property
    def replicas(self) -> list[nn.Module]:
        return [self.get_submodule(m) for m in self.stack_runs[0].replicas]

    def forward(self, *received: torch.Tensor, **inputs: Any):
        return self.glue.forward(self, received, inputs)

    def extra_repr(self) -> str:
        halves = f", halves={dict(self.spec.halves)}" if self.spec.halves else ""
        return f"stage={self.spec.index}, rank={self.spec.rank}, blocks={len(self.spec.blocks)}{halves}"


class _NotCopied(nn.Module):
    """Stands in, during :func:`build_stage`'s copy, for a subtree the stage drops; prune deletes it."""


def build_stage(full: nn.Module, resolved: ResolvedRecipe, spec: StageSpec) -> StageModule:
    """A meta-device :class:`StageModule` for ``spec``, cut from a copy of ``full``.

    Only what the stage keeps is copied: every module that the stage neither keeps, nor contains a
    kept module, nor sits inside one (under any of its names: T5's shared embedding has two) is
    mapped to one placeholder in the copy's memo, so a stage of one layer in 80 costs one layer's copy.
    """
    keep = set(spec.modules)

    def needed(fqn: str) -> bool:
        return not fqn or fqn in keep or any(k.startswith(fqn + ".") or fqn.startswith(k + ".") for k in keep)

    names: dict[int, list[str]] = {}
    for fqn, module in full.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(fqn)
    placeholder = _NotCopied()
    memo: dict[int, Any] = {i: placeholder for i, fqns in names.items() if not any(needed(f) for f in fqns)}
    root = copy.deepcopy(full, memo)
    prune(root, keep)
    absent: tuple[str, ...] = ()
    if resolved.recipe.roles:  # the children of the module holding the blocks that this stage dropped
        holder = resolved.stacks[0].holder
        had, has = (dict((m.get_submodule(holder) if holder else m).named_children()) for m in (full, root))
        absent = tuple(n for n in had if n not in has)
    return StageModule(root, spec, resolved, get_glue(resolved.recipe.glue), absent)


def materialize(
    stage: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    device: torch.device,
    tied: tuple[tuple[str, ...], ...] = (),
    made: dict[str, nn.Parameter] | None = None,
) -> None:
    """Replace the stage's meta parameters with ``tensors`` (by checkpoint name), on ``device``.

    Names that are one tensor in the model (``tied``) become one Parameter again when a stage holds
    several of them, so their gradients add up as in the unsplit model. Pass the same ``made`` dict
    for all stages of one rank to extend this across them (a tied embedding and LM head, or a
    replica such as T5's relative bias, on two local stages): two Parameters sharing one storage
    would each be stepped by the optimizer, moving the tensor twice.
    """
    groups = {name: g for g in tied for name in g}
    made = {} if made is None else made
    for name, param in list(stage.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        owner = stage.get_submodule(owner_name)
        twin = next((made[n] for n in (name, *groups.get(name, ())) if n in made), None)
        if twin is None:
            if name not in tensors:
                raise InternalError(f"no tensor loaded for stage parameter {name!r}")
            twin = nn.Parameter(tensors[name].to(device), requires_grad=param.requires_grad)
        setattr(owner, attr, twin)
        made[name] = twin
    for name, buf in list(stage.named_buffers()):
        owner_name, _, attr = name.rpartition(".")
        owner = stage.get_submodule(owner_name)
        value = tensors.get(name, buf)
        setattr(owner, attr, value.to(device))


@dataclass(kw_only=True)
class StageMaker:
    """What a front end gives the loader (the same on every rank).

    Attributes:
        config: the config the stages run with (the tracer's copy has ``use_cache=False``).
        plan: the stage plan.
        resolved: the recipe resolved against the model (the tracer makes one from the model).
        skeleton: the whole model on the meta device; never run, kept for config-only helpers.
        output_class: the transformers output class the head's outputs are returned in.
        make_stages: meta-device stage modules for the given specs (this rank's), checkpoint names inside.
        on_loaded: called with the materialised stages (the tracer wires its graphs to them).
        generate_refusal: why this model cannot ``generate()``, or None when it can.
        load_conversions: the transforms of transformers' conversion mapping the loaded checkpoint's keys
            matched (:func:`~.key_conversions.load_conversions`), which ``save_pretrained`` reverts as
            transformers reverts those its ``from_pretrained`` used; None before a load (then transformers'
            default mapping is reverted, as for a model it did not load).
    """

    config: Any
    plan: StagePlan
    resolved: ResolvedRecipe
    skeleton: nn.Module
    output_class: type
    make_stages: Callable[[Sequence[StageSpec]], list[nn.Module]]
    on_loaded: Callable[[Sequence[nn.Module]], None] = field(default=lambda stages: None)
    generate_refusal: str | None = None
    load_conversions: list | None = None


def recipe_front_end(config, options: PipelineOptions) -> StageMaker:
    """The recipe front end: the plan of ``config``'s model and stages cut from it by its recipe.

    Needs only the config (no weights, no process group): the planner and the converter call it
    too, so they plan exactly what the loader builds.
    """
    skeleton = meta_model(config, options.model_class)
    recipe = get_recipe(config.model_type)
    # A model class that has only some of the recipe's stacks (T5EncoderModel: the encoder) is
    # resolved against those alone.
    head = recipe.match_head(type(skeleton).__name__, type(getattr(skeleton, "base_model", skeleton)).__name__)
    resolved = resolve_recipe(skeleton, recipe.for_head(head) if head is not None else recipe)
    check_plan(skeleton, options.tp_plan)
    plan = make_plan(
        skeleton, resolved, pp_size=options.pp_size, virtual_stages=options.virtual_stages,
        layout=options.schedule.layout, split=options.split, dtype=options.dtype,
        schedule=options.schedule, n_microbatches=options.n_microbatches,
    )
    return StageMaker(
        config=config, plan=plan, resolved=resolved, skeleton=skeleton,
        output_class=getattr(transformers.modeling_outputs, resolved.head.output_class),
        make_stages=lambda specs: [build_stage(skeleton, resolved, spec) for spec in specs],
    )
