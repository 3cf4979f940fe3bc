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
small LRU (``HF_PIPELINE_RUNTIME_CACHE`` entries, 8 by default, as the runtime cache). The shapes are the ones one stage call sees:
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
import operator
import re
from collections import OrderedDict
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.distributed.pipelining import SplitPoint, pipeline

from ..compat import pytree
from ..errors import TraceError
from ..families.glue import Glue
from ..families.recipe import HeadSpec, Recipe, StackSpec
from ..planning.options import PipelineOptions
from ..planning.plan import ResolvedRecipe, ResolvedStack, StageSpec, make_plan, module_stats
from ..runtime import weight_pass
from ..runtime.cache import cache_size
from .stages import StageBuild, meta_model, prune

__all__ = ["TraceError", "find_blocks", "trace_front_end"]

# HF's own ``model.loss_type`` -> the loss names of hf_pipeline.families.losses (same as the recipes' ``loss``).
_LOSSES = {
    "ForCausalLM": "causal_lm",
    "ForMaskedLM": "masked_lm",
    "ForSequenceClassification": "sequence_classification",
    "ForTokenClassification": "token_classification",
    "ForQuestionAnswering": "question_answering",
    "ForConditionalGeneration": "seq2seq_lm",
}

_RECIPE_HOWTO = (
    "write a recipe: a TOML file like model_recipes/llama.toml naming the embeddings, the block list, the final "
    "modules and the heads (a new family also needs its few lines of forward glue in hf_pipeline/families/glue.py, which "
    "run the blocks with a transformers Cache), register it with hf_pipeline.register_recipe(path) and load with "
    "split_method='recipe' or 'auto'"
)


# ----------------------------------------------------------------------------- the split
def find_blocks(model: nn.Module) -> str:
    """FQN of the model's repeated blocks: its largest ``nn.ModuleList`` of same-class modules.

    "Largest" is by parameter count (a model may hold several lists: T5 has an encoder and a
    decoder stack, some models keep small lists of heads or norms).

    Example:
        >>> find_blocks(meta_model(opt_config, "AutoModelForCausalLM"))
        'model.decoder.layers'
    """
    best: tuple[int, str] | None = None
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(child) for child in mod}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size and (best is None or size > best[0]):
            best = (size, fqn)
    if best is None:
        raise TraceError(
            f"{type(model).__name__} has no nn.ModuleList of same-class blocks with parameters, so there is nothing "
            f"to cut between pipeline stages; {_RECIPE_HOWTO}"
        )
    return best[1]


