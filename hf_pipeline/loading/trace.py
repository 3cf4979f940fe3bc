"""Generic fallback for architectures without a recipe: split the model with ``torch.export``.

``torch.distributed.pipelining.pipeline()`` traces the whole HF model (on the meta device, with
``use_cache=False``) into one graph and cuts it before chosen submodules, keeping the original
parameter names. The cut points are found without naming any architecture: the repeated blocks
are the largest ``nn.ModuleList`` of same-class modules, and the plan (``split="auto"``, ``"uniform"``
or a list of block names, looped or V layout) is the same :class:`~hf_pipeline.planning.plan.StagePlan` the
recipes use.

What this path can and cannot do:
- Forward and training run through torch's own schedules, like recipe stages: every schedule of
  :data:`hf_pipeline.planning.schedules.SCHEDULES`, one stage per rank (GPipe, 1F1B) or several, looped
  (interleaved 1F1B, looped BFS, interleaved zero-bubble) or V-shaped (ZBV zero-bubble,
  DualPipeV). The zero-bubble split of backward into input and weight gradients defers the
  graph's ``aten.linear`` weight gradients to W, as for recipe stages (``weight_pass.py``).
- Seq2seq models given ``labels`` and no decoder inputs get ``decoder_input_ids`` from the
  model's own ``prepare_decoder_input_ids_from_labels``, as transformers' forward does.
- No KV cache (the tracer fails with one), hence no pipelined ``generate()``: that needs a recipe.

When a new trace is made. ``torch.export`` specializes on shapes, so a trace is made per key
(train/eval mode, grad mode, and the name, shape and dtype of every tensor input) and kept in a
small LRU (``HF_PIPELINE_RUNTIME_CACHE`` entries, 8 by default, as the runtime cache). The shapes are
the ones one stage call sees:
- ``model(**inputs)`` on several ranks: one microbatch. ``forward`` first pads the batch to a
  multiple of ``n_microbatches`` (repeating the last row), so the rows per microbatch are
  ``ceil(batch / n_microbatches)``: with ``n_microbatches=4``, batches of 5 to 8 rows of one
  length share one trace (and one torch runtime), 9 rows make a new one, and so does every new
  sequence length (pad the length to a few fixed sizes to bound the traces).
- ``model(**inputs)`` on one rank (all stages local): the whole batch, unpadded.
- ``train_step``: one microbatch of ``batch / (dp_size * n_microbatches)`` rows (no padding: the
  batch must divide), traced in training mode with grad on, so not shared with ``forward``.
A new trace runs ``torch.export`` of the whole meta model on every rank (no communication)
and keeps only graphs: the weights are loaded once, and every trace
is wired to the same Parameter objects, so optimizers and gradients see one set of tensors.
Tracing with symbolic batch sizes would avoid the re-traces, but torch 2.13's ``pipeline()`` exports
with static shapes only (it passes no ``dynamic_shapes`` to ``torch.export``).

Every rank traces the whole model on its own (no communication): each stage gets all the model
inputs as keyword arguments, so whichever local stage first sees a new signature traces it.

Example (``torchrun --nproc_per_node 2 script.py``):
    >>> model = AutoModelForCausalLM.from_pretrained(opt_path, pipeline=True, split_method="trace")
    >>> print(model.plan)
    >>> model(input_ids=ids, attention_mask=mask).logits.shape
    torch.Size([8, 16, 50272])
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections import OrderedDict
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from ..compat import pytree
from ..errors import TraceError
from ..families.glue import Glue
from ..planning.options import PipelineOptions
from ..planning.plan import StageSpec, make_plan
from ..planning.resolve import ResolvedRecipe
from ..runtime.cache import cache_size
from .stages import StageMaker, meta_model, prune
from .traced_graphs import StageRunner, defer_linears, retarget_devices, stage_flows
from .traced_plan import RECIPE_HOWTO, costing_recipe, find_blocks, split_fqn, tied_groups, traced_spec

__all__ = ["StageTracer", "TraceError", "TracedStage", "find_blocks", "trace_front_end"]


@dataclasses.dataclass(kw_only=True)
class _Trace:
    runners: dict[int, StageRunner]  # this rank's stages
    out_spec: pytree.TreeSpec  # structure of the HF model's output (e.g. CausalLMOutputWithPast)
    state: dict[int, tuple[str, ...]]  # every stage's parameter and buffer names


def _first_lines(error: BaseException, n: int = 4) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n    ".join(lines[:n])


class StageTracer:
    """Traces the meta model per input signature and wires the local stages to the loaded weights."""

    def __init__(
        self,
        skeleton: nn.Module,
        split_points: Sequence[str],
        num_stages: int,
        local: Sequence[int],
        device: torch.device,
    ):
        self.skeleton = skeleton
        self.split_points = tuple(split_points)
        self.num_stages = num_stages
        self.local = tuple(local)
        self.device = device
        self.holders: dict[int, TracedStage] = {}
        # Bounded like the runtime cache (dynamic padding makes every batch a new shape): the oldest
        # trace is dropped, and traced again if its shape comes back.
        self.traces: OrderedDict[Any, _Trace] = OrderedDict()
        self.max_traces = cache_size()
        self.output_class: type | None = None  # the HF output class (e.g. CausalLMOutputWithPast)

    def trace(self, example: dict[str, torch.Tensor], *, training: bool, install: bool = True) -> _Trace:
        """Trace ``skeleton(**example)`` split at the split points (one microbatch's shapes).

        ``install``: wire this rank's stage graphs to the loaded weights (every trace after the
        load-time one, which only finds out which tensors each stage holds).
        """
        pipe, out_spec = self._export(example, training=training, untie=install)
        return self._stages_of(pipe, out_spec, install=install)

    def _export(self, example: dict[str, torch.Tensor], *, training: bool, untie: bool):
        """torch's split ``Pipe`` of the skeleton for ``example`` and the structure of the model's output."""
        model = self.skeleton
        name = type(model).__name__
        specs: list[pytree.TreeSpec] = []
        # The output structure is not kept by the split graph (it returns flat leaves): record it
        # while export runs the model's Python forward.
        hook = model.register_forward_hook(lambda mod, args, out: specs.append(pytree.tree_structure(out)))
        was_training = model.training
        model.train(training)
        # Note: torch.export's unflatten loses a tied weight when its module is called more than once
        # (GPT-2 with token_type_ids embeds them with wte, which is also the LM head): "InterpreterModule
        # has no attribute 'weight'". A runtime trace is made with the ties broken on the meta model;
        # the graphs are the same computation, and _install wires every name to the stage's one
        # loaded Parameter, so the tie holds where the weights live.
        untied = self._untie() if untie else []
        try:
            example = {k: v.detach().cpu() for k, v in example.items()}  # values do not matter, shapes do
            try:
                pipe = pipeline(
                    model,
                    mb_args=(),
                    mb_kwargs=example,
                    split_spec={p: SplitPoint.BEGINNING for p in self.split_points},
                )
            except Exception as e:  # noqa: BLE001 - every tracer failure becomes one message that says what to do
                cause = e.__cause__ or e
                model_type = getattr(model.config, "model_type", "?")
                raise TraceError(
                    f"torch.export could not trace {name} (model_type {model_type!r}) to split it into pipeline "
                    f"stages:\n    {_first_lines(cause)}\nTracing needs a graph without data-dependent control flow "
                    "and ops that accept meta-device weights (tracing runs without the real weights); to pipeline "
                    f"this model, {RECIPE_HOWTO}"
                ) from e
        finally:
            hook.remove()
            model.train(was_training)
            for mod, attr, p in untied:
                setattr(mod, attr, p)
            # pipeline() wraps each split module's forward in place; undo it so the skeleton can be traced again.
            for p in self.split_points:
                mod = model.get_submodule(p)
                mod.__dict__.pop("forward", None)
                mod.__dict__.pop("_orig_forward", None)
        if not specs:
            raise TraceError(f"tracing {name} did not run its forward")
        return pipe, specs[0]

    def _stages_of(self, pipe, out_spec, *, install: bool) -> _Trace:
        """Every stage's tensor names and this rank's stage runners from a split ``Pipe``."""
        model = self.skeleton
        name = type(model).__name__
        flows = stage_flows(pipe.split_gm, self.num_stages)
        known = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
            n for n, _ in model.named_buffers(remove_duplicate=False)
        }
        state = {}
        runners = {}
        for k in range(self.num_stages):
            gm = pipe.get_stage_module(k)
            state[k] = tuple(
                dict.fromkeys(
                    [n for n, _ in gm.named_parameters(remove_duplicate=False)]
                    + [n for n, _ in gm.named_buffers(remove_duplicate=False)]
                )
            )
            for b, buf in gm.named_buffers(remove_duplicate=False):
                if buf.is_meta and b not in known:
                    # A constant the tracer computed from a meta weight (Falcon's index tensors built
                    # on the weight's device): its value is lost, so the graph cannot run.
                    raise TraceError(
                        f"the trace of {name} captured the constant {b!r} on the meta device (computed from a weight "
                        "while tracing without the real weights), so it cannot run; to pipeline this model, "
                        f"{RECIPE_HOWTO}"
                    )
            if k in self.local:
                if install:
                    self._install(gm, k)
                runners[k] = StageRunner(gm, flows[k], k)
        return _Trace(runners=runners, out_spec=out_spec, state=state)

    def _untie(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """Give every alias of a tied skeleton parameter its own meta Parameter; returns what to restore."""
        restore = []
        for group in tied_groups(self.skeleton):
            for name in group[1:]:
                owner, attr = split_fqn(name)
                mod = self.skeleton.get_submodule(owner)
                p = getattr(mod, attr)
                restore.append((mod, attr, p))
                setattr(mod, attr, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
        return restore

    def _install(self, gm: nn.Module, k: int) -> None:
        """Give a freshly traced stage graph this stage's loaded parameters and buffers, on the device."""
        holder = self.holders[k]
        params = dict(holder.named_parameters(remove_duplicate=False))
        buffers = dict(holder.named_buffers(remove_duplicate=False))
        for name, _ in list(gm.named_parameters(remove_duplicate=False)):
            # A module called twice (GPT-2's wte for the ids and for token_type_ids) is unflattened
            # as a second copy, ``transformer.wte@1``: it is the same module, with the same weights.
            loaded = re.sub(r"@\d+(?=\.|$)", "", name)
            if loaded not in params:
                raise TraceError(
                    f"a new trace of stage {k} uses parameter {name!r}, which this stage did not load (its parameters "
                    "were found by tracing at load time with input_ids and attention_mask); pass the same kinds of "
                    "inputs"
                )
            owner, attr = split_fqn(name)
            setattr(gm.get_submodule(owner), attr, params[loaded])
        for name, buf in list(gm.named_buffers(remove_duplicate=False)):
            owner, attr = split_fqn(name)
            loaded = re.sub(r"@\d+(?=\.|$)", "", name)
            if loaded in buffers:
                value = buffers[loaded]
            else:
                value = buf.to(self.device)
            setattr(gm.get_submodule(owner), attr, value)
        retarget_devices(gm, self.device)
        defer_linears(gm)

    def runner(self, k: int, inputs: dict[str, Any], *, training: bool) -> StageRunner:
        example: dict[str, torch.Tensor] = {}
        for key, v in inputs.items():
            if v is None or key == "labels":
                continue  # the loss is the schedule's loss_fn, not part of the traced graph
            if not isinstance(v, torch.Tensor):
                raise TraceError(
                    f"a traced model takes tensor inputs only, got {key}={v!r}; options like logits_to_keep or a cache "
                    f"need a recipe ({RECIPE_HOWTO})"
                )
            example[key] = v
        key = (
            training,
            torch.is_grad_enabled(),
            tuple((k_, tuple(v.shape), v.dtype) for k_, v in sorted(example.items())),
        )
        trace = self.traces.get(key)
        if trace is None:
            trace = self.trace(example, training=training)  # under the caller's grad mode, part of the key
            self.traces[key] = trace
            while len(self.traces) > max(1, self.max_traces):
                self.traces.popitem(last=False)
        else:
            self.traces.move_to_end(key)
        return trace.runners[k]


