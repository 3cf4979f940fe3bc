"""Drop-in Auto classes: ``from_pretrained(path)`` is transformers'; ``pipeline=True`` pipelines it."""

from __future__ import annotations

from typing import Any

import transformers

from .errors import InputError, InputTypeError

__all__ = [
    "AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForMultipleChoice",
    "AutoModelForQuestionAnswering", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
]

_PIPELINE_KWARGS = (
    "n_microbatches", "num_stages", "virtual_stages", "schedule", "split", "dtype", "device", "gather_output",
    "revision", "cache_dir", "subfolder", "attn_implementation", "trust_remote_code", "progress", "config",
    "split_method", "tune_batch", "max_memory", "tp_size", "distributed_config", "device_mesh",
    "fsdp_size",
)
# transformers' from_pretrained arguments that change nothing here, and why.
_NO_OPS = {
    "low_cpu_mem_usage": "each rank always reads only its own tensors, straight into place",
    "local_files_only": "nothing is ever downloaded: a hub id must already be in the local cache",
}
_DEVICE_MAP = (
    "device_map={!r} is not supported with pipeline=True: the pipeline places the stages itself (one or more per rank, "
    "on cuda:LOCAL_RANK, else the CPU); choose the placement with num_stages / virtual_stages / split, force a device "
    "with device='cpu', or load with pipeline=False to use device_map"
)


def _transformers_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The pipelined loader's keyword arguments from what a transformers user passes.

    Aliases become their names (``torch_dtype`` -> ``dtype``; ``dtype`` wins when both are given,
    as in transformers), no-ops are dropped, ``device_map`` is refused; anything else unknown is an
    :class:`~hf_pipeline.errors.InputTypeError` (a ``TypeError``).
    """
    kwargs = dict(kwargs)
    torch_dtype = kwargs.pop("torch_dtype", None)
    if kwargs.get("dtype") is None and torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    for name in _NO_OPS:
        kwargs.pop(name, None)
    device_map = kwargs.pop("device_map", None)
    if device_map is not None:
        raise InputError(_DEVICE_MAP.format(device_map))
    unknown = sorted(set(kwargs) - set(_PIPELINE_KWARGS))
    if unknown:
        raise InputTypeError(
            f"unexpected argument(s) {unknown} with pipeline=True; supported: {list(_PIPELINE_KWARGS)}, "
            f"torch_dtype (an alias of dtype), and accepted without effect: {list(_NO_OPS)}"
        )
    return kwargs


class _PipelineAuto:
    _hf_class: type

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args: Any, pipeline: bool = False, **kwargs: Any):
        """Load a model.

        Args:
            pretrained_model_name_or_path: local directory or hub id (from the local cache).
            pipeline: False returns exactly ``transformers.<AutoClass>.from_pretrained(...)``; True returns
                a :class:`hf_pipeline.model.PipelinedModel` (collective: call it on every rank).
            **kwargs: with ``pipeline=True``: n_microbatches, num_stages, virtual_stages, schedule, split,
                dtype (or its alias torch_dtype), device, gather_output, revision, cache_dir, subfolder,
                attn_implementation, trust_remote_code (refused for a checkpoint with its own code), progress,
                config, split_method, tune_batch and max_memory (with schedule="auto" / n_microbatches="auto");
                low_cpu_mem_usage and local_files_only are accepted and change nothing; device_map is refused
                (the pipeline places stages itself). Otherwise transformers' own.

        Raises:
            InputTypeError: an argument ``pipeline=True`` does not take (a ``TypeError``).
            InputError: ``device_map``, or a bad value (a ``ValueError``, as transformers raises).
        """
        if not pipeline:
            return cls._hf_class.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if args:
            raise InputTypeError("positional model arguments are not supported with pipeline=True")
        kwargs = _transformers_kwargs(kwargs)
        from .model import load_pipelined

        return load_pipelined(cls._hf_class, pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_config(cls, config, **kwargs: Any):
        return cls._hf_class.from_config(config, **kwargs)


def _make(name: str) -> type:
    doc = f"``transformers.{name}`` with ``pipeline=True``."
    namespace = {"_hf_class": getattr(transformers, name), "__doc__": doc}
    return type(name, (_PipelineAuto,), namespace)


AutoModel = _make("AutoModel")
AutoModelForCausalLM = _make("AutoModelForCausalLM")
AutoModelForMaskedLM = _make("AutoModelForMaskedLM")
AutoModelForSeq2SeqLM = _make("AutoModelForSeq2SeqLM")
AutoModelForSequenceClassification = _make("AutoModelForSequenceClassification")
AutoModelForTokenClassification = _make("AutoModelForTokenClassification")
AutoModelForQuestionAnswering = _make("AutoModelForQuestionAnswering")
AutoModelForMultipleChoice = _make("AutoModelForMultipleChoice")