def _tied_groups(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    # Parameters that are one tensor in the model (tied embeddings): the loader reads any member's
    # checkpoint key for all of them, and a stage holding several makes them one Parameter again.
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return tuple(tuple(names) for names in by_id.values() if len(names) > 1)


def _costing_recipe(model: nn.Module, blocks_fqn: str) -> ResolvedRecipe:
    """A recipe-shaped description of ``model`` from its module tree, for the stage plan.

    Modules registered before the block list are costed to the first block, those after it to the
    last (HF models register their modules in execution order). This only balances the split: what
    each stage really holds comes from the trace (:func:`_traced_spec`).
    """
    container = model.get_submodule(blocks_fqn)
    blocks = tuple(f"{blocks_fqn}.{name}" for name, _ in container.named_children())
    before: list[str] = []
    after: list[str] = []
    seen_blocks = False
    for fqn, mod in model.named_modules():
        if fqn == blocks_fqn:
            seen_blocks = True
            continue
        if fqn.startswith(blocks_fqn + ".") or not any(True for _ in mod.parameters(recurse=False)):
            continue
        (after if seen_blocks else before).append(fqn)
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    class_name = type(model).__name__
    suffix = getattr(model, "loss_type", None) or (re.search(r"For\w+$", class_name) or re.search(r"Model$", class_name) or [class_name])[0]
    head = HeadSpec(suffix=suffix, modules=(), outputs=(), output_class="", loss=_LOSSES.get(getattr(model, "loss_type", None) or ""))
    tied = _tied_groups(model)
    config = model.config
    recipe = Recipe(
        source=f"<torch.export trace of {class_name}>",
        model_types=(str(getattr(config, "model_type", "")),),
        glue="",
        flows=(),
        stacks=(StackSpec(name="blocks", blocks=blocks_fqn),),
        heads={suffix: head},
        tied=tied,
    )
    stack = ResolvedStack(name="blocks", blocks=blocks, embed=tuple(before), final=tuple(after), every_stage=())
    return ResolvedRecipe(recipe=recipe, class_name=class_name, base=base, stacks=(stack,), head=head, tied=tied)


def _owner(name: str) -> tuple[str, str]:
    owner, _, attr = name.rpartition(".")
    return owner, attr


def _traced_spec(model: nn.Module, spec: StageSpec, state: Sequence[str], blocks: Sequence[str], itemsize: int, seq_len: int = 256) -> StageSpec:
    """``spec`` with ``modules``, sizes and FLOPs of what the traced stage really holds."""
    # Name each held tensor by the shallowest module the stage holds entirely (a block, an
    # embedding, T5's whole encoder), as a recipe's module list does.
    held = set(state)
    under: dict[str, set[str]] = {}
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + [n for n, _ in model.named_buffers(remove_duplicate=False)]
    for n in names:
        parts = n.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            under.setdefault(".".join(parts[:i]), set()).add(n)
    known = set(names)
    # A tied tensor is held under all its names (BERT's word embeddings are also the MLM decoder's
    # weight). An alias whose module the stage holds only in part (the decoder without its bias) is
    # not named: a module in ``modules`` claims every tensor under it, and claiming the decoder's
    # bias on this stage would make the gradient sync of this rank and the bias' real holders
    # disagree on which tensors they reduce.
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for n, t in tensors.items():
        aliases.setdefault(id(t), []).append(n)

    def whole(name: str) -> bool:
        owner, _ = _owner(name)
        return any(owner == b or owner.startswith(b + ".") for b in blocks) or under.get(owner, {name}) <= held

    modules: dict[str, None] = {}
    for name in state:
        if name in known and not whole(name) and any(a != name and a in held and whole(a) for a in aliases[id(tensors[name])]):
            continue  # held, and named, through another alias
        owner, _ = _owner(name)
        if name not in known:
            continue  # a constant the trace lifted: it lives in the graph only
        if not owner:
            modules[""] = None  # a tensor of the root module itself
            continue
        block = next((b for b in blocks if owner == b or owner.startswith(b + ".")), None)
        if block is not None and block not in spec.blocks:
            raise TraceError(f"the trace put {name!r} on stage {spec.index}, which does not run {block}")
        if block is not None:
            modules[block] = None
            continue
        parts = owner.split(".")
        modules[next((a for a in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if under[a] <= held), owner)] = None
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    mods = tuple(sorted(modules, key=lambda m: order.get(m, len(order))))
    lookup = dict(model.named_parameters(remove_duplicate=False))
    distinct = {id(lookup[n]): lookup[n] for n in state if n in lookup}  # a tied tensor counts once
    nparams = sum(t.numel() for t in distinct.values())
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 0)
    _, _, f_blocks = module_stats(model, list(spec.blocks), itemsize, seq_len, hidden, len(spec.blocks))
    others = [m for m in mods if m and m not in spec.blocks]
    _, _, f_other = module_stats(model, others, itemsize, seq_len, hidden, 0)
    return dataclasses.replace(spec, modules=mods, params=nparams, nbytes=nparams * itemsize, flops_per_token=f_blocks + f_other)


# ----------------------------------------------------------------------------- tracing
@dataclasses.dataclass(frozen=True, kw_only=True)
class _StageFlow:
    """How one traced stage is wired: where each graph argument comes from, what it passes on."""

    call: str  # node name of the stage's call in the split graph
    args: tuple[tuple[str, str], ...]  # ("input", model input name) or ("value", node name)
    getitems: tuple[tuple[str, int], ...]  # (node name, index) of the stage's outputs used later
    carry_in: tuple[str, ...]  # node names received from the previous stage, in order
    carry_out: tuple[str, ...]  # node names sent to the next stage (empty on the last)
    outputs: tuple[tuple[str, str], ...] | None  # last stage: the model output leaves