class _TracedGlue(Glue):
    """Whole-batch input preparation for traced stages: only what transformers does before the graph.

    A seq2seq model given ``labels`` and no decoder inputs makes ``decoder_input_ids`` from the
    labels inside its forward; the loss is not part of the traced graph (``labels`` are the
    schedule's targets), so the shift happens here, through the model's own public method.
    """

    def prepare_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        shift = getattr(model, "prepare_decoder_input_ids_from_labels", None)
        if (
            getattr(model.config, "is_encoder_decoder", False) and callable(shift) and inputs.get("labels") is not None
            and inputs.get("decoder_input_ids") is None and inputs.get("decoder_inputs_embeds") is None
        ):
            inputs = dict(inputs, decoder_input_ids=shift(labels=inputs["labels"]))
        return inputs


class TracedStage(nn.Module):
    """One traced pipeline stage: its parameters and buffers under their checkpoint names.

    ``stage(*received, **inputs)`` runs the traced graph for the shapes of ``inputs`` (tracing it
    the first time they are seen). The module tree is a pruned copy of the HF model holding only
    the tensors the traced stage uses, so ``named_parameters()`` yields checkpoint keys.
    """

    def __init__(self, root: nn.Module, spec: StageSpec, resolved: ResolvedRecipe, tracer: StageTracer):
        super().__init__()
        for name, child in root.named_children():
            self.add_module(name, child)
        for name, p in root.named_parameters(recurse=False, remove_duplicate=False):
            self.register_parameter(name, p)
        self.config = root.config
        self.spec = spec
        self.resolved = resolved
        self.glue = _TracedGlue()
        self.tracer = tracer  # shared by the rank's stages (a plain object, not a submodule)

    def forward(self, *received: torch.Tensor, **inputs: Any):
        return self.tracer.runner(self.spec.index, inputs, training=self.training)(*received, **inputs)

    def extra_repr(self) -> str:
        return f"stage={self.spec.index}, rank={self.spec.rank}, blocks={len(self.spec.blocks)}, traced"


