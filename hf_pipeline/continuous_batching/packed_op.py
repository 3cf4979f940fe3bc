"""One op's rows in one forward: the decoding rows' next tokens and the joining rows' prompt parts, packed.

Without packing an op that has joining rows runs two forwards on a stage: the decoding rows on the
group's cache, then the joining rows' parts on theirs (:mod:`.ring_stage`). On a device where a
forward of a few rows is bound by reading the stage's weights (decode on a CPU, and on a GPU at
these batch sizes), that second forward costs about as much as the first whatever its prompt
length, and padding the decoding rows to a prompt's width in one batched forward would multiply
their work by that width instead. A one-process continuous batcher runs both in one forward of
ragged rows (transformers' paged attention); so does this module, for a stage whose glue says it
can (:attr:`~hf_pipeline.families.glue.base.Glue.packs_rows`):

  * every row's new tokens side by side in one sequence ``(1, T)`` (ids) or ``(1, T, hidden)``: the
    decoding rows' one token each, then each joining row's part of its prompt; positions per token;
  * a :class:`PackedCache` for the forward: each layer's past keys and values, packed the same way
    ``(1, kv_heads, K, head_dim)`` (the group cache's rows one after another, padding columns
    included, then each joining row's own past: an earlier chunk, a reused prefix), to which
    ``update`` appends the forward's new keys and values, keeping them to be written back (one layer's
    packed copy at a time: each layer's is made when it asks, and dropped once its attention ran);
  * a mask ``(1, 1, T, K + T)`` per attention kind (transformers' masking functions take a 4D mask as
    it is, and a hybrid model a dict of them) that lets each token see its own row's past columns and
    its own row's new tokens up to itself: boolean for SDPA, additive for eager attention
    (:func:`attention_form`);
  * the last stage's logits only where a token is chosen (``logits_to_keep`` as an index tensor, as
    transformers' models take it): each decoding row's, each joining row's last prompt token's.

After the forward the new keys and values go where the two forwards would have put them: a column
more on the group cache for the decoding rows, a cache of its own for a row part-way in, the
group's (merged right aligned, :mod:`.group_cache`) for a row whose prompt is in. The
attention of each token is over its own row's keys only, so a row's tokens are those of
transformers' ``generate`` of it alone (as in every other op; greedy tokens are compared in the
ring's tests). A sliding-window layer holds each row's last ``window - 1`` columns, so its packed past
is those, and its mask (one per attention kind, as transformers' hybrid models take them) lets a token
see only keys less than a window before it. Used for ops whose joining rows did not ask for their
prompt's log-probabilities (those need every position's logits).

Note (when packing pays): the packed attention is one dense product over every token and every packed
key, most of them another row's and masked, so it costs ``T x (K + T)`` score elements where the two
forwards cost each row's own. A second forward costs a read of the stage's weights, about what computing
:data:`READ_TOKENS` tokens through them costs (measured here: a decode forward of the decode-heavy model's
stage, 12 layers of hidden 1024, 60-80 ms; a token through them, 4 ms). So an op packs only while the
masked elements' arithmetic (``4 x hidden`` per element and attention layer: scores and values over every
head) stays under that: :meth:`PackedOp.pays` (short prompts joining rows of a few hundred columns pack; a
long prompt beside rows of thousands of columns runs in two forwards). On a GPU a weight read is worth more
tokens, so the rule packs less often than it could there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..compat import attn_implementation
from ..core import PipelineCore
from .wire import NewRow

__all__ = ["MASK_FORMS", "READ_TOKENS", "PackedCache", "PackedOp", "attention_form", "packs_rows"]

# Tokens whose arithmetic through a stage's weights costs what one more read of them does (module Note).
READ_TOKENS = 16

KV = tuple[torch.Tensor, torch.Tensor]  # a layer's keys and values


# Attention implementations whose layers take a 4D mask as packed ops make it: SDPA's (True: attend) and eager
# attention's, which adds it to the scores (0 or the dtype's lowest). Flash and flex attention take other forms.
MASK_FORMS = ("sdpa", "eager")


def packs_rows(model: PipelineCore, stage: Any) -> bool:
    """Whether ``stage``'s ops may run packed (its caches' sliding windows are the caller's to check): its glue packs
    rows, its blocks run eager (compiled ones keep a graph per shape class), its attention takes a 4D mask
    (:data:`MASK_FORMS`) and its recipe does not list the model type as ``[unpacked]``."""
    glue, resolved = getattr(stage, "glue", None), getattr(stage, "resolved", None)
    if not getattr(glue, "packs_rows", False) or getattr(stage, "compiled_blocks", 0) or resolved is None:
        return False
    return (attn_implementation(model.config.get_text_config(decoder=True)) in MASK_FORMS
            and model.config.model_type not in dict(resolved.recipe.unpacked))


def attention_form(mask: torch.Tensor, config: Any, dtype: torch.dtype) -> torch.Tensor:
    """A boolean packed mask (True: attend) in the form ``config``'s attention takes: as it is for SDPA, additive
    (0 or ``dtype``'s lowest) for eager attention, as transformers' ``sdpa_mask`` and ``eager_mask`` make them."""
    if attn_implementation(config.get_text_config(decoder=True)) != "eager":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class PackedCache:
    """The cache one packed forward runs on (module docstring): ``update`` returns a layer's packed past (its parts
    from ``past(layer)``: ``(keys, values)`` lists of ``(kv_heads, n, D)``, made when the layer asks, so the packed
    copy of one layer at a time is alive) with the new keys and values after it, and keeps the new ones in
    :attr:`new` by layer."""

    def __init__(self, past: Callable[[int], tuple[list[torch.Tensor], list[torch.Tensor]]]):
        self.past = past
        self.new: dict[int, KV] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs) -> KV:
        self.new[layer_idx] = (key_states, value_states)
        keys, values = self.past(layer_idx)
        if not keys:
            return key_states, value_states
        return (torch.cat(keys + [key_states[0]], dim=1)[None], torch.cat(values + [value_states[0]], dim=1)[None])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: every token's position is given (``position_ids``), none is inferred from the cache."""
        return 0


