"""The zero-bubble weight pass: linear layers' weight gradients deferred from backward to W.

A zero-bubble schedule splits a stage's backward into I (the gradients the previous stage waits
for) and W (weight gradients, run later to fill what would be idle time). The weight gradient of a
linear layer is one matmul of two tensors the backward already has: the layer's input and the
gradient of its output. So I runs the stage's ordinary backward, except that each linear layer
hands back its input gradient (and bias gradient) and keeps those two tensors aside; W is then
those matmuls alone, accumulated into ``.grad``. Every other parameter (norms, embeddings,
position biases) gets its gradient in I, by autograd as always. This is the split of the
zero-bubble paper (Qi et al., 2023) and of Megatron's deferred weight-gradient store; torch takes
it as ``PipelineStage(dw_builder=...)``: the stage runs its full backward for I and keeps what the
builder returns as that chunk's W (:func:`take`).

Why not torch's own split (``stage_backward_input`` / ``stage_backward_weight``, what a stage
without ``dw_builder`` runs): it is generic over any graph, so it walks the autograd graph, saves
the gradients where the weights' subgraphs join the input's, and runs one ``autograd.grad`` per
group in W. On the benchmark's CPU model (3 LLaMA layers, hidden 384, one microbatch) its I + W
take 1.15x one full backward, which eats the bubble it removes, and where a group joins the
input's graph at several nodes (T5's first decoder stage, which also computes from decoder ids)
its weight gradients depend on set order. Here I + W take 1.03x the full backward, and the
gradients are the ones autograd computes: the same products, in the same dtypes.

What is deferred: every linear whose weight is a trainable leaf tensor (``nn.Linear`` and
transformers' ``Conv1D``, GPT-2's linear with a transposed weight, in recipe stages; the
``aten.linear`` calls of a traced stage's graph, which ``loading/traced_graphs.py`` points at
:func:`linear`), while a zero-bubble training step runs (:func:`deferring`), and only in a stage's
own backward actions (:func:`capturing`, set by :class:`WeightDeferringStage`): any other backward
computes the weight gradient in place, as autograd does. The linears hold nearly all of a
transformer's weight FLOPs; the rest (norms, embeddings) is cheap.
On a device, W's matmuls run on the stage's device like the rest of its backward.

Under FSDP2 the deferred gradients go into the gathered parameters' ``.grad``: torch's stage keeps a
FSDP stage gathered, without reducing, through every I and W (``backward_maybe_with_nosync``), and its
schedule runs the one reduce-scatter (``perform_reduce_grad``) at the REDUCE_GRAD action it places after
the stage's last W, so W's gradients are in it (``tests/training/test_fsdp_zero_bubble.py``).

The pending work is process-wide, not per stage: a rank runs one stage's backward at a time, and
torch calls the builder right after each (so :func:`take` collects exactly that backward's work).
A plain attribute, not a thread-local: on CUDA, autograd runs backward in its own device threads.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .chunk_marks import MarkedStage

__all__ = ["WeightDeferringStage", "capturing", "deferring", "install", "linear", "take"]


class _State:
    enabled = False  # a zero-bubble training step runs: linears record deferrable gradients
    capturing = False  # a stage's backward action runs: those linears defer their weight gradients
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []


_state = _State()


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """Within: linear layers record a deferrable weight gradient in forward (one zero-bubble step)."""
    _state.enabled, _state.pending = True, []
    try:
        yield
    finally:
        _state.enabled, _state.capturing, _state.pending = False, False, []  # a failed step leaves nothing behind


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Within: the recorded linears' backward leaves its weight gradient for :func:`take`.

    Only around a stage's own backward actions (``autograd.backward`` of the stage output):
    any other backward in the step (torch's first-step shape inference runs ``autograd.grad``
    for the input gradients alone) computes the weight gradient in place, as autograd would.
    """
    _state.capturing = True
    try:
        yield
    finally:
        _state.capturing = False


def take() -> Callable[[], int]:
    """The W action for the backward that just ran: computes its deferred weight gradients into ``.grad``.

    torch's ``dw_builder``: called by the stage after each backward of a chunk; the runner is
    called at the chunk's W action (at once, for a fused full backward).
    """
    work, _state.pending = _state.pending, []
    return lambda: _accumulate(work)


def _factors(x: torch.Tensor, g: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) with the weight gradient = a @ b: weight (out, in): g^T x; Conv1D's weight (in, out):
    x^T g; the rows are every leading dim of the layer's input and output gradient."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return (x2.t(), g2) if transposed else (g2.t(), x2)


