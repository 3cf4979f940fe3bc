"""What a pipelined model adds for adapters: its handlers of peft's calls and transformers' adapter methods.

``PipelinedModel`` derives from :class:`AdapterHost`, which is transformers' own
``PeftAdapterMixin`` (``add_adapter``, ``load_adapter``, ``set_adapter``, ``disable_adapters``,
``enable_adapters``, ``active_adapters``, ``delete_adapter``, ``get_adapter_state_dict``): those
methods walk ``self.modules()`` and call peft, which here injects into and switches the local
stages' modules. Every call is made on every rank with the same arguments.

Example (every rank):
    >>> model.add_adapter(LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    >>> model.train_step(batch)                     # only lora_A / lora_B get gradients
    >>> model.save_pretrained("adapter/")           # adapter_config.json + adapter_model.safetensors
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any

from torch import nn
from transformers.integrations import PeftAdapterMixin

from ..errors import InputError
from . import peft_patches
from .peft_agree import agree_on_config, agree_on_files, agreed, refuse_tensor_parallel
from .peft_experts import on_parameter_mesh, run_locally
from .peft_fsdp import refuse_under_fsdp
from .peft_inject import AdapterState, inject_on_stages, local_adapter_keys, wrapped_module_keys
from .peft_save import adapter_tensors, save_adapter_files, saving, write_peft_model

__all__ = ["AdapterHost", "AdapterState", "is_pipelined_model"]

_NO_STATE_DICT = "save_pretrained(state_dict=...) is not supported on a pipelined model: every rank's part is gathered"


class AdapterHost(PeftAdapterMixin):
    """Adapter support of ``PipelinedModel`` (a mixin: it reads ``stages``, ``skeleton``, ``ctx``, ``dims``,
    ``plan``, ``resolved`` and ``train_step_state`` of the model)."""

    adapter_state: AdapterState | None = None
    adapter_loading: str | None = None  # the adapter being loaded (see loading_adapter)
    _require_grads_hook = None  # the handle of enable_input_require_grads' hook

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        peft_patches.keep_while_alive(self, _HANDLERS)

    # peft's PeftModelForCausalLM reads it when wrapping a model; generate() of this model builds
    # its own inputs, so this is only the HF model's rule, for code that asks.
    def prepare_inputs_for_generation(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.skeleton.prepare_inputs_for_generation(*args, **kwargs)

    def enable_input_require_grads(self) -> None:
        """Make the input embeddings' output require grad (on the rank holding them), as transformers does:
        a first stage whose own weights are all frozen still passes gradients back through its output."""
        embeddings = self.get_input_embeddings()
        if embeddings is not None and self._require_grads_hook is None:

            def make_inputs_require_grads(module, inputs, output):
                output.requires_grad_(True)

            self._require_grads_hook = embeddings.register_forward_hook(make_inputs_require_grads)

    def load_adapter(self, *args: Any, **kwargs: Any) -> None:
        """transformers' ``load_adapter``, agreed: same adapter files on every rank; one error on all. Collective."""
        name = kwargs.get("adapter_name") or (args[1] if len(args) > 1 else None) or "default"
        source = kwargs.get("peft_model_id") or (args[0] if args else None)
        state = kwargs.get("adapter_state_dict")
        agree_on_files(self, source if state is None else state, name, kwargs.get("subfolder"),
                       revision=kwargs.get("revision"))
        with agreed(self, f"loading adapter {name!r}"), self.loading_adapter(name):
            return super().load_adapter(*args, **kwargs)

    def attach_adapter(self, tuner, original, adapter_name: str, **kwargs: Any) -> None:
        """peft's injection on this rank's stages (see :func:`~hf_pipeline.integrations.peft_inject.inject_on_stages`).
        Collective: the config is compared across ranks first, and a failure on any rank raises on every rank."""
        refuse_tensor_parallel(self, tuner.peft_config[adapter_name])
        refuse_under_fsdp(self, tuner.peft_config[adapter_name])
        agree_on_config(self, tuner.peft_config[adapter_name], adapter_name)
        with agreed(self, f"injecting adapter {adapter_name!r}"):
            targets = inject_on_stages(tuner, original, self, adapter_name, **kwargs)
        if self.adapter_state is None:
            state = AdapterState()
            state.load_hook = self.register_load_state_dict_pre_hook(_load_hook)
            self.adapter_state = state
        self.adapter_state.targets = sorted(set(self.adapter_state.targets) | set(targets))
        self.enable_input_require_grads()
        self.train_step_state = None  # the parameters (and which train) changed: rebuilt on the next step

    def save_adapter(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """``save_pretrained`` of a model with transformers-style adapters: the active adapter in PEFT's
        format, as transformers writes it on one process. Collective."""
        from safetensors.torch import save_file

        if kwargs.get("state_dict") is not None:
            raise InputError(_NO_STATE_DICT)
        name = self.active_adapters()[0]
        with saving(self):
            found = adapter_tensors(self, self, name, prefix="base_model.model.")
            if found is None:
                return

            def write(tmp):
                save_file(found, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
                self.peft_config[name].save_pretrained(str(tmp))

            save_adapter_files(save_directory, write)

    @contextlib.contextmanager
    def loading_adapter(self, adapter_name: str):
        """While peft or transformers loads ``adapter_name``: the file's keys (without the adapter name) are
        mapped to this rank's stage keys by the ``load_state_dict`` pre-hook."""
        self.adapter_loading = adapter_name
        try:
            yield
        finally:
            self.adapter_loading = None


def _load_hook(module, state_dict, prefix, *args) -> None:
    local_adapter_keys(module, state_dict, prefix)


def _save_peft_model(peft_model, original, save_directory, *args, **kwargs) -> None:
    """``PeftModel.save_pretrained`` of a pipelined base model (collective): what one process writes."""
    model = peft_model.base_model.model
    bound = inspect.signature(original).bind(peft_model, save_directory, *args, **kwargs).arguments
    extra = bound.get("kwargs", {})
    for name, ok in (("safe_serialization", True), ("path_initial_model_for_weight_conversion", None)):
        if bound.get(name, ok) != ok:
            raise InputError(f"save_pretrained({name}=...) is not supported on a pipelined model: leave it unset")
    if extra.get("state_dict") is not None:
        raise InputError(_NO_STATE_DICT)
    names = bound.get("selected_adapters") or list(peft_model.peft_config)
    with saving(model):
        found = {n: adapter_tensors(model, peft_model, n, prefix="base_model.model.") for n in names}
        if model.ctx.rank == 0:
            save_adapter_files(save_directory, lambda tmp: write_peft_model(peft_model, model, found, tmp))


def _load_into_peft_model(peft_model, original, model_id, adapter_name, *args, **kwargs):
    """``PeftModel.load_adapter`` of a pipelined base model (collective): the same adapter files on every rank
    (compared by content), then each rank's load, a failure on any rank raised on every rank."""
    model = peft_model.base_model.model
    agree_on_files(model, model_id, adapter_name, kwargs.get("subfolder"), revision=kwargs.get("revision"))
    with (
        agreed(model, f"loading adapter {adapter_name!r}"),
        model.loading_adapter(adapter_name),
        peft_patches.reading_weights(lambda w: wrapped_module_keys(model, w)),
        peft_patches.converting_as(model, model.skeleton),
    ):
        return original(peft_model, model_id, adapter_name, *args, **kwargs)


def is_pipelined_model(module: Any) -> bool:
    """Whether ``module`` is a pipelined model (``PipelinedModel`` is the one module class hosting adapters here)."""
    return isinstance(module, AdapterHost) and isinstance(module, nn.Module)


_HANDLERS = peft_patches.PeftHandlers(
    inject=lambda tuner, original, model, name, **kw: model.attach_adapter(tuner, original, name, **kw),
    save=_save_peft_model,
    load=_load_into_peft_model,
    is_pipelined=is_pipelined_model,
    place=on_parameter_mesh,
    run_locally=run_locally,
)