@dataclass
class PackedOp:
    """The layout of one packed op: ``decoding`` rows (``columns`` past columns each, the group cache's), then the
    joining ``rows``' parts of their prompts (``prompt[start:end]``, after a past of ``start`` tokens of their own).
    Tensors are made on ``device``."""

    decoding: int
    columns: int
    rows: list[NewRow]
    device: torch.device

    @property
    def starts(self) -> list[int]:
        """Each joining row's first token in the packed sequence."""
        out, at = [], self.decoding
        for r in self.rows:
            out.append(at)
            at += r.width
        return out

    @property
    def tokens(self) -> int:
        return self.decoding + sum(r.width for r in self.rows)

    def _kept(self, window: int | None) -> tuple[int, list[int]]:
        """The past columns a layer of this kind holds: each decoding row's (the group's last ``window - 1`` on a
        sliding layer) and each joining row's own (its last ``window - 1`` past tokens on a sliding layer)."""
        if window is None:
            return self.columns, [r.start for r in self.rows]
        return min(self.columns, window - 1), [min(r.start, window - 1) for r in self.rows]

    def past_columns(self, window: int | None = None) -> int:
        """Packed past columns of a full-attention layer (``window`` None) or a sliding one."""
        columns, pasts = self._kept(window)
        return self.decoding * columns + sum(pasts)

    def inputs(self, first: bool, old_in: torch.Tensor | None, new_in: torch.Tensor | None,
               next_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed inputs ``(1, T)`` ids on the first stage (the decoding rows' tokens ``old_in (R, 1)``, then
        the rows' prompt parts), else ``(1, T, hidden)`` (``old_in (R, 1, hidden)``, then each row's part of
        ``new_in (J, widest, hidden)``, right aligned); and the positions ``(1, T)``."""
        d, dev = self.decoding, self.device
        positions = torch.cat(([next_pos] if d else []) + [torch.arange(r.start, r.end, device=dev)
                                                           for r in self.rows])[None]
        if first:
            received = torch.cat(([old_in.view(-1)] if d else []) + [
                torch.tensor(r.prompt[r.start: r.end], dtype=torch.long, device=dev) for r in self.rows])[None]
        else:
            received = torch.cat(([old_in[:, 0]] if d else []) + [
                new_in[j, new_in.shape[1] - r.width:] for j, r in enumerate(self.rows)])[None]
        return received, positions

    def mask(self, group_mask: torch.Tensor | None, window: int | None = None) -> torch.Tensor:
        """``(1, 1, T, K + T)`` bool for the layers of one kind (``window`` None: full attention; else a sliding
        window of that many positions, whose layers hold the last ``window - 1`` past columns): each token sees its
        own row's past (a decoding row: its group mask's columns) and its own row's new tokens up to itself, on a
        sliding layer only those less than ``window`` positions before it."""
        t, dev = self.tokens, self.device
        columns, pasts = self._kept(window)
        k = self.past_columns(window)
        mask = torch.zeros(t, k + t, dtype=torch.bool, device=dev)
        r = self.decoding
        if r:
            rows = torch.arange(r, device=dev)
            held = group_mask[:, group_mask.shape[1] - columns:].bool()  # a sliding layer's: within its window
            mask[:r, : r * columns].view(r, r, columns)[rows, rows] = held
            mask[rows, k + rows] = True
        at = r * columns
        for start, row, past in zip(self.starts, self.rows, pasts):
            q = torch.arange(row.start, row.end, device=dev)[:, None]  # the part's positions
            keys = torch.arange(row.start - past, row.end, device=dev)[None]  # its past's, then its own
            seen = keys <= q
            if window is not None:
                seen &= q - keys < window
            mask[start: start + row.width, at: at + past] = seen[:, :past]
            mask[start: start + row.width, k + start: k + start + row.width] = seen[:, past:]
            at += past
        return mask[None, None]

    def past(self, group: dict[int, KV], own: list[dict[int, KV] | None]
             ) -> Callable[[int], tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """A layer's packed past as parts ``(kv_heads, n, D)`` (keys, values): the group cache's rows ``(R, kv_heads,
        C, D)`` one after another, then each joining row's own past ``(kv_heads, start, D)`` (None: it has none)."""

        def parts(layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            keys, values = [], []
            if layer in group:
                g_keys, g_values = group[layer]
                heads, dim = g_keys.shape[1], g_keys.shape[3]
                keys.append(g_keys.transpose(0, 1).reshape(heads, -1, dim))
                values.append(g_values.transpose(0, 1).reshape(heads, -1, dim))
            for kv in own:
                if kv:
                    keys.append(kv[layer][0])
                    values.append(kv[layer][1])
            return keys, values

        return parts

    def pays(self, hidden: int, layer_params: float) -> bool:
        """Whether packing costs less than a second forward (module Note): the masked score elements' arithmetic
        per attention layer (``4 x hidden`` each) under :data:`READ_TOKENS` tokens' (``2 x layer_params`` each)."""
        t = self.tokens
        own = self.decoding * (self.columns + 1) + sum((r.start + r.width) * r.width for r in self.rows)
        return 4 * hidden * (t * (self.past_columns() + t) - own) <= 2 * layer_params * READ_TOKENS

    def keep(self) -> torch.Tensor:
        """The packed positions whose logits are kept: every decoding row's, each final joining row's last token's."""
        last = [s + r.width - 1 for s, r in zip(self.starts, self.rows) if r.final]
        return torch.tensor(list(range(self.decoding)) + last, dtype=torch.long, device=self.device)

    def new_keys(self, new: dict[int, KV], own: list[dict[int, KV] | None]
                 ) -> tuple[dict[int, KV], list[dict[int, KV]]]:
        """The forward's new keys and values ``{layer: (1, kv_heads, T, D)}`` split: the decoding rows' column
        ``(R, kv_heads, 1, D)`` by layer, and each joining row's whole keys and values so far
        ``(kv_heads, end, D)`` (its own past, then its part)."""
        d = self.decoding
        decoded = {k: tuple(t[0, :, :d, None].transpose(0, 1) for t in kv) for k, kv in new.items()}
        rows = [{k: tuple(torch.cat([past[k][n], t[0, :, s: s + r.width]], dim=1) if past
                          else t[0, :, s: s + r.width] for n, t in enumerate(kv)) for k, kv in new.items()}
                for s, r, past in zip(self.starts, self.rows, own)]
        return decoded, rows

    def outputs(self, out: torch.Tensor, last: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The packed output as the two forwards' would be: the decoding rows' ``(R, 1, X)`` (None: none) and the
        joining rows' ``(J, widest, X)``, each right aligned; on the last stage (logits only where kept) ``(J, 1,
        V)``, a final row's last logits, zeros for rows part-way in."""
        d = self.decoding
        old = out[0, :d, None] if d else None
        if last:
            new = out.new_zeros(len(self.rows), 1, out.shape[-1])
            for n, j in enumerate(j for j, r in enumerate(self.rows) if r.final):
                new[j, 0] = out[0, d + n]
            return old, new
        widest = max(r.width for r in self.rows)
        new = out.new_zeros(len(self.rows), widest, *out.shape[2:])
        for j, (start, r) in enumerate(zip(self.starts, self.rows)):
            new[j, widest - r.width:] = out[0, start: start + r.width]
        return old, new
