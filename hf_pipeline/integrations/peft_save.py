"""An adapter saved from a pipelined model exactly as one process saves it.

Each rank holds the adapter tensors of its own stages. Saving gathers them (the first replica's
pipeline ranks send theirs to global rank 0, as CPU tensors under one-process keys), and rank 0
alone writes PEFT's files: first into a temporary directory beside the target, then moved into
place file by file, so a reader never sees a half-written ``adapter_model.safetensors``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pathlib
import re
import shutil
import tempfile
from typing import Callable

import torch
import torch.distributed as dist

from ..core import PipelineCore
from ..distributed.faults import spread_failures

__all__ = ["adapter_tensors", "save_adapter_files", "saving", "write_peft_model"]


_STAGE_PREFIX = re.compile(r"^(.*?)stages\.\d+\.")


def adapter_tensors(model: PipelineCore, source, adapter_name: str, prefix: str = "") -> dict[str, torch.Tensor] | None:
    """The whole model's tensors of one adapter as peft saves them on one process (``prefix + checkpoint key``
    without the adapter name), on global rank 0; None on other ranks. Collective over the pipeline.

    Args:
        model: the pipelined model, with adapters injected.
        source: what peft's ``get_peft_model_state_dict`` reads: the ``PeftModel``, or ``model`` itself
            (transformers-style adapters).
        adapter_name: the adapter.
        prefix: put before every checkpoint key (``"base_model.model."``).
    """
    from peft.utils import get_peft_model_state_dict

    found = get_peft_model_state_dict(source, adapter_name=adapter_name, save_embedding_layers=False)
    local = {prefix + _STAGE_PREFIX.sub("", k): v.detach().to("cpu", copy=True) for k, v in found.items()}
    if not model.ctx.is_distributed:
        return local
    if model.dims.dp_rank != 0 or model.dims.tp_rank != 0:
        # every replica holds the same adapter, and so does each of a stage's expert-parallel ranks (adapters on
        # tensor-parallel modules are refused): the first one's pipeline, with global rank 0, sends its stages'
        return None
    parts: list = [None] * model.plan.pp_size if model.ctx.rank == 0 else None
    if model.plan.pp_size > 1:
        dist.gather_object(local, parts, dst=0, group=model.dims.pp_group)
    else:
        parts = [local]
    if model.ctx.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return dict(sorted(merged.items()))


@contextlib.contextmanager
def saving(model: PipelineCore):
    """A failure while saving on any rank reaches every rank (none waits forever for rank 0)."""
    groups = (model.dims.pp_group, model.dims.dp_group)
    with spread_failures(model.ctx, "save_pretrained", groups=groups, describe=model.rank_label):
        yield


def save_adapter_files(save_directory: str | os.PathLike, write: Callable[[pathlib.Path], None]) -> None:
    """On rank 0: ``write(tmp)`` the adapter's files into a temporary directory, then move each into
    ``save_directory`` (``os.replace``: atomic per file).

    Args:
        save_directory: the target directory.
        write: writes the files of the adapter into the directory it is given.
    """
    target = pathlib.Path(save_directory)
    target.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.adapter-", dir=target.parent))
    try:
        write(tmp)
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                dest = target / path.relative_to(tmp)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_peft_model(peft_model, model: PipelineCore, tensors: dict[str, dict[str, torch.Tensor]],
                     directory: pathlib.Path) -> None:
    """What ``PeftModel.save_pretrained`` writes on one process: the model card, and per adapter (``"default"``
    in ``directory``, others in a subdirectory of their name) its tensors and its config in inference mode.

    Args:
        peft_model: the ``PeftModel``.
        model: the pipelined model it wraps.
        tensors: adapter name -> :func:`adapter_tensors` of it.
        directory: where to write.
    """
    from safetensors.torch import save_file

    peft_model.create_or_update_model_card(str(directory))
    base = type(model.skeleton)  # the transformers class one process would name in auto_mapping
    for name, found in tensors.items():
        out = directory if name == "default" else directory / name
        out.mkdir(parents=True, exist_ok=True)
        tensors_out = {k: v.contiguous() for k, v in found.items()}
        save_file(tensors_out, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(peft_model.peft_config[name])
        config.base_model_name_or_path = config.base_model_name_or_path or model.name_or_path or None
        config.inference_mode = True
        auto = {"base_model_class": base.__name__, "parent_library": base.__module__}
        auto = None if config.task_type is not None else auto
        config.save_pretrained(str(out), auto_mapping_dict=auto)
