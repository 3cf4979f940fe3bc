"""The model's ``GenerationConfig``: the checkpoint's ``generation_config.json``, merged with a call's arguments.

``generate`` and the model's ``generation_config`` property both read it from here, so the file is
read once per model and a value assigned on the model is what ``generate`` uses by default.

Example:
    >>> generation_config(model).max_new_tokens
    >>> config, rest = prepare_generation_config(model, None, max_new_tokens=8, do_sample=True)
"""

from __future__ import annotations

import pathlib
import weakref
from typing import Any

from transformers import GenerationConfig

from ..compat import generation_helper
from ..core import PipelineCore

__all__ = ["generation_config", "prepare_generation_config"]

# The skeletons whose checkpoint file was looked for already (read, or found absent): as transformers'
# from_pretrained, it is read once per model, and a config assigned afterwards is never replaced.
# Weak, so a dropped model is forgotten with it.
_FILE_READ: weakref.WeakSet = weakref.WeakSet()


def generation_config(model: PipelineCore) -> GenerationConfig:
    """The model's default ``GenerationConfig``: the checkpoint's ``generation_config.json`` if it has one.

    As transformers' ``from_pretrained``: the file wins, else it is derived from the model config.
    Loaded once and kept on ``model.skeleton`` (whose transformers helpers read it).

    Args:
        model: a :class:`~hf_pipeline.model.PipelinedModel`.
    Returns:
        ``model.skeleton.generation_config``.
    """
    skel = model.skeleton
    if skel not in _FILE_READ:
        path = getattr(model, "checkpoint_dir", None)
        if path is not None and (pathlib.Path(path) / "generation_config.json").is_file():
            skel.generation_config = GenerationConfig.from_pretrained(path)
        _FILE_READ.add(skel)
    return skel.generation_config


def prepare_generation_config(
    model: PipelineCore, config: GenerationConfig | None = None, **kwargs: Any
) -> tuple[GenerationConfig, dict[str, Any]]:
    """Merge ``config`` / ``kwargs`` over the model's generation config exactly as transformers does.

    Returns:
        (the merged ``GenerationConfig``, the kwargs that are not generation parameters).
    """
    generation_config(model)
    return generation_helper(model.skeleton, "_prepare_generation_config")(config, **kwargs)
