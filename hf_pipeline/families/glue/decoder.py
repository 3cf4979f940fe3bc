"""The generic decoder glue: each stage runs the model class's own ``forward`` over the layers it holds.

Every causal LM laid out as transformers' standard decoder (``families/roles.py``) differs from
the others only in what its forward does around the layers: Gemma scales the embeddings, Gemma 2
and Cohere soft-cap or scale the logits, Qwen3 and Gemma 3 mix sliding and full attention layers,
gpt-oss adds attention sinks. Rather than repeat those lines per family, a stage calls the pruned
model's own ``forward`` (base model, and on the last stage the head class's), with three things
arranged around the call:

* **the layers**: the base model's layer list is seen, during the call, as all
  ``num_hidden_layers`` entries, the stage's own layers at their indices and a pass-through for
  the others, so the forward's loop (``enumerate(self.layers[:num_hidden_layers])``,
  ``config.layer_types[i]``) is the model's own. The stage's first layer takes the hidden states
  received from the previous stage, whatever the forward made of the embeddings on the way (it
  computes them from that same tensor, and they are dropped); the last layer's output is what the
  stage sends on.
* **the cache**: the stage's ``DynamicCache`` holds every layer but fills only its own; during the
  call the others read as transformers' ``DummyLayer`` (a layer that stores nothing), so the mask
  functions the forward calls size each mask against the stage's own first layer of each kind,
  as they do against layer 0 in one process.
* **positions**: counted by the forward itself when the caller gives none (the dummy layers report
  the stage's own cache length where the forward asks layer 0's).

Modules a stage does not hold (the embedding on a later stage, the final norm on an earlier one)
read, during the call, as a pass-through of the hidden states: their outputs are never used.
On the last stage the head class's own forward runs on top (the LM head, logit soft-capping and
scaling, a score head's pooling), with its base model answering with the stage's hidden states.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from ...compat import cache_dummy_layer, module_registries
from ...errors import InternalError
from ..router_loss import router_aux_of
from .base import Glue, layer_index

__all__ = ["DecoderGlue"]


class _Slot:
    """What one call passes between the glue and the layer list it shows the model's forward."""

    def __init__(self) -> None:
        self.received: torch.Tensor | None = None  # into the stage's first layer (None on the first stage)
        self.sent: Any = None  # out of its last layer


