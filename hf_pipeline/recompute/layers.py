"""Activation checkpointing through the pipeline, with transformers' signatures and semantics.

``model.activation_checkpointing_enable(activation_checkpointing_kwargs=None, every_n_layers=1,
offload=False)`` does on each rank's stages what ``PreTrainedModel.activation_checkpointing_enable``
does on the whole model: every transformers ``GradientCheckpointingLayer`` (decoder / encoder
blocks: ``LlamaDecoderLayer``, ``GPT2Block``, ``BertLayer``, ``T5Block``) gets the checkpoint
function and its ``gradient_checkpointing`` flag, and its own forward wrapper then recomputes it in
backward whenever it runs in training mode with gradients on. ``forward()`` (eval) and ``generate``
are unaffected, as in transformers; training steps never use a KV cache.

What the pipeline adds or fixes:

* **The global layer index.** ``every_n_layers`` checkpoints layer ``i`` when ``i % every_n_layers == 0``,
  with ``i`` counted as transformers counts it: over every ``GradientCheckpointingLayer`` of the
  whole model in ``modules()`` order (:func:`layer_order`, read from the meta-device model). A stage
  holding layers 4-7 so checkpoints the layers the one-process model does. For T5 that order is the
  encoder's blocks, then the decoder's: decoder block ``j`` is layer ``n_encoder + j``.
* **Non-reentrant only.** ``use_reentrant=True`` is refused: torch's pipeline stages take their input
  gradients with ``torch.autograd.grad`` / ``backward(inputs=...)`` (the first step's shape inference,
  every zero-bubble input pass), which reentrant checkpointing rejects ("incompatible with .grad() or
  passing an `inputs` parameter to .backward()"), so every stage after the first would fail (seen on
  2 gloo ranks: under 1F1B stage 1 fails with that error, under ZBV zero-bubble every stage does).
  transformers' default (``{"use_reentrant": False}``) is the one used when no kwargs are given.
* **Blocks cut in halves.** A stage boundary inside a block runs its attention and MLP halves
  through the glue (``block_half``); each half of a checkpointed block is checkpointed on its own
  stage (``families/glue/base.py``), with the same function.
* **offload=True** keeps the saved tensors on the host as transformers does (``save_on_cpu`` with
  pinned memory) when the stages run on an accelerator; on a CPU-only run the activations are on the
  host already and it is accepted as a no-op (transformers' own call would fail there asking for a
  pinned-memory allocator).
* **Zero-bubble schedules** work: the recompute runs inside the input-gradient pass (I), which is
  the stage's ordinary backward, and the linears' deferred weight gradients (``weight_pass.py``)
  keep the recomputed tensors they need until W.
* **Traced models** (``TracedPipelinedModel``) are refused: their stages run ``torch.export`` graphs,
  in which the blocks' modules are no longer called, so there is nothing to checkpoint.

The selective form to a memory budget (``memory_budget_bytes=`` of ``activation_checkpointing_enable``)
is chosen with the memory planner's predictions (:func:`~hf_pipeline.memory.planner.plan_report`), above it:
:func:`~hf_pipeline.memory.recompute_budget.enable_checkpointing`.

Example:
    >>> model.activation_checkpointing_enable(every_n_layers=2)   # layers 0, 2, 4, ... of the whole model
    >>> loss = model.train_step(batch)                            # same loss and gradients, less memory
    >>> model.is_activation_checkpointing
    True
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from ..compat import set_checkpointing_function
from ..core import PipelineCore
from ..errors import InputError, InputTypeError, UsageError

__all__ = [
    "CHECKPOINT_KWARGS",
    "ActivationCheckpointingMixin",
    "CheckpointingSettings",
    "apply_checkpointing",
    "check_checkpointable",
    "checkpointed_layers",
    "disable",
    "enable",
    "is_enabled",
    "layer_order",
]

# What torch.utils.checkpoint.checkpoint takes besides the function and its arguments: its named
# keywords, and ``preserve_rng_state`` (taken through **kwargs). Anything else would be passed on to the
# block's forward and fail in the middle of a step; it is refused when checkpointing is enabled.
CHECKPOINT_KWARGS = frozenset(
    name for name, p in inspect.signature(checkpoint).parameters.items()
    if p.kind is p.KEYWORD_ONLY
) | {"preserve_rng_state"}


@dataclass(frozen=True, kw_only=True)
class CheckpointingSettings:
    """What ``activation_checkpointing_enable`` was given, checked.

    Attributes:
        kwargs: keyword arguments for ``torch.utils.checkpoint.checkpoint`` (``use_reentrant`` is False).
        every_n_layers: checkpoint layer ``i`` of the whole model when ``i % every_n_layers == 0``.
        offload: keep the saved tensors on the host (on an accelerator).
    """

    kwargs: Mapping[str, Any] = field(default_factory=lambda: {"use_reentrant": False})
    every_n_layers: int = 1
    offload: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kwargs, Mapping):
            raise InputTypeError(
                f"activation_checkpointing_kwargs must be a dict of torch.utils.checkpoint.checkpoint arguments "
                f"(or None), got {type(self.kwargs).__name__}"
            )
        unknown = sorted(set(self.kwargs) - CHECKPOINT_KWARGS)
        if unknown:
            raise InputError(
                f"activation_checkpointing_kwargs has {unknown}, which torch.utils.checkpoint.checkpoint does not "
                f"take (it takes {sorted(CHECKPOINT_KWARGS)}); remove them"
            )
        if self.kwargs.get("use_reentrant", False) is not False:
            raise InputError(
                "activation_checkpointing_kwargs={'use_reentrant': True} cannot run in a pipeline: torch's pipeline "
                "stages take their input gradients with torch.autograd.grad / backward(inputs=...), which reentrant "
                "checkpointing rejects, so every stage after the first would fail; use use_reentrant=False (the "
                "default here and in transformers)"
            )
        n = self.every_n_layers
        if isinstance(n, bool) or not isinstance(n, int):
            raise InputTypeError(f"every_n_layers must be an int >= 1, got {n!r} ({type(n).__name__})")
        if n < 1:
            raise InputError(f"every_n_layers must be >= 1 (1 checkpoints every layer), got {n}")
        if not isinstance(self.offload, bool):
            raise InputTypeError(f"offload must be True or False, got {self.offload!r}")


def layer_order(skeleton: nn.Module) -> list[str]:
    """FQNs of the model's ``GradientCheckpointingLayer`` s in the order transformers counts them.

    ``PreTrainedModel._set_gradient_checkpointing`` numbers the layers in ``modules()`` order over the
    whole model (T5: the encoder's blocks, then the decoder's); ``skeleton`` is the meta-device model.
    """
    return [fqn for fqn, m in skeleton.named_modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed_layers(skeleton: nn.Module, every_n_layers: int) -> list[str]:
    """The FQNs of the layers ``every_n_layers`` checkpoints, as transformers chooses them.

    Example:
        >>> checkpointed_layers(llama_with_8_layers, 3)
        ['model.layers.0', 'model.layers.3', 'model.layers.6']
    """
    return [fqn for i, fqn in enumerate(layer_order(skeleton)) if i % every_n_layers == 0]


def _checkpoint_function(settings: CheckpointingSettings, device: torch.device) -> Callable:
    # As transformers' _activation_checkpointing_enable: checkpoint with the kwargs, under save_on_cpu
    # when offloading from an accelerator.
    if settings.offload and device.type != "cpu":
        device_type = device.type

        def checkpoint_func(function, *args, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=device_type):
                return checkpoint(function, *args, **kwargs)
    else:
        checkpoint_func = checkpoint
    return functools.partial(checkpoint_func, **{"use_reentrant": False, **settings.kwargs})


def apply_checkpointing(
    stages, skeleton: nn.Module, settings: CheckpointingSettings | None, device: torch.device,
    function: Callable | None = None,
) -> list[str]:
    """Set (``settings``) or clear (None) checkpointing on ``stages``, as transformers' ``_set_gradient_checkpointing``.

    Every module with a ``gradient_checkpointing`` attribute gets the function; a layer's flag says
    whether its global index is checkpointed, any other module's (a stack container) is the enable
    flag itself. ``function`` replaces the checkpoint function (the memory planner measures through it).

    Returns:
        The FQNs of this rank's checkpointed layers.
    """
    chosen = set(checkpointed_layers(skeleton, settings.every_n_layers)) if settings is not None else set()
    func = function or (_checkpoint_function(settings, device) if settings is not None else checkpoint)
    mine = []
    for stage in stages:
        for fqn, module in stage.named_modules():
            if not hasattr(module, "gradient_checkpointing"):
                continue
            set_checkpointing_function(module, func)
            if isinstance(module, GradientCheckpointingLayer):
                module.gradient_checkpointing = fqn in chosen
                if fqn in chosen:
                    mine.append(fqn)
            else:
                module.gradient_checkpointing = settings is not None
    return mine


def check_checkpointable(model: PipelineCore) -> None:
    """Refuse (UsageError) a model whose stages cannot checkpoint: one built by the torch.export tracer."""
    if model.options.traced:
        raise UsageError(
            "activation checkpointing needs recipe stages: this model's stages were built by the torch.export "
            "tracer (split_method='trace', or no recipe for its model_type), whose graphs no longer call the "
            "transformers layers that checkpoint themselves; load it with a recipe to checkpoint activations"
        )


def enable(model: PipelineCore, activation_checkpointing_kwargs=None, every_n_layers: int = 1,
           offload: bool = False) -> list[str]:
    """Turn activation checkpointing on for ``model``'s stages on this rank (see the module docstring).

    Args:
        model: a :class:`~hf_pipeline.model.PipelinedModel`.
        activation_checkpointing_kwargs, every_n_layers, offload: as transformers'.

    Returns:
        The FQNs of this rank's checkpointed layers.
    """
    settings = CheckpointingSettings(
        kwargs={"use_reentrant": False} if activation_checkpointing_kwargs is None else activation_checkpointing_kwargs,
        every_n_layers=every_n_layers, offload=offload,
    )
    check_checkpointable(model)
    return apply_checkpointing(model.stages, model.skeleton, settings, model.device)


def disable(model: PipelineCore) -> None:
    """Turn activation checkpointing off on this rank's stages (transformers' ``activation_checkpointing_disable``)."""
    apply_checkpointing(model.stages, model.skeleton, None, model.device)


def is_enabled(model: PipelineCore) -> bool:
    """Whether any module of this rank's stages checkpoints (transformers' ``is_activation_checkpointing``)."""
    return any(getattr(m, "gradient_checkpointing", False) for stage in model.stages for m in stage.modules())


class ActivationCheckpointingMixin:
    """transformers' activation-checkpointing surface on :class:`~hf_pipeline.model.PipelinedModel`.

    ``activation_checkpointing_enable`` itself is the model's (it also plans to a memory budget with the
    memory planner, a room above this one); these are the rest of transformers' methods.
    """

    def activation_checkpointing_disable(self) -> None:
        """Deactivate activation checkpointing (this rank's stages)."""
        disable(self)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs: Any) -> None:
        """Deprecated alias of ``activation_checkpointing_enable``, as in transformers."""
        warnings.warn(
            "`gradient_checkpointing_enable` is deprecated and will be removed in v6. Use "
            "`activation_checkpointing_enable` instead.",
            FutureWarning, stacklevel=2,
        )
        self.activation_checkpointing_enable(activation_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """Deprecated alias of ``activation_checkpointing_disable``, as in transformers."""
        warnings.warn(
            "`gradient_checkpointing_disable` is deprecated and will be removed in v6. Use "
            "`activation_checkpointing_disable` instead.",
            FutureWarning, stacklevel=2,
        )
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether activation checkpointing is on (on this rank's stages)."""
        return is_enabled(self)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Deprecated alias of ``is_activation_checkpointing``, as in transformers."""
        warnings.warn(
            "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` "
            "instead.",
            FutureWarning, stacklevel=2,
        )
        return self.is_activation_checkpointing
