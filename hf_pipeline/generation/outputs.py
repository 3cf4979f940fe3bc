"""What ``generate`` returns: the ids, or with ``return_dict_in_generate=True`` transformers' own output classes.

The last stage's chooser has everything (sequences, per-step ``scores`` / ``logits``, beam search's
``sequences_scores`` / ``beam_indices``); :func:`pack` lays it out as a tuple of tensors whose
fields every rank knows from the request alone, so the pipeline broadcasts it in one go, and
:func:`build_output` makes the same object on every rank: ``GenerateDecoderOnlyOutput`` /
``GenerateEncoderDecoderOutput``, or their ``GenerateBeam*`` variants.

Not filled: ``attentions`` / ``hidden_states`` (refused: each stage holds only its own layers) and
``cache`` (each rank holds only its own layers' caches, freed when the call ends): both None.

Example (inside ``generate``):
    >>> fields = pack(ring.result(), request)            # on the last stage's rank
    >>> out = build_output(model, request, unpack(model.runtime.broadcast_from_last(fields), request))
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.utils import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
)

from ..core import PipelineCore
from .request import Request

__all__ = ["build_output", "fields", "pack", "unpack"]

_STEPWISE = ("scores", "logits")  # tuples of one (rows, vocab) tensor per step, sent stacked


def fields(req: Request) -> list[str]:
    """The result's fields, in order; the same on every rank (read from the request's config)."""
    gc = req.config
    asked = bool(gc.return_dict_in_generate)
    names = ["sequences", "lengths"]
    names += ["scores"] if asked and gc.output_scores else []
    names += ["logits"] if asked and gc.output_logits else []
    if req.num_beams > 1:
        names += ["sequences_scores"] if asked and gc.output_scores else []
        names += ["beam_indices"] if asked else []
    return names


def pack(result: dict[str, Any], req: Request) -> tuple[torch.Tensor, ...]:
    """The chooser's result as a tuple of tensors (per-step tuples stacked ``(steps, rows, vocab)``)."""
    return tuple(torch.stack(result[n]) if n in _STEPWISE else result[n] for n in fields(req))


def unpack(tensors: tuple[torch.Tensor, ...], req: Request) -> dict[str, Any]:
    """Inverse of :func:`pack`: a dict by field, per-step tensors as tuples again."""
    return {n: tuple(t.unbind(0)) if n in _STEPWISE else t for n, t in zip(fields(req), tensors)}


def build_output(model: PipelineCore, req: Request, result: dict[str, Any]):
    """``result["sequences"]``, or transformers' output object when ``return_dict_in_generate`` is set.

    Args:
        model: the pipelined model (its config says encoder-decoder or not).
        req: the request.
        result: :func:`unpack`'s dict.
    Returns:
        a ``(B, L)`` tensor, or ``Generate[Beam]{DecoderOnly,EncoderDecoder}Output``.
    """
    if not req.config.return_dict_in_generate:
        return result["sequences"]
    common = {"sequences": result["sequences"], "scores": result.get("scores"), "logits": result.get("logits")}
    if req.num_beams > 1:
        common.update(sequences_scores=result.get("sequences_scores"), beam_indices=result.get("beam_indices"))
        cls = GenerateBeamEncoderDecoderOutput if req.encoder_decoder else GenerateBeamDecoderOnlyOutput
    else:
        cls = GenerateEncoderDecoderOutput if req.encoder_decoder else GenerateDecoderOnlyOutput
    return cls(**common)