def _flows(split_gm: fx.GraphModule, num_stages: int) -> list[_StageFlow]:
    """Per-stage wiring from the split graph.

    Note: the traced graph may feed a value from stage 0 straight to stage 2 (an attention mask,
    rotary cos/sin), but torch 2.13's runtime only moves tensors between adjacent stages, so such
    values are carried through the stages in between. Model inputs are not carried: every stage
    gets them as keyword arguments.
    """
    calls: list[fx.Node] = []
    getitems: dict[str, list[tuple[str, int]]] = {}
    producer: dict[str, int] = {}
    consumers: dict[str, set[int]] = {}
    order: dict[str, int] = {}
    out_refs: list[tuple[str, str]] = []

    def ref(node: Any, user: int) -> tuple[str, str]:
        if not isinstance(node, fx.Node):
            raise TraceError(f"the split graph passes a constant {node!r} between stages; only tensors can cross stages")
        if node.op == "placeholder":
            return ("input", node.target)
        consumers.setdefault(node.name, set()).add(user)
        return ("value", node.name)

    for i, node in enumerate(split_gm.graph.nodes):
        order[node.name] = i
        if node.op == "call_module":
            k = len(calls)
            if node.kwargs:
                raise TraceError(f"stage {k} of the split graph takes keyword arguments {list(node.kwargs)}")
            calls.append(node)
            producer[node.name] = k
        elif node.op == "call_function" and node.target is operator.getitem:
            src, idx = node.args
            getitems.setdefault(src.name, []).append((node.name, idx))
            producer[node.name] = producer[src.name]
        elif node.op == "output":
            for leaf in pytree.tree_leaves(node.args[0]):
                out_refs.append(ref(leaf, num_stages))
        elif node.op != "placeholder":
            raise TraceError(f"unexpected node {node.format_node()} in the split graph")
    if len(calls) != num_stages:
        raise TraceError(
            f"the trace produced {len(calls)} stage(s), not {num_stages}: a split point was never reached in forward. "
            f"Pass split= with blocks that forward runs"
        )
    args = [tuple(ref(a, k) for a in call.args) for k, call in enumerate(calls)]
    flows = []
    carry: tuple[str, ...] = ()
    for k, call in enumerate(calls):
        last = k == num_stages - 1
        live = sorted(
            (v for v, users in consumers.items() if producer[v] <= k and max(users) > k), key=order.__getitem__
        )
        flows.append(
            _StageFlow(
                call=call.name,
                args=args[k],
                getitems=tuple(getitems.get(call.name, ())),
                carry_in=carry,
                carry_out=() if last else tuple(live),
                outputs=tuple(out_refs) if last else None,
            )
        )
        carry = () if last else tuple(live)
    return flows


def _rewrite_graphs(root: nn.Module, rewrite) -> None:
    """Call ``rewrite(graph)`` on every fx graph under ``root`` (unflattened stage modules keep one
    each); recompile the modules whose graph it changed (it returns True then)."""
    for mod in root.modules():
        graph = mod.__dict__.get("graph") or getattr(mod, "_graph", None)
        if isinstance(graph, fx.Graph) and rewrite(graph):
            for gm in (mod, mod.__dict__.get("graph_module")):
                if isinstance(gm, fx.GraphModule):
                    gm.recompile()


def _retarget_devices(root: nn.Module, device: torch.device) -> None:
    """Point every device the trace burned into the graphs (``arange(device=...)``, ``mask.to(weight.device)``) at ``device``.

    Tracing runs on meta weights with CPU inputs, so graphs name ``meta`` and ``cpu``. torch's own
    fix (``Pipe.build_stage``) rewrites only ``device=`` keyword arguments; ``aten.to.device`` takes
    the device positionally, so every ``torch.device`` argument is rewritten here.
    """

    def retarget(graph: fx.Graph) -> bool:
        changed = False

        def fix(a: Any) -> Any:
            nonlocal changed
            if isinstance(a, torch.device) and a != device:
                changed = True
                return device
            return a

        for node in graph.nodes:
            node.args, node.kwargs = fx.node.map_aggregate(node.args, fix), fx.node.map_aggregate(node.kwargs, fix)
        return changed

    _rewrite_graphs(root, retarget)


