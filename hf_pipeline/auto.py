"""Drop-in Auto classes: ``from_pretrained(path)`` is transformers'; ``pipeline=True`` pipelines it."""

from __future__ import annotations

from typing import Any

import transformers

from .errors import InputTypeError
from .load_options import LoadOptions

__all__ = [
    "AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForMultipleChoice",
    "AutoModelForQuestionAnswering", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
]


class _PipelineAuto:
    _hf_class: type

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args: Any, pipeline: bool = False, **kwargs: Any):
        """Load a model.

        Args:
            pretrained_model_name_or_path: local directory or hub id (from the local cache).
            pipeline: False returns exactly ``transformers.<AutoClass>.from_pretrained(...)``; True returns
                a :class:`hf_pipeline.model.PipelinedModel` (collective: call it on every rank).
            **kwargs: with ``pipeline=True``: the fields of :class:`~hf_pipeline.load_options.LoadOptions` (what each
                does, and where it acts), transformers' alias ``torch_dtype``; ``low_cpu_mem_usage`` and
                ``local_files_only`` are accepted and change nothing; ``device_map`` is refused (the pipeline places
                stages itself). Otherwise transformers' own.

        Raises:
            InputTypeError: an argument ``pipeline=True`` does not take (a ``TypeError``).
            InputError: ``device_map``, or a bad value (a ``ValueError``, as transformers raises).
        """
        if not pipeline:
            return cls._hf_class.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if args:
            raise InputTypeError("positional model arguments are not supported with pipeline=True")
        options = LoadOptions.from_kwargs(kwargs)
        from .model import load_pipelined

        return load_pipelined(cls._hf_class, pretrained_model_name_or_path, options)

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
