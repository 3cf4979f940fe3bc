"""Drop-in Auto classes: ``from_pretrained(path)`` is transformers'; ``pipeline=True`` pipelines it."""

from __future__ import annotations

from typing import Any

import transformers

__all__ = ["AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification"]

_PIPELINE_KWARGS = (
    "n_microbatches", "num_stages", "virtual_stages", "schedule", "split", "dtype", "device", "gather_output",
    "revision", "progress", "config", "split_method",
)


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
                dtype, device, gather_output, revision, progress, config, split_method. Otherwise transformers' own.
        """
        if not pipeline:
            return cls._hf_class.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if args:
            raise TypeError("positional model arguments are not supported with pipeline=True")
        unknown = sorted(set(kwargs) - set(_PIPELINE_KWARGS))
        if unknown:
            raise TypeError(f"unexpected argument(s) {unknown} with pipeline=True; supported: {list(_PIPELINE_KWARGS)}")
        from .model import load_pipelined

        return load_pipelined(cls._hf_class, pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_config(cls, config, **kwargs: Any):
        return cls._hf_class.from_config(config, **kwargs)


def _make(name: str) -> type:
    return type(name, (_PipelineAuto,), {"_hf_class": getattr(transformers, name), "__doc__": f"``transformers.{name}`` with ``pipeline=True``."})


AutoModel = _make("AutoModel")
AutoModelForCausalLM = _make("AutoModelForCausalLM")
AutoModelForMaskedLM = _make("AutoModelForMaskedLM")
AutoModelForSeq2SeqLM = _make("AutoModelForSeq2SeqLM")
AutoModelForSequenceClassification = _make("AutoModelForSequenceClassification")