def _accumulate(work: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]) -> int:
    """Add each deferred weight gradient into ``.grad``; returns how many it added."""
    with torch.no_grad():
        for weight, x, g, transposed in work:
            a, b = _factors(x, g, transposed)
            grad = weight.grad
            if grad is None:
                weight.grad = (a @ b).to(weight.dtype)
            elif grad.dtype == g.dtype and grad.layout == torch.strided:
                # Into the gradient in place: no temporary the size of the weight (an LM head's is
                # tens of MB, and on CPU a fresh one is page-faulted in on every microbatch).
                grad.addmm_(a, b)
            else:
                grad.add_((a @ b).to(weight.dtype))
    return len(work)


class _DeferrableLinear(torch.autograd.Function):
    """``y = x W^T + b`` (``transposed``: ``x W + b``) whose weight gradient waits for W while deferring.

    Under autocast the operands are cast as autocast casts ``linear`` (to its dtype) and the
    gradients cast back to each operand's dtype, as autograd's cast nodes do.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, transposed: bool):  # noqa: D102
        xc, wc, bc = x, weight, bias
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # Cast here, so the saved operands are the ones the product used; F.linear under
            # autocast then finds them in its dtype already.
            dtype = torch.get_autocast_dtype(device)
            xc, wc = x.to(dtype), weight.to(dtype)
            bc = None if bias is None else bias.to(dtype)
        out = F.linear(xc, wc.t() if transposed else wc, bc)
        ctx.save_for_backward(xc, wc)
        ctx.weight, ctx.transposed = weight, transposed  # the leaf that W accumulates into
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        xc, wc = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ (wc.t() if ctx.transposed else wc)).to(x_dtype)
        if ctx.needs_input_grad[2]:
            gb = g.reshape(-1, g.shape[-1]).sum(0).to(b_dtype)
        if ctx.needs_input_grad[1]:
            if _state.capturing:
                _state.pending.append((ctx.weight, xc, g, ctx.transposed))
            else:  # any other backward: as autograd would
                a, b = _factors(xc, g, ctx.transposed)
                gw = (a @ b).to(w_dtype)
        return gx, gw, gb, None


def _deferrable(weight: torch.Tensor) -> bool:
    return _state.enabled and weight.is_leaf and weight.requires_grad and torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with the weight gradient deferred while :func:`deferring` (what traced graphs call)."""
    if _deferrable(weight):
        return _DeferrableLinear.apply(x, weight, bias, False)
    return F.linear(x, weight, bias)


class _LayerForward:
    """A layer's instance ``forward``: deferrable during a zero-bubble step, its class's otherwise.

    An object rather than a bound method so that the layer still pickles (``torch.save``) and
    deep-copies: both rebuild it around the copy of its layer.
    """

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if _deferrable(layer.weight):
            return _DeferrableLinear.apply(x, layer.weight, layer.bias, not isinstance(layer, nn.Linear))
        return type(layer).forward(layer, x)

    def __reduce__(self):
        return (_LayerForward, (self.layer,))


def install(stage: nn.Module) -> None:
    """Let ``stage``'s ``nn.Linear`` and ``Conv1D`` layers defer their weight gradient. Idempotent.

    The layers keep their class, parameters and names, and run their class's forward except during
    a zero-bubble training step. Only exact ``nn.Linear`` / ``Conv1D`` instances change: a subclass
    may compute something else (quantized, adapter-wrapped) and keeps its forward (its weight
    gradients then come in I).
    """
    from transformers.pytorch_utils import Conv1D

    for module in stage.modules():
        if type(module) in (nn.Linear, Conv1D) and module.__dict__.get("forward") is None:
            module.forward = _LayerForward(module)


class WeightDeferringStage(MarkedStage):
    """A ``PipelineStage`` whose backward actions defer its linears' weight gradients to W.

    Built with ``dw_builder=take`` and with the stage module's layers installed (:func:`install`).

    Note: torch runs each backward action of a stage that has a ``dw_builder`` through the stage's
    ``backward_maybe_with_nosync("full", ...)`` and calls the builder right after it. Overriding that
    method in a subclass we own (instead of pinning a function on torch's object) makes exactly those
    backwards run :func:`capturing`; ``super()`` resolves at call time, so wrappers installed on
    torch's base class (``tools/profile.py``) still run.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device, **kwargs: Any):
        install(submodule)
        super().__init__(submodule, stage_index, num_stages, device, dw_builder=take, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        with capturing() if backward_type == "full" else contextlib.nullcontext():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