def _holder(skeleton: nn.Module, names: Sequence[str]) -> nn.Module:
    """A copy of the meta model pruned to exactly the named parameters and buffers."""
    root = copy.deepcopy(skeleton)
    present = {n for n, _ in root.named_parameters(remove_duplicate=False)} | {
        n for n, _ in root.named_buffers(remove_duplicate=False)
    }
    names = [n for n in names if n in present]  # lifted constants live in the graph only
    keep = set(names)
    prune(root, {split_fqn(n)[0] for n in names})
    for name, _ in list(root.named_parameters(remove_duplicate=False)):
        if name not in keep:
            owner, attr = split_fqn(name)
            _unregister(root.get_submodule(owner), attr)
    for name, _ in list(root.named_buffers(remove_duplicate=False)):
        if name not in keep:
            owner, attr = split_fqn(name)
            _unregister(root.get_submodule(owner), attr)
    return root


def _unregister(module: nn.Module, attr: str) -> None:
    """Remove ``module``'s own parameter or buffer ``attr``, if it still has it (a shared module is met twice)."""
    own = dict(module.named_parameters(recurse=False, remove_duplicate=False))
    own.update(module.named_buffers(recurse=False, remove_duplicate=False))
    if attr in own:
        delattr(module, attr)


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the meta model's floating parameters the load dtype (ties kept), buffers untouched.

    The graph is traced with these dtypes burned in (mask fill values, casts back to the weight
    dtype), so it has to see the dtype the weights will run in. Buffers keep theirs, as in
    transformers (rotary ``inv_freq`` stays fp32).
    """
    made: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for key, p in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
            setattr(mod, key, made[id(p)])


def _load_example(config) -> dict[str, torch.Tensor]:
    """Inputs for the load-time trace, which finds each stage's parameters (shapes are irrelevant)."""
    length = min(8, int(getattr(config, "max_position_embeddings", 0) or 8))
    ids = (torch.arange(length) % int(getattr(config, "vocab_size", 2) or 2)).unsqueeze(0)  # (1, T)
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        example["decoder_input_ids"] = ids.clone()
    return example