def _defer_linears(root: nn.Module) -> None:
    """Point the graphs' ``aten.linear`` calls at ``weight_pass.linear``: in zero-bubble steps it
    defers the weight gradient to W, as recipe stages' linear layers do."""

    def route(graph: fx.Graph) -> bool:
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
        for node in nodes:
            node.target = weight_pass.linear
        return bool(nodes)

    _rewrite_graphs(root, route)


class _StageRunner(nn.Module):
    """Runs one traced stage graph: picks its arguments from received tensors and model inputs."""

    def __init__(self, graph: nn.Module, flow: _StageFlow, index: int):
        super().__init__()
        self.graph = graph
        self.flow = flow
        self.index = index

    def forward(self, *received: torch.Tensor, **inputs: Any):
        flow = self.flow
        if len(received) != len(flow.carry_in):
            raise TraceError(f"stage {self.index} expects {len(flow.carry_in)} tensor(s) from the previous stage, got {len(received)}")
        env = dict(zip(flow.carry_in, received))
        args = [inputs[name] if kind == "input" else env[name] for kind, name in flow.args]
        raw = self.graph(*args)
        env[flow.call] = raw
        for name, idx in flow.getitems:
            env[name] = raw[idx]
        if flow.outputs is not None:
            leaves = tuple(inputs[name] if kind == "input" else env[name] for kind, name in flow.outputs)
            return leaves[0] if len(leaves) == 1 else leaves
        out = tuple(env[name] for name in flow.carry_out)
        for name, t in zip(flow.carry_out, out):
            if not isinstance(t, torch.Tensor):
                raise TraceError(f"stage {self.index} would send {name} = {t!r} to the next stage; only tensors can cross stages")
        # A traced value may be a view (T5's position bias is an expanded slice); send and receive
        # buffers must be dense, and .contiguous() is a no-op (same tensor, same autograd) when it is.
        return tuple(t.contiguous() for t in out)


@dataclasses.dataclass(kw_only=True)
class _Trace:
    runners: dict[int, _StageRunner]  # this rank's stages
    out_spec: pytree.TreeSpec  # structure of the HF model's output (e.g. CausalLMOutputWithPast)
    state: dict[int, tuple[str, ...]]  # every stage's parameter and buffer names


def _first_lines(error: BaseException, n: int = 4) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    lines = [l for l in text.splitlines() if l.strip()]
    return "\n    ".join(lines[:n])


