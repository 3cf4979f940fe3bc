"""The routers' load-balancing loss (``config.output_router_logits=True``) in a training step, exactly.

``families/router_loss.py`` splits transformers' loss into one term per stage and microbatch, given the
batch-wide expert counts ``T`` and rows ``R``. A schedule that overlaps forwards and backwards (1F1B and
every later one) runs a microbatch's backward before later microbatches' forwards, so ``T`` is not known
when the first backward runs. Hence two passes, exact under every schedule and mesh:

1. **Counting pass**: the step's microbatches go forward once through the pipeline without autograd;
   router hooks add up ``T`` and ``R`` on each rank; one all-reduce over the world gives every rank the
   batch-wide ``T`` and ``R`` (tensor-parallel peers hold the same replicated routers: their sum is
   divided by ``tp_size``; data-parallel replicas each add their own rows, as the global batch does).
2. **Training pass**: each stage's router hooks keep their logits; when the stage's forward returns, its
   term ``loss_scale x coef x E x <T, P_(s, m)> / R^2`` is attached to the stage's output by an identity
   autograd function whose backward also gives the term gradient 1 (the device DeepSeek's own modelling
   code uses to attach its auxiliary loss). So each stage's backward, run whenever the schedule runs it,
   adds exactly the auxiliary gradient of its own layers and microbatch; the terms' values add up to
   ``coef x aux`` in the step's loss. Activation checkpointing recomputes layers inside the backward:
   the hooks keep logits only while the stage's own forward runs, so a recomputation adds nothing.

Costs: one forward per step more (about a third of a step). The two passes must route alike, so
training-mode randomness before the routers (dropout, router jitter) is refused while training.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..core import PipelineCore
from ..distributed.shards import local_tensor
from ..errors import InputError
from ..families.router_loss import RouterAux, training_randomness
from ..runtime.cache import run_local_stages, signature, split_microbatches
from ..runtime.chunk_marks import in_microbatch

__all__ = ["aux_pass", "forward_aux_loss", "forward_only"]


def _flat_mask(mask: Any, rows: int, where: str) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.numel() != rows:
        raise InputError(
            f"output_router_logits=True weights the routers' load-balancing loss by a (batch, length) attention_mask "
            f"as transformers does; {where} got a mask of shape {tuple(getattr(mask, 'shape', ()))} for {rows} tokens"
        )
    return mask.reshape(-1).float()


class _AttachTerm(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends gradient 1 into ``term`` (a scalar computed in the stage)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_like = (term.dtype, term.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.term_like
        return grad, torch.ones((), dtype=dtype, device=device)


def _attach(output: Any, term: torch.Tensor) -> Any:
    """``output`` with ``term`` attached to its first tensor that takes a gradient (unchanged if none does)."""
    if isinstance(output, torch.Tensor):
        return _AttachTerm.apply(output, term) if output.requires_grad and term.requires_grad else output
    if isinstance(output, tuple):
        for i, x in enumerate(output):
            if isinstance(x, torch.Tensor) and x.requires_grad and term.requires_grad:
                return output[:i] + (_AttachTerm.apply(x, term),) + output[i + 1:]
    return output


class _Hooks:
    """Router and stage hooks of one pass over this rank's stages (see the module docstring)."""

    def __init__(self, aux: RouterAux, stages: list[nn.Module], weight: torch.Tensor | None, *, local: bool,
                 limit: int | None = None) -> None:
        self.aux, self.weight = aux, weight  # weight: None while counting, else loss_scale*coef*E*T/R^2
        self.t = torch.zeros(aux.num_experts, dtype=torch.float32)
        self.p = torch.zeros(aux.num_experts, dtype=torch.float32)  # a forward's counting: P too (its aux_loss)
        self.rows = torch.zeros((), dtype=torch.float32)
        self.values: list[torch.Tensor] = []  # each stage call's term, detached
        # A forward (``limit`` set) pads its batch to whole microbatches by repeating the last row: each router
        # counts its first ``limit`` token rows only (the microbatches reach a stage in order).
        self.limit, self.seen = limit, {}
        self.local = local  # every stage runs here, called directly (no torch PipelineStage)
        self._mask: torch.Tensor | None = None
        self._kept: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None  # set while a stage forward runs
        self.handles = []
        for stage in stages:
            self.handles.append(stage.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(stage.register_forward_hook(self._leave, with_kwargs=True))
            for module in stage.modules():
                if isinstance(module, aux.router_class):
                    self.handles.append(module.register_forward_hook(self._router))

    def _enter(self, module, args, kwargs):
        if self.local or in_microbatch():  # not torch's metadata inference (runtime/chunk_marks.py)
            self._mask, self._kept = kwargs.get("attention_mask"), []

    def _router(self, module, args, output):
        if self._kept is None:
            return  # outside a microbatch forward: torch's metadata inference, or a recomputation in the backward
        logits = local_tensor(output[self.aux.index] if isinstance(output, tuple) else output)
        mask = _flat_mask(self._mask, logits.shape[0], "a stage")
        if self.weight is None:
            if self.limit is not None:
                before = self.seen.get(id(module), 0)
                self.seen[id(module)] = before + logits.shape[0]
                keep = max(0, min(logits.shape[0], self.limit - before))
                logits, mask = logits[:keep], None if mask is None else mask[:keep]
            routing = self.aux.routing(logits.detach())
            t, rows = self.aux.counts(routing, mask)
            self.t, self.rows = self.t + t.cpu(), self.rows + rows.cpu()
            if self.limit is not None:  # a forward's aux_loss needs P too; a training step's counting pass does not
                self.p = self.p + self.aux.probabilities(routing, mask).cpu()
        else:
            self._kept.append((logits, mask))

    def _leave(self, module, args, kwargs, output):
        kept, self._kept, self._mask = self._kept, None, None
        if self.weight is None or not kept:
            return output
        weight = self.weight.to(kept[0][0].device)
        term = sum(torch.dot(weight, self.aux.probabilities(self.aux.routing(x), m)) for x, m in kept)
        self.values.append(term.detach())
        return _attach(output, term)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _counted(model: PipelineCore, aux: RouterAux, forward: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-wide (T, R) from a forward-only run of ``forward`` with counting hooks on this rank's stages."""
    hooks = _Hooks(aux, list(model.stages), None, local=model.plan.pp_size == 1)
    try:
        with torch.no_grad():
            forward()
    finally:
        hooks.remove()
    both = torch.cat([hooks.t, hooks.rows.reshape(1)]).double()
    if model.ctx.is_distributed:
        both = both.to(model.device)
        dist.all_reduce(both, group=model.ctx.group)
        both = both.cpu() / model.dims.tp_size  # tensor-parallel peers counted the same routers
    return both[:-1].float(), both[-1].float()


@contextlib.contextmanager
def aux_pass(
    model: PipelineCore, aux: RouterAux, count: Callable[[], None], loss_scale: float
) -> Iterator[list[torch.Tensor]]:
    """Around a training pass: count first (``count`` runs the step's microbatches forward), then attach each
    stage call's term. Yields the list the terms' values (times ``loss_scale``, as the step's losses) join."""
    found = training_randomness(model.config) if model.training else []
    if found:
        raise InputError(
            f"output_router_logits=True in training needs the same routing in its counting and training passes, "
            f"but {', '.join(found)} draws at random in training mode; set them to 0 or output_router_logits=False"
        )
    t, rows = _counted(model, aux, count)
    if float(rows) == 0:
        raise InputError("output_router_logits=True: the batch has no unmasked token for the routers")
    weight = (loss_scale * aux.coef * aux.num_experts) * t / (rows * rows)
    hooks = _Hooks(aux, list(model.stages), weight, local=model.plan.pp_size == 1)
    values: list[torch.Tensor] = []
    try:
        yield values
    finally:
        hooks.remove()
    values.extend(v.float() for v in hooks.values)


def forward_only(model: PipelineCore, inputs: dict[str, Any], n_microbatches: int) -> None:
    """The step's microbatches forward through this rank's stages, as the training schedule splits them."""
    if model.plan.pp_size > 1:
        _, schedule = model.runtime.get(signature(inputs), training=False, n_microbatches=n_microbatches)
        schedule.step(**inputs, return_outputs=False)
        return
    for chunk in split_microbatches(inputs, n_microbatches):
        run_local_stages(model.stages, chunk)


def forward_aux_loss(
    model: PipelineCore, aux: RouterAux, run: Callable[[], Any], tokens: int
) -> tuple[Any, torch.Tensor]:
    """(``run()``'s outputs, transformers' ``aux_loss`` of that forward): ``run`` is an inference forward of a
    batch of ``tokens`` token rows through the pipeline, counted as it runs. Collective over the pipeline."""
    hooks = _Hooks(aux, list(model.stages), None, local=model.plan.pp_size == 1, limit=tokens)
    try:
        outputs = run()
    finally:
        hooks.remove()
    parts = torch.cat([hooks.t, hooks.p, hooks.rows.reshape(1)]).double()
    if model.plan.pp_size > 1:  # each stage's routers counted on its own rank; the same batch on every replica
        parts = parts.to(model.device)
        dist.all_reduce(parts, group=model.dims.pp_group)
        parts = parts.cpu()
    e = aux.num_experts
    t, p, rows = parts[:e].float(), parts[e:2 * e].float(), parts[-1].float()
    return outputs, torch.sum((t / rows) * (p / rows)) * e
