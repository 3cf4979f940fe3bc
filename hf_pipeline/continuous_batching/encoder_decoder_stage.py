"""One stage's part of the continuous ring for an encoder-decoder model (T5): encoder once per row, decoder per step.

The stages hold the encoder's blocks first and the decoder's after (one stage may hold the encoder's
tail and the decoder's head). What :class:`EncoderDecoderStage` does with one op of a group:

  * a joining row runs the encoder once, as it joins: its prompt is the encoder's input (the rows that
    join together left padded, with an attention mask: T5's relative position bias sees only distances,
    so padding moves no row's output), and then its decoder start token through the decoder stages, on a
    fresh ``EncoderDecoderCache`` whose cross-attention part the first decoder step fills;
  * its encoder output ``(rows, T_enc, hidden)`` travels down the ring with its joining hidden states
    (after a decoder stage: ``cat([encoder output, hidden])``, ``(joining, T_enc + 1, hidden)``) and is
    kept per row in the group of every decoder stage, with its encoder mask, right aligned to the
    group's widest (as :mod:`.group_cache` merges keys: the zero columns it adds are masked);
  * rows that stay decode one step with the group's self-attention mask ``(rows, columns)``, the group's
    encoder outputs and masks and the cross-attention keys and values cached at their first step (merged
    like the self-attention ones, their columns the encoder's; transformers' T5 reads those keys and
    values from the cache once filled, and the encoder output for its shape);
  * rows that leave are dropped from all of those, and columns no remaining row uses are cut;
  * an encoder-only stage keeps nothing per group: its kept rows' inputs (the tokens they decode next)
    pass through it untouched, to the first decoder stage.

Prompts are not chunked and prefixes not reused here: the encoder attends both ways, so a prompt
runs whole, and a decoder's prompt is its one start token. The last stage chooses tokens as
:class:`~.ring_stage.RingStage` does, its processors seeing the decoder's ids (the start token, then
the tokens chosen), as transformers' ``generate`` gives them for an encoder-decoder model.

Example (inside the ring, for group ``i``):
    >>> old_out, new_out = stage.run(i, header, new_rows, old_in, new_in)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..core import PipelineCore
from ..errors import InputError, InternalError
from ..generation.config import generation_config
from ..generation.kv_cache import new_cache
from .group_cache import cut_unused, merge
from .ring_stage import RingStage, kept_rows
from .wire import NewRow, OpHeader

__all__ = ["EncoderDecoderStage", "stage_roles"]


def stage_roles(model: PipelineCore, index: int) -> tuple[bool, bool]:
    """Stage ``index``: (whether it holds encoder blocks, whether it holds decoder blocks); the generating
    stack (the last of the model's stacks) is the decoder."""
    decoder = model.resolved.stacks[-1].name
    stacks = model.plan.stages[index].stacks
    return any(n != decoder for n in stacks), decoder in stacks


def _pad_left(t: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """``t`` left padded with zeros along ``dim`` to ``width`` (encoder outputs ``(rows, T, H)``, masks)."""
    pad = [0, 0] * (t.dim() - 1 - dim) + [width - t.shape[dim], 0]
    return F.pad(t, pad)


class EncoderDecoderStage(RingStage):
    """One stage's groups in the continuous ring of an encoder-decoder model (see the module docstring).

    Args: as :class:`~.ring_stage.RingStage` (``prefix`` must be None: no prefix reuse).
    """

    def __init__(self, model: PipelineCore, stage: Any, **kwargs):
        super().__init__(model, stage, **kwargs)
        if self.prefix is not None:
            raise InternalError("encoder-decoder rows reuse no prompt prefixes (the encoder attends both ways)")
        self.encoder, self.decoder = stage_roles(model, self.index)
        # The first decoder stage takes the rows' tokens; the stage before it (encoder only) passes them on.
        self.first_decode = self.decoder and (self.first or not stage_roles(model, self.index - 1)[1])
        self.after_decoder = not self.first and stage_roles(model, self.index - 1)[1]
        # Up to the first decoder stage, the kept rows' inputs are the tokens they decode next.
        self.takes_tokens = not self.first and not self.after_decoder
        start = generation_config(model).decoder_start_token_id
        if start is None:
            start = getattr(model.config, "decoder_start_token_id", None)
        if start is None:
            raise InputError("the encoder-decoder model names no decoder_start_token_id (generation config or "
                             "config); set it to the token its decoder starts from")
        self.start = int(start[0] if isinstance(start, (list, tuple)) else start)

    def received_width(self, rows: list[NewRow]) -> int:
        """Columns of the joining rows' states this stage receives: their widest prompt (the encoder's
        states), and one more (the decoder's state) after a decoder stage."""
        return max(len(r.prompt) for r in rows) + int(self.after_decoder)

    def first_ids(self, r: NewRow) -> torch.Tensor:
        """The decoder's ids a joining row's processors start from: its start token ``(1, 1)``."""
        return torch.tensor([[self.start]], dtype=torch.long, device=self.device)

    def run(self, i: int, header: OpHeader, new: list[NewRow], old_in: torch.Tensor | None,
            new_in: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Group ``i``'s op (see :meth:`RingStage.run`); an encoder-only stage passes the kept rows' tokens on."""
        if any(not r.whole for r in new):
            raise InternalError("encoder-decoder rows join with their whole prompt (no chunks, no prefixes)")
        old_slots = list(header.kept)
        g = self.state[i]
        if not self.decoder:
            g.slots = old_slots + [r.slot for r in new]
            return old_in if old_slots else None, (self._encode(new, new_in) if new else None)
        self._keep(g, old_slots)
        old_out = self._timed("decode", self._decode, g, old_in) if old_slots else None
        new_out = self._timed("prefill", self._prefill, g, new, new_in) if new else None
        g.slots = old_slots + [r.slot for r in new]
        return old_out, new_out

    # ------------------------------------------------------------ joining rows
    def _enc_mask(self, new: list[NewRow]) -> torch.Tensor:
        """The joining rows' encoder mask ``(joining, widest prompt)``, left padded."""
        width = max(len(r.prompt) for r in new)
        return torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in new],
                            dtype=torch.long, device=self.device)

    def _encode(self, new: list[NewRow], received: torch.Tensor | None) -> torch.Tensor:
        """This stage's encoder blocks on the joining rows: ``(joining, widest prompt, hidden)``."""
        mask = self._enc_mask(new)
        inputs: dict[str, Any] = {"attention_mask": mask}
        if self.first:  # the padding positions' ids are masked out; 0 is any valid id
            inputs["input_ids"] = torch.tensor([[0] * (mask.shape[1] - len(r.prompt)) + r.prompt for r in new],
                                               dtype=torch.long, device=self.device)
            hidden: tuple = ()
        else:
            hidden = (received[:, : mask.shape[1]],)
        self.forwards += 1
        out = self.stage(*hidden, **inputs)  # no decoder ids: the glue returns the encoder's states
        return out[0] if isinstance(out, tuple) else out

    def _prefill(self, g, new: list[NewRow], received: torch.Tensor | None) -> torch.Tensor:
        """The joining rows' encoder (where this stage holds encoder blocks) and first decoder step on a fresh cache,
        which then joins the group's; ``cat([encoder output, hidden])`` (last stage: the logits)."""
        enc_mask = self._enc_mask(new)
        width = enc_mask.shape[1]
        if self.encoder:
            enc_out, hidden = self._encode(new, received), None
        else:
            enc_out = received[:, :width]
            hidden = received[:, width:] if self.after_decoder else None  # (joining, 1, hidden)
        ids = torch.full((len(new), 1), self.start, dtype=torch.long, device=self.device)
        cache = new_cache(self.model.config, encoder_decoder=True)
        out = self._step(ids if self.first_decode else hidden, cache, None, enc_out, enc_mask)
        self._join(g, cache, torch.ones(len(new), 1, dtype=torch.long, device=self.device), enc_out, enc_mask)
        if self.last:
            return out
        return torch.cat([enc_out.to(out.dtype), out], dim=1)

    def _join(self, g, cache, mask: torch.Tensor, enc_out: torch.Tensor, enc_mask: torch.Tensor) -> None:
        """Rows whose first step ran (``cache``, self mask ``mask``) join the group after its rows, with their
        encoder outputs and masks (and cross-attention columns) right aligned to the group's widest."""
        if g.cache is None:
            g.cache, g.mask, g.enc_out, g.enc_mask = cache, mask, enc_out, enc_mask
            return
        g.mask = merge(g.cache.self_attention_cache, g.mask, cache.self_attention_cache, mask)
        merged = merge(g.cache.cross_attention_cache, g.enc_mask, cache.cross_attention_cache, enc_mask)
        width = merged.shape[1]
        g.enc_out = torch.cat([_pad_left(g.enc_out, width), _pad_left(enc_out, width)])
        g.enc_mask = merged

    # ------------------------------------------------------------ kept rows
    def _step(self, received: torch.Tensor, cache, mask: torch.Tensor | None, enc_out: torch.Tensor,
              enc_mask: torch.Tensor) -> torch.Tensor:
        """One decoder step of this stage's decoder blocks: tokens ``(rows, 1)`` on the first decoder stage, else
        hidden states ``(rows, 1, hidden)``; the encoder output given, so the glue runs no encoder block."""
        inputs: dict[str, Any] = {"cache": cache, "encoder_outputs": enc_out, "attention_mask": enc_mask}
        if mask is not None:
            inputs["decoder_attention_mask"] = mask
        if self.first_decode:
            inputs["decoder_input_ids"] = received
            hidden: tuple = ()
        else:
            hidden = (received,)
        if self.last:
            inputs["logits_to_keep"] = 1
        self.forwards += 1
        out = self.stage(*hidden, **inputs)
        return out[0] if isinstance(out, tuple) else out  # a middle stage also returns the encoder output

    def _decode(self, g, received: torch.Tensor) -> torch.Tensor:
        """The kept rows' next step on the group's caches."""
        g.mask = torch.cat([g.mask, g.mask.new_ones(g.mask.shape[0], 1)], dim=1)
        return self._step(received, g.cache, g.mask, g.enc_out, g.enc_mask)

    def _keep(self, g, slots: list[int]) -> None:
        """Keep only ``slots`` (in their order); cut self- and cross-attention columns no kept row uses."""
        if slots == g.slots:
            return
        if not slots:
            g.slots, g.cache, g.mask, g.enc_out, g.enc_mask = [], None, None, None, None
            return
        keep = kept_rows(g.slots, slots, self.device)
        g.cache.batch_select_indices(keep)
        g.mask, g.enc_out, g.enc_mask, g.slots = g.mask[keep], g.enc_out[keep], g.enc_mask[keep], slots
        g.mask = cut_unused(g.cache.self_attention_cache, g.mask)
        enc_mask = cut_unused(g.cache.cross_attention_cache, g.enc_mask)
        g.enc_out, g.enc_mask = g.enc_out[:, g.enc_out.shape[1] - enc_mask.shape[1]:], enc_mask