class _Tracer:
    """Traces the meta model per input signature and wires the local stages to the loaded weights."""

    def __init__(self, skeleton: nn.Module, split_points: Sequence[str], num_stages: int, local: Sequence[int], device: torch.device):
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
        """Trace ``skeleton(**example)`` split at the split points (one microbatch's shapes)."""
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
        untied = self._untie() if install else []
        try:
            example = {k: v.detach().cpu() for k, v in example.items()}  # values do not matter, shapes do
            try:
                pipe = pipeline(model, mb_args=(), mb_kwargs=example, split_spec={p: SplitPoint.BEGINNING for p in self.split_points})
            except Exception as e:  # noqa: BLE001 - every tracer failure becomes one message that says what to do
                cause = e.__cause__ or e
                raise TraceError(
                    f"torch.export could not trace {name} (model_type {getattr(model.config, 'model_type', '?')!r}) to split it "
                    f"into pipeline stages:\n    {_first_lines(cause)}\nTracing needs a graph without data-dependent "
                    f"control flow and ops that accept meta-device weights (tracing runs without the real weights); to pipeline "
                    f"this model, {_RECIPE_HOWTO}"
                ) from e
        finally:
            hook.remove()
            model.train(was_training)
            for mod, attr, p in untied:
                mod._parameters[attr] = p
            # pipeline() wraps each split module's forward in place; undo it so the skeleton can be traced again.
            for p in self.split_points:
                mod = model.get_submodule(p)
                mod.__dict__.pop("forward", None)
                mod.__dict__.pop("_orig_forward", None)
        if not specs:
            raise TraceError(f"tracing {name} did not run its forward")
        flows = _flows(pipe.split_gm, self.num_stages)
        known = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers(remove_duplicate=False)}
        state = {}
        runners = {}
        for k in range(self.num_stages):
            gm = pipe.get_stage_module(k)
            state[k] = tuple(dict.fromkeys([n for n, _ in gm.named_parameters(remove_duplicate=False)] + [n for n, _ in gm.named_buffers(remove_duplicate=False)]))
            for b, buf in gm.named_buffers(remove_duplicate=False):
                if buf.is_meta and b not in known:
                    # A constant the tracer computed from a meta weight (Falcon's index tensors built
                    # on the weight's device): its value is lost, so the graph cannot run.
                    raise TraceError(
                        f"the trace of {name} captured the constant {b!r} on the meta device (computed from a weight "
                        f"while tracing without the real weights), so it cannot run; to pipeline this model, {_RECIPE_HOWTO}"
                    )
            if k in self.local:
                if install:
                    self._install(gm, k)
                runners[k] = _StageRunner(gm, flows[k], k)
        return _Trace(runners=runners, out_spec=specs[0], state=state)

    def _untie(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """Give every alias of a tied skeleton parameter its own meta Parameter; returns what to restore."""
        restore = []
        for group in _tied_groups(self.skeleton):
            for name in group[1:]:
                owner, attr = _owner(name)
                mod = self.skeleton.get_submodule(owner)
                p = mod._parameters[attr]
                restore.append((mod, attr, p))
                mod._parameters[attr] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
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
                    f"a new trace of stage {k} uses parameter {name!r}, which this stage did not load (its parameters were "
                    f"found by tracing at load time with input_ids and attention_mask); pass the same kinds of inputs"
                )
            owner, attr = _owner(name)
            gm.get_submodule(owner)._parameters[attr] = params[loaded]
        for name, buf in list(gm.named_buffers(remove_duplicate=False)):
            owner, attr = _owner(name)
            loaded = re.sub(r"@\d+(?=\.|$)", "", name)
            if loaded in buffers:
                value = buffers[loaded]
            else:
                value = buf.to(self.device)
            gm.get_submodule(owner)._buffers[attr] = value
        _retarget_devices(gm, self.device)
        _defer_linears(gm)

    def runner(self, k: int, inputs: dict[str, Any], *, training: bool) -> _StageRunner:
        example: dict[str, torch.Tensor] = {}
        for key, v in inputs.items():
            if v is None or key == "labels":
                continue  # the loss is the schedule's loss_fn, not part of the traced graph
            if not isinstance(v, torch.Tensor):
                raise TraceError(
                    f"a traced model takes tensor inputs only, got {key}={v!r}; options like logits_to_keep or a cache "
                    f"need a recipe ({_RECIPE_HOWTO})"
                )
            example[key] = v
        key = (training, torch.is_grad_enabled(), tuple((k_, tuple(v.shape), v.dtype) for k_, v in sorted(example.items())))
        trace = self.traces.get(key)
        if trace is None:
            trace = self.trace(example, training=training)  # under the caller's grad mode, part of the key
            self.traces[key] = trace
            while len(self.traces) > max(1, self.max_traces):
                self.traces.popitem(last=False)
        else:
            self.traces.move_to_end(key)
        return trace.runners[k]


# ----------------------------------------------------------------------------- stages and model
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

    def __init__(self, root: nn.Module, spec: StageSpec, resolved: ResolvedRecipe, tracer: _Tracer):
        super().__init__()
        for name, child in root.named_children():
            self.add_module(name, child)
        for name, p in root._parameters.items():
            self.register_parameter(name, p)
        self.config = root.config
        self.spec = spec
        self.resolved = resolved
        self.glue = _TracedGlue()
        object.__setattr__(self, "_tracer", tracer)  # shared by the rank's stages, not a submodule

    def forward(self, *received: torch.Tensor, **inputs: Any):
        return self._tracer.runner(self.spec.index, inputs, training=self.training)(*received, **inputs)

    def extra_repr(self) -> str:
        return f"stage={self.spec.index}, rank={self.spec.rank}, blocks={len(self.spec.blocks)}, traced"