class _PassThrough(nn.Module):
    """A layer or module the stage does not hold: gives back the hidden states it is called with."""

    def __init__(self, slot: _Slot) -> None:
        super().__init__()
        self.slot = slot

    def forward(self, hidden_states: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(hidden_states, torch.Tensor) and hidden_states.is_floating_point():
            return hidden_states
        # a module called on something else (a position table on attention_mask): its output is not used
        return self.slot.received


class _Owned(nn.Module):
    """One of the stage's layers in the shown list: the first takes the received hidden states, the last's
    output is kept."""

    def __init__(self, layer: nn.Module, slot: _Slot, *, first: bool, last: bool) -> None:
        super().__init__()
        self.layer, self.slot, self.first, self.last = layer, slot, first, last

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.first and self.slot.received is not None:
            hidden_states = self.slot.received
        out = self.layer(hidden_states, *args, **kwargs)
        if self.last:
            self.slot.sent = out[0] if isinstance(out, tuple) else out
        return out


class _BaseAnswer(nn.Module):
    """Stands for the base model inside the head class's forward: answers with the stage's base output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


@contextlib.contextmanager
def _swapped(parent: nn.Module, name: str, stand_in: nn.Module) -> Iterator[None]:
    # The child registry itself, not setattr: nothing is registered for good, and a missing child
    # (pruned) is put back missing.
    children = module_registries(parent)[1]
    had, old = name in children, children.get(name)
    children[name] = stand_in
    try:
        yield
    finally:
        if had:
            children[name] = old
        else:
            del children[name]


@contextlib.contextmanager
def _own_cache_layers(cache: Any, owned: list[int]) -> Iterator[None]:
    """During the call, the layers of ``cache`` the stage does not run read as empty dummy layers
    reporting the stage's own cache length (its first layer's)."""
    layers = getattr(cache, "layers", None)
    if layers is None or not owned:
        yield
        return
    dummy = cache_dummy_layer(layers[owned[0]].get_seq_length)
    mine = set(owned)
    kept = {i: layer for i, layer in enumerate(layers) if i not in mine}
    for i in kept:
        layers[i] = dummy
    try:
        yield
    finally:
        for i, layer in kept.items():
            layers[i] = layer


class _StageView:
    """What one stage shows the model's forward, built once (the stage's layers and modules are fixed when
    it is built): the full-length layer list, pass-throughs for the children it dropped, where the head
    class finds the module that runs the layers, and the slot each call fills."""

    def __init__(self, stage: Any) -> None:
        self.slot = slot = _Slot()
        run, stack = stage.stack_runs[0], stage.resolved.stacks[0]
        # The HF module whose forward runs the layers: the base model (OPT: its decoder); for a base model
        # class, the pruned model itself (not the stage, whose forward is this glue's).
        self.holder = stage.hf_root.get_submodule(stack.holder) if stack.holder else stage.hf_root
        total = stage.config.get_text_config(decoder=True).num_hidden_layers
        owned = {layer_index(b): m for b, m in zip(run.blocks, run.modules)}
        first, last = min(owned), max(owned)
        layers = nn.ModuleList(
            _Owned(owned[i], slot, first=i == first, last=i == last) if i in owned else _PassThrough(slot)
            for i in range(total)
        )
        self.stand_ins = [(stack.block_list.rpartition(".")[2], layers)]
        self.stand_ins += [(name, _PassThrough(slot)) for name in stage.absent_holder_children]
        self.attention_layers = [layer_index(b) for b in stage.attention_blocks]
        # In the head class's forward the module that runs the layers answers with the stage's output.
        parent, _, self.holder_name = stack.holder.rpartition(".")
        self.holder_parent = stage.hf_root.get_submodule(parent)
        self.answer = _BaseAnswer(None)
        # transformers' own record of router logits and per-stage loss would be dead work: the training step adds the
        # routers' loss over the whole batch (training/router_aux.py), so the calls ask for none.
        self.no_router_records = ({"output_router_logits": False}
                                  if getattr(stage.config.get_text_config(decoder=True), "output_router_logits", False)
                                  else {})


class DecoderGlue(Glue):
    """Standard transformers decoders (``decoder.toml``): the model's own forward over the stage's layers."""

    packs_rows = True  # but the recipe's [unpacked] model types (their forwards read the 2D mask or the cache's length)

    def check(self, stage: Any) -> None:
        if len(stage.stack_runs) != 1:
            raise InternalError("a decoder stage runs one stack")
        config = stage.config.get_text_config(decoder=True)
        # The routers' load-balancing loss is added by the training step (training/router_aux.py); a family
        # whose loss it cannot reproduce is refused here, at load.
        router_aux_of(stage.hf_root, config)

    def __init__(self) -> None:
        # One view per stage this glue runs (a stage is built once; weak: a dropped stage frees its view).
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _view(self, stage) -> _StageView:
        view = self._views.get(stage)
        if view is None:
            view = self._views[stage] = _StageView(stage)
        return view

    def forward(self, stage, received, inputs):
        view = self._view(stage)
        slot = view.slot
        slot.received, slot.sent = (None if stage.spec.is_first else received[0]), None  # (B, T, H)
        cache = inputs.get("cache")
        kwargs = self._base_inputs(slot, inputs, cache)
        kwargs.update(view.no_router_records)
        with contextlib.ExitStack() as stack:
            for name, module in view.stand_ins:
                stack.enter_context(_swapped(view.holder, name, module))
            stack.enter_context(_own_cache_layers(cache, view.attention_layers))
            out = view.holder(**kwargs)
        sent, slot.received, slot.sent = slot.sent, None, None  # nothing of this call kept past it
        if not stage.spec.is_last:
            return sent  # (B, T, H) to the next stage
        return self._head(stage, view, out, inputs)

    def _base_inputs(self, slot: _Slot, inputs: dict[str, Any], cache) -> dict[str, Any]:
        if slot.received is None:
            ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
        else:
            ids, embeds = None, slot.received
        # Positions the caller did not give are the forward's own to count (from the attention mask in
        # OPT, from the cache elsewhere: the stage's own length, see _own_cache_layers).
        return {
            "input_ids": ids, "inputs_embeds": embeds, "attention_mask": inputs.get("attention_mask"),
            "position_ids": inputs.get("position_ids"), "cache": cache, "use_cache": cache is not None,
        }

    def _head(self, stage, view: _StageView, out, inputs):
        head, root = stage.resolved.head, stage.hf_root
        if not stage.resolved.base:  # the base model class itself: its outputs are the stage's
            values = tuple(out[name] for name in head.outputs)
            return values if len(values) > 1 else values[0]
        keep = inputs.get("logits_to_keep")
        args = {"input_ids": inputs.get("input_ids"), "attention_mask": inputs.get("attention_mask")}
        if inputs.get("input_ids") is None:
            args["inputs_embeds"] = out.last_hidden_state  # only its batch size is read (pooling heads)
        if isinstance(keep, torch.Tensor):  # the positions asked for (a packed op's)
            args["logits_to_keep"] = keep
        elif keep:
            args["logits_to_keep"] = int(keep)
        args.update(view.no_router_records)
        view.answer.output = out
        try:
            with _swapped(view.holder_parent, view.holder_name, view.answer):
                result = root(**args)
        finally:
            view.answer.output = None
        values = tuple(result[name] for name in head.outputs)
        return values if len(values) > 1 else values[0]
