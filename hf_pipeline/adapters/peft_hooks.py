"""Where peft's own entry points hand a pipelined model to this room.

peft has no extension point for a model whose modules are spread over ranks: its injection walks
one process's modules (and raises on a rank whose stages hold no target), its state-dict keys are
the local module names, and ``PeftModel.save_pretrained`` writes what the local process holds. So
three of its methods are wrapped, once per process: ``BaseTuner.inject_adapter`` (reached from
``get_peft_model``, ``PeftModel.from_pretrained`` / ``load_adapter`` / ``add_adapter`` and
transformers' ``add_adapter`` / ``load_adapter``), ``PeftModel.save_pretrained``, and
``PeftModel.load_adapter`` (so that the file's keys, named as on one process, reach the local
stages). Each wrapper checks whether the model is pipelined and otherwise calls peft's own method
unchanged.

peft is imported only by users of adapters: the wrappers are installed when a pipelined model is
built in a process that has imported peft, or, when peft is imported later, right after its import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import inspect
import sys
from typing import Any, Callable

__all__ = ["install", "install_when_imported", "reading_weights"]

_installed: list[bool] = []


def install(
    inject: Callable[..., Any], save: Callable[..., Any], load: Callable[..., Any], is_pipelined: Callable[[Any], bool]
) -> None:
    """Wrap peft's ``BaseTuner.inject_adapter``, ``PeftModel.save_pretrained`` and ``PeftModel.load_adapter``
    (once per process).

    Args:
        inject: ``inject(tuner, original, model, adapter_name, **kwargs)``, for a pipelined model.
        save: ``save(peft_model, original, save_directory, *args, **kwargs)``, for a pipelined base model.
        load: ``load(peft_model, original, model_id, adapter_name, *args, **kwargs)``, likewise.
        is_pipelined: whether a module is a pipelined model.
    """
    if _installed:
        return
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    original_inject, original_save = BaseTuner.inject_adapter, PeftModel.save_pretrained
    original_load = PeftModel.load_adapter
    signature = inspect.signature(original_inject)

    @functools.wraps(original_inject)
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        if not is_pipelined(model):
            return original_inject(self, model, adapter_name, *args, **kwargs)
        bound = signature.bind(self, model, adapter_name, *args, **kwargs).arguments
        rest = {k: v for k, v in bound.items() if k not in ("self", "model", "adapter_name")}
        return inject(self, original_inject, model, adapter_name, **rest)

    @functools.wraps(original_save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if not is_pipelined(getattr(self.base_model, "model", None)):
            return original_save(self, save_directory, *args, **kwargs)
        return save(self, original_save, save_directory, *args, **kwargs)

    @functools.wraps(original_load)
    def load_adapter(self, model_id, adapter_name, *args, **kwargs):
        if not is_pipelined(getattr(self.base_model, "model", None)):
            return original_load(self, model_id, adapter_name, *args, **kwargs)
        return load(self, original_load, model_id, adapter_name, *args, **kwargs)

    BaseTuner.inject_adapter = inject_adapter
    PeftModel.load_adapter = load_adapter
    PeftModel.save_pretrained = save_pretrained
    _installed.append(True)


@contextlib.contextmanager
def reading_weights(edit: Callable[[dict], dict]):
    """While ``PeftModel.load_adapter`` runs: the adapter file's tensors pass through ``edit`` before peft
    maps them. peft looks the keys of ``modules_to_save`` copies up by its own module names (``stages.1.
    classifier``), which a file written on one process cannot have; ``edit`` adds them."""
    import peft.peft_model as peft_model

    read = peft_model.load_peft_weights

    def load_peft_weights(*args, **kwargs):
        return edit(read(*args, **kwargs))

    peft_model.load_peft_weights = load_peft_weights
    try:
        yield
    finally:
        peft_model.load_peft_weights = read


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` right after ``name`` is first imported (a one-shot post-import hook)."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then_install(module):
            exec_module(module)
            then()

        spec.loader.exec_module = exec_then_install
        return spec


def install_when_imported(then: Callable[[], None]) -> None:
    """``then()`` now if peft is imported, else right after its import (nothing when peft is not installed)."""
    if _installed:
        return
    if "peft" in sys.modules:
        then()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path) and importlib.util.find_spec("peft"):
        sys.meta_path.insert(0, _AfterImport("peft", then))