def trace_front_end(config, options: PipelineOptions, *, device: torch.device) -> StageMaker:
    """The tracer front end: plan the model from its module tree and split it with torch.export.

    Returns the same :class:`~hf_pipeline.loading.stages.StageMaker` as the recipe front end: the loader
    (:mod:`.loader`) then reads and materialises the stages' tensors exactly as for recipe stages,
    and wires this tracer's graphs to them when they are loaded.
    """
    config = copy.deepcopy(config)
    config.use_cache = False  # torch.export cannot trace HF's KV cache
    skeleton = meta_model(config, options.model_class)
    _cast_parameters(skeleton, options.dtype)
    blocks_fqn = find_blocks(skeleton)
    resolved = costing_recipe(skeleton, blocks_fqn)
    plan = make_plan(
        skeleton, resolved, pp_size=options.pp_size, virtual_stages=options.virtual_stages,
        layout=options.schedule.layout, split=options.split, dtype=options.dtype,
        schedule=options.schedule, n_microbatches=options.n_microbatches,
    )
    tracer = StageTracer(skeleton, list(plan.split_points), plan.num_stages, (), device)
    first = tracer.trace(_load_example(config), training=False, install=False)
    out = pytree.tree_unflatten([torch.empty(0)] * first.out_spec.num_leaves, first.out_spec)
    keys = tuple(out.keys()) if hasattr(out, "keys") else ()
    if len(keys) != first.out_spec.num_leaves:
        raise TraceError(
            f"{type(skeleton).__name__} returns {type(out).__name__} with {first.out_spec.num_leaves} tensors for "
            f"{len(keys)} fields {list(keys)}; the traced path returns one tensor per field: turn off "
            f"output_hidden_states / output_attentions in the config"
        )
    tracer.output_class = type(out)
    resolved = dataclasses.replace(
        resolved, head=dataclasses.replace(resolved.head, outputs=keys, output_class=type(out).__name__)
    )
    itemsize = torch.empty((), dtype=options.dtype).element_size()
    blocks = resolved.stacks[0].blocks
    stages = tuple(traced_spec(skeleton, s, first.state[s.index], blocks, itemsize) for s in plan.stages)
    plan = dataclasses.replace(plan, stages=stages, _by_rank={})

    def make_stages(specs: Sequence[StageSpec]) -> list[nn.Module]:
        tracer.local = tuple(s.index for s in specs)
        return [TracedStage(_holder(skeleton, first.state[s.index]), s, resolved, tracer) for s in specs]

    def on_loaded(loaded: Sequence[nn.Module]) -> None:
        for holder in loaded:
            tracer.holders[holder.spec.index] = holder

    return StageMaker(
        config=config, plan=plan, resolved=resolved, skeleton=skeleton, output_class=type(out),
        make_stages=make_stages, on_loaded=on_loaded,
        generate_refusal=(
            f"{plan.model_class} was split by torch.export tracing, which works without a KV cache only, so it cannot "
            f"generate. KV-cached pipelined generation needs a recipe; to generate with this model, {RECIPE_HOWTO}"
        ),
    )
