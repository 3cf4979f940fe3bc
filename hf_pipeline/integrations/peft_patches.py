"""peft's methods a pipelined model needs replaced, in place only while a pipelined model is alive.

peft has no extension point for a model whose modules are spread over ranks: its injection walks
one process's modules (and raises on a rank whose stages hold no target), its state-dict keys are
the local module names, and ``PeftModel.save_pretrained`` writes what the local process holds. Its
entry points (``get_peft_model``, ``PeftModel.from_pretrained``, a ``PeftModel``'s ``load_adapter``
and ``save_pretrained``) are called by the user on peft, with no call of this package around them,
and peft consults nothing on the model object that could route them; its ``lora.ParamWrapper`` adds a plain
delta to a parameter that expert parallelism made a ``DTensor`` of this rank's experts. So the methods named in
:data:`hf_pipeline.compat.PEFT_PATCHED_METHODS` are wrapped, and the wrappers are scoped:

* installed when the first pipelined model is built in a process that has imported peft (or right
  after peft's import, when the model came first), removed when the last pipelined model is
  collected: peft's own class methods are back as soon as no pipelined model is alive;
* each wrapper checks whether the model is pipelined and otherwise calls peft's own method unchanged (the
  ``ParamWrapper`` ones: whether the wrapped parameter is an expert-parallel ``DTensor``, which only a
  pipelined model's stage holds here, and peft on one process could not add a plain delta to);
* the module globals peft reads adapter files through (:func:`reading_weights`) and asks transformers for
  the model's weight conversions through (:func:`converting_as`) are swapped only for the duration of one
  ``load_adapter`` call on a pipelined model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..compat import PEFT_CONVERSIONS, PEFT_PATCHED_METHODS, PEFT_WEIGHTS_READER
from ..core import PipelineCore

__all__ = ["PeftHandlers", "converting_as", "installed", "keep_while_alive", "reading_weights"]


@dataclass(frozen=True, kw_only=True)
class PeftHandlers:
    """What runs in place of peft's methods for a pipelined model.

    Attributes:
        inject: ``inject(tuner, original, model, adapter_name, **kwargs)``, for ``BaseTuner.inject_adapter``.
        save: ``save(peft_model, original, save_directory, *args, **kwargs)``, for ``PeftModel.save_pretrained``.
        load: ``load(peft_model, original, model_id, adapter_name, *args, **kwargs)``, for ``PeftModel.load_adapter``.
        is_pipelined: whether a module is a pipelined model.
        place: ``place(wrapper, tensor)``, for what ``ParamWrapper.get_delta_factors`` / ``get_delta_weight``
            return: the expert-stacked tensor on the wrapped parameter's mesh when it is an expert-parallel
            ``DTensor``, else the tensor itself.
        run_locally: ``run_locally(wrapper)``, inside ``ParamWrapper._activate_lora``: the adapted expert-parallel
            parameter read as its local part until the forward ends (nothing for a plain parameter).
    """

    inject: Callable[..., Any]
    save: Callable[..., Any]
    load: Callable[..., Any]
    is_pipelined: Callable[[Any], bool]
    place: Callable[[Any, Any], Any]
    run_locally: Callable[[Any], None]


@dataclass(kw_only=True)
class _Scope:
    live: int = 0  # pipelined models alive in this process
    handlers: PeftHandlers | None = None
    originals: dict | None = None  # (class, method name) -> peft's own function, while installed
    finder: Any = None  # the post-import hook, while peft is not imported yet


_scope = _Scope()


def _wrappers(handlers: PeftHandlers, originals: dict) -> dict[str, Callable[..., Any]]:
    """method name -> the function put in its place."""
    by_name = {name: function for (_, name), function in originals.items()}
    original_inject, original_save = by_name["inject_adapter"], by_name["save_pretrained"]
    original_load = by_name["load_adapter"]
    original_factors, original_delta = by_name["get_delta_factors"], by_name["get_delta_weight"]
    original_activate = by_name["_activate_lora"]
    signature = inspect.signature(original_inject)

    @functools.wraps(original_inject)
    def inject_adapter(self, model: nn.Module, adapter_name, *args, **kwargs):
        if not handlers.is_pipelined(model):
            return original_inject(self, model, adapter_name, *args, **kwargs)
        bound = signature.bind(self, model, adapter_name, *args, **kwargs).arguments
        rest = {k: v for k, v in bound.items() if k not in ("self", "model", "adapter_name")}
        return handlers.inject(self, original_inject, model, adapter_name, **rest)

    @functools.wraps(original_save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if not handlers.is_pipelined(getattr(self.base_model, "model", None)):
            return original_save(self, save_directory, *args, **kwargs)
        return handlers.save(self, original_save, save_directory, *args, **kwargs)

    @functools.wraps(original_load)
    def load_adapter(self, model_id, adapter_name, *args, **kwargs):
        if not handlers.is_pipelined(getattr(self.base_model, "model", None)):
            return original_load(self, model_id, adapter_name, *args, **kwargs)
        return handlers.load(self, original_load, model_id, adapter_name, *args, **kwargs)

    @functools.wraps(original_factors)
    def get_delta_factors(self, adapter_name):
        lhs, rhs, scaling = original_factors(self, adapter_name)
        return handlers.place(self, lhs), handlers.place(self, rhs), scaling

    @functools.wraps(original_delta)
    def get_delta_weight(self, adapter_name, *args, **kwargs):
        return handlers.place(self, original_delta(self, adapter_name, *args, **kwargs))

    @functools.wraps(original_activate)
    @contextlib.contextmanager
    def _activate_lora(self, active_adapters):
        with original_activate(self, active_adapters):
            handlers.run_locally(self)
            yield

    return {"inject_adapter": inject_adapter, "save_pretrained": save_pretrained, "load_adapter": load_adapter,
            "get_delta_factors": get_delta_factors, "get_delta_weight": get_delta_weight,
            "_activate_lora": _activate_lora}


def _install() -> None:
    if _scope.originals is not None or _scope.live == 0 or _scope.handlers is None:
        return
    originals = {}
    for module, cls, name, _reason in PEFT_PATCHED_METHODS:
        owner = getattr(importlib.import_module(module), cls)
        originals[(owner, name)] = owner.__dict__[name]
    wrappers = _wrappers(_scope.handlers, originals)
    for owner, name in originals:
        setattr(owner, name, wrappers[name])
    _scope.originals = originals


def _uninstall() -> None:
    if _scope.finder is not None and _scope.finder in sys.meta_path:
        sys.meta_path.remove(_scope.finder)
    _scope.finder = None
    for (owner, name), original in (_scope.originals or {}).items():
        setattr(owner, name, original)
    _scope.originals = None


def installed() -> bool:
    """Whether peft's methods are replaced now (a pipelined model is alive and peft is imported)."""
    return _scope.originals is not None