def _holder(skeleton: nn.Module, names: Sequence[str]) -> nn.Module:
    """A copy of the meta model pruned to exactly the named parameters and buffers."""
    root = copy.deepcopy(skeleton)
    present = {n for n, _ in root.named_parameters(remove_duplicate=False)} | {n for n, _ in root.named_buffers(remove_duplicate=False)}
    names = [n for n in names if n in present]  # lifted constants live in the graph only
    keep = set(names)
    prune(root, {_owner(n)[0] for n in names})
    for name, _ in list(root.named_parameters(remove_duplicate=False)):
        if name not in keep:
            owner, attr = _owner(name)
            root.get_submodule(owner)._parameters.pop(attr, None)
    for name, _ in list(root.named_buffers(remove_duplicate=False)):
        if name not in keep:
            owner, attr = _owner(name)
            root.get_submodule(owner)._buffers.pop(attr, None)
    return root


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the meta model's floating parameters the load dtype (ties kept), buffers untouched.

    The graph is traced with these dtypes burned in (mask fill values, casts back to the weight
    dtype), so it has to see the dtype the weights will run in. Buffers keep theirs, as in
    transformers (rotary ``inv_freq`` stays fp32).
    """
    made: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for key, p in mod._parameters.items():
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
            mod._parameters[key] = made[id(p)]


def _load_example(config) -> dict[str, torch.Tensor]:
    """Inputs for the load-time trace, which finds each stage's parameters (shapes are irrelevant)."""
    length = min(8, int(getattr(config, "max_position_embeddings", 0) or 8))
    ids = (torch.arange(length) % int(getattr(config, "vocab_size", 2) or 2)).unsqueeze(0)  # (1, T)
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        example["decoder_input_ids"] = ids.clone()
    return example


def trace_front_end(config, options: PipelineOptions, *, device: torch.device) -> StageBuild:
    """The tracer front end: plan the model from its module tree and split it with torch.export.

    Returns the same :class:`~hf_pipeline.loading.stages.StageBuild` as the recipe front end: the loader
    (``build.py``) then reads and materialises the stages' tensors exactly as for recipe stages,
    and wires this tracer's graphs to them when they are loaded.
    """
    config = copy.deepcopy(config)
    config.use_cache = False  # torch.export cannot trace HF's KV cache
    skeleton = meta_model(config, options.model_class)
    _cast_parameters(skeleton, options.dtype)
    blocks_fqn = find_blocks(skeleton)
    resolved = _costing_recipe(skeleton, blocks_fqn)
    plan = make_plan(
        skeleton, resolved, pp_size=options.pp_size, virtual_stages=options.virtual_stages,
        layout=options.schedule.layout, split=options.split, dtype=options.dtype,
        schedule=options.schedule, n_microbatches=options.n_microbatches,
    )
    tracer = _Tracer(skeleton, list(plan.split_points), plan.num_stages, (), device)
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
    resolved = dataclasses.replace(resolved, head=dataclasses.replace(resolved.head, outputs=keys, output_class=type(out).__name__))
    itemsize = torch.empty((), dtype=options.dtype).element_size()
    blocks = resolved.stacks[0].blocks
    stages = tuple(_traced_spec(skeleton, s, first.state[s.index], blocks, itemsize) for s in plan.stages)
    plan = dataclasses.replace(plan, stages=stages, _by_rank={})

    def make_stages(specs: Sequence[StageSpec]) -> list[nn.Module]:
        tracer.local = tuple(s.index for s in specs)
        return [TracedStage(_holder(skeleton, first.state[s.index]), s, resolved, tracer) for s in specs]

    def on_loaded(loaded: Sequence[nn.Module]) -> None:
        for holder in loaded:
            tracer.holders[holder.spec.index] = holder

    return StageBuild(
        config=config, plan=plan, resolved=resolved, skeleton=skeleton, output_class=type(out),
        make_stages=make_stages, on_loaded=on_loaded,
        generate_refusal=(
            f"{plan.model_class} was split by torch.export tracing, which works without a KV cache only, so it cannot "
            f"generate. KV-cached pipelined generation needs a recipe; to generate with this model, {_RECIPE_HOWTO}"
        ),
    )
