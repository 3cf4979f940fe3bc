"""The checkpoint key renames transformers applies on load (``LayerNorm.gamma`` -> ``.weight``, ...).

The loader reads a legacy key under the name transformers would load it as, so a checkpoint
transformers accepts is accepted here; the renames are asked of transformers itself.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["checkpoint_key_renames"]


# What transformers' "legacy" conversion mapping renames (older checkpoints), for a transformers
# whose from_pretrained has no rename mechanism to ask.
_LEGACY_RENAMES = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))


def checkpoint_key_renames(model, keys: Iterable[str]) -> dict[str, str]:
    """Checkpoint keys that transformers' ``from_pretrained`` loads under another name: key -> model name.

    transformers renames checkpoint keys before matching them to the model: the model class's and
    its sub-models' registered conversion mapping plus the "legacy" renames that every model gets
    (``LayerNorm.gamma``/``beta`` -> ``weight``/``bias``, ``weight_g``/``weight_v`` -> weight-norm
    parametrizations, GPT-NeoX's ``embed_out`` -> ``lm_head``, ...). The renames come from
    transformers itself (``get_model_conversion_mapping`` + ``rename_source_key``), so a checkpoint
    it accepts is accepted here. Only pure renames apply: conversions that merge or split tensors
    (fused MoE experts, fused qkv) change the data and are not done by the per-stage loader. The
    base-model prefix is left alone: the loader's prefix aliases handle it.

    Args:
        model: the (meta-device) transformers model the checkpoint is loaded into.
        keys: the checkpoint's keys.

    Returns:
        Only the keys a rename changes.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings applied only the legacy renames
        return {k: _legacy_rename(k) for k in keys if _legacy_rename(k) != k}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    out = {}
    for key in keys:
        renamed, _ = rename_source_key(key, renamings, [])
        if renamed != key:
            out[key] = renamed
    return out


def _legacy_rename(key: str) -> str:
    for old, new in _LEGACY_RENAMES:
        key = key.replace(old, new)
    return key