def _release() -> None:
    _scope.live -= 1
    if _scope.live == 0:
        _uninstall()


def keep_while_alive(model: PipelineCore, handlers: PeftHandlers) -> None:
    """Replace peft's methods (now if peft is imported, else right after its import) until ``model`` and every
    other pipelined model are collected.

    Args:
        model: a pipelined model, just built.
        handlers: what runs for a pipelined model in place of peft's methods (the same for every model).
    """
    _scope.handlers = handlers
    _scope.live += 1
    weakref.finalize(model, _release)
    if "peft" in sys.modules:
        _install()
    elif _scope.finder is None and importlib.util.find_spec("peft"):
        _scope.finder = _AfterImport("peft", _install)
        sys.meta_path.insert(0, _scope.finder)


@contextlib.contextmanager
def reading_weights(edit: Callable[[dict], dict]):
    """While ``PeftModel.load_adapter`` runs: the adapter file's tensors pass through ``edit`` before peft
    maps them. peft looks the keys of ``modules_to_save`` copies up by its own module names (``stages.1.
    classifier``), which a file written on one process cannot have; ``edit`` adds them."""
    module_name, name = PEFT_WEIGHTS_READER
    module = importlib.import_module(module_name)
    read = getattr(module, name)

    def load_peft_weights(*args, **kwargs):
        return edit(read(*args, **kwargs))

    setattr(module, name, load_peft_weights)
    try:
        yield
    finally:
        setattr(module, name, read)


@contextlib.contextmanager
def converting_as(model: nn.Module, skeleton: nn.Module):
    """While ``PeftModel.load_adapter`` runs: the weight conversions peft asks transformers for on ``model`` (a
    pipelined model, whose modules are its stages) are those of ``skeleton``, the one-process model whose keys the
    adapter file has (peft renames legacy per-expert adapter keys by them; transformers raises on ``model``)."""
    module_name, name = PEFT_CONVERSIONS
    module = importlib.import_module(module_name)
    mapping = getattr(module, name)

    def get_model_conversion_mapping(target, *args, **kwargs):
        return mapping(skeleton if target is model else target, *args, **kwargs)

    setattr(module, name, get_model_conversion_mapping)
    try:
        yield
    finally:
        setattr(module, name, mapping)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` right after ``name`` is first imported (a one-shot post-import hook)."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        _scope.finder = None
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then_install(module):
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then_install
        return spec
