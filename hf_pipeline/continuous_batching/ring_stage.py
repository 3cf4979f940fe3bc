"""One stage's part of the continuous ring: its groups' KV caches and forwards, and on the last stage each row's token.

:class:`RingStage` is what a stage does with one op once the ring
(:class:`~hf_pipeline.continuous_batching.continuous_ring.ContinuousRing`) has its header and inputs:

  * rows that stay run one decode step on the group's cache;
  * rows that leave are dropped from it (``Cache.batch_select_indices``), and cache columns that
    no remaining row uses any more are cut from the left, so memory follows what is live;
  * rows that join run their whole prompt through the stage with a fresh cache (left padded
    among themselves, with an attention mask), whose keys and values are then put next to the
    group's, right aligned: the shorter side is left padded with zero columns that the mask hides.
    Positions are per row (``cumsum(mask) - 1`` as transformers makes them), so padding never
    changes a row's tokens: greedy rows equal transformers' ``generate`` of each request alone.
  * chunked prefill: a long prompt joins over several ops, ``prompt[start:end]`` each
    (:class:`~.wire.NewRow`); until its last chunk the row keeps a cache of its own (batch 1, no
    padding, positions ``start..end-1``), then joins the group's as above and gets its first token;
  * prefix caching: a row whose prompt head is in the stage's :class:`~.prefix_cache.PrefixCache`
    starts its own cache from those blocks' keys and values and runs only the rest; every row whose
    prompt is in adds its whole blocks.
  * packed ops: on a stage whose glue packs rows (:mod:`.packed_op`), an op's decoding rows and joining
    rows run in one forward of ragged rows, so a join costs no second read of the stage's weights (a mask
    per attention kind: a sliding layer's stops at its window);
  * otherwise all of an op's joining rows (whole prompts, chunks, reused prefixes) run in one forward: their
    own caches stacked right aligned (:func:`~.group_cache.stack`), their parts after them, a mask
    hiding the columns between, then each row's columns moved together (:func:`~.group_cache.compact`).
    On sliding-window caches (a window counts columns, which that gap would stretch) whole prompts
    run in one forward and each other row in one of its own, on its own cache.
    Sliding-window layers keep only their window's last columns through all of this
    (:mod:`.group_cache`, which also names the cache layers the ring does not merge).

The last stage chooses each row's token from its own logits processors (transformers', built from
the row's merged ``GenerationConfig``) and, when sampling, its own generator seeded from
``(seed, choice index)`` (``generation.sampling.row_seed``): a row's tokens never depend on its neighbours.
A rank that holds several stages (interleaved and V layouts) keeps one :class:`RingStage` for each.

Example (inside the ring, for group ``i``):
    >>> old_out, new_out = stage.run(i, header, new_rows, old_in, new_in)
    >>> reply = stage.choose(i, new_rows, old_out, new_out)        # the last stage
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import DynamicCache, MinNewTokensLengthLogitsProcessor

from ..compat import generation_helper
from ..core import PipelineCore
from ..errors import InternalError
from ..generation.config import prepare_generation_config
from ..generation.grammar import GrammarProcessor, GrammarTokenizer
from ..generation.kv_cache import cache_nbytes, new_cache
from ..generation.logprobs import entries
from ..generation.penalties import penalty_processors
from ..generation.sampling import row_generators, select_tokens
from .group_cache import compact, cut_unused, filled, merge, stack, take_rows
from .packed_op import PackedCache, PackedOp, attention_form, packs_rows
from .prefix_cache import PrefixCache
from .wire import NewRow, OpHeader, Reply

__all__ = ["RingStage", "kept_rows"]


@dataclass
class _Group:
    """One group (microbatch) on this stage: its slots in row order, their cache, mask and next positions."""

    slots: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None  # (rows, cache length) long
    next_pos: torch.Tensor | None = None  # (rows,) position of each row's next token
    enc_out: torch.Tensor | None = None  # encoder-decoder: (rows, T_enc, hidden) each row's encoder output
    enc_mask: torch.Tensor | None = None  # encoder-decoder: (rows, T_enc) long, right aligned as enc_out


@dataclass
class _Row:
    """Last stage: one row's sequence so far, its logits processors and, when sampling, its generator."""

    ids: torch.Tensor  # (1, L)
    processors: Any
    generator: torch.Generator | None
    logprobs: int | None = None  # alternatives sent back with each chosen token's log-probability

    @property
    def plain(self) -> bool:
        """Greedy, no processors, no logprobs: its token is the logits' argmax alone (``ids`` then not kept)."""
        return not self.processors and self.generator is None and self.logprobs is None


class RingStage:
    """One stage's groups in the continuous ring (see the module docstring).

    Args:
        model: the pipelined model.
        stage: one of ``model.stages`` (this rank's).
        groups: the ring's groups; group_size: slots per group.
        slot_base: the first slot of this stage's group 0 (a data-parallel replica's groups follow the others').
        grammars: the tokenizer compiled for rows that follow a grammar (``response_format``); the last stage's.
        prefix: this stage's prefix cache (:mod:`.prefix_cache`), kept across rings; None: no prefix reuse.
    """

    def __init__(self, model: PipelineCore, stage: Any, *, groups: int, group_size: int, slot_base: int = 0,
                 grammars: GrammarTokenizer | None = None, prefix: PrefixCache | None = None):
        self.model, self.stage, self.group_size, self.slot_base = model, stage, group_size, slot_base
        self.grammars = grammars
        self.index = stage.spec.index
        self.first, self.last = self.index == 0, self.index == model.plan.num_stages - 1
        self.device = model.device
        self.state = [_Group() for _ in range(groups)]
        self.rows: dict[int, _Row] = {}  # last stage
        self._configs: dict[tuple, Any] = {}
        self.forwards = 0  # forward calls of this stage
        self.seconds = {"decode": 0.0, "prefill": 0.0}  # in this stage's forwards (:mod:`.ring_times`)
        self.pending: dict[int, DynamicCache] = {}  # chunked prefill: a row's own cache until its prompt is in
        self.prefix = prefix  # this stage's prefix cache (None: prefixes are not reused)
        self.reused_tokens = 0  # prompt tokens whose keys and values came from the prefix cache
        # ops with joining rows, the forwards they ran, and the most rows with a past (an earlier chunk, a reused
        # prefix) one forward ran: all of an op's joining rows run in one forward on full-attention caches
        self.prefill_ops = self.prefill_forwards = self.peak_stacked = 0
        self.packed_ops = 0  # ops whose decoding and joining rows ran in one forward (packed_op.py)
        layers = new_cache(model.config, encoder_decoder=False).layers
        windows = {layer.sliding_window for layer in layers if getattr(layer, "is_sliding", False)}
        self.full_attention = not windows
        self.any_full = not all(getattr(layer, "is_sliding", False) for layer in layers)
        # An op's rows in one forward (packed_op.py): one mask per attention kind, so one sliding window at most.
        self.packs, self.window = packs_rows(model, stage) and len(windows) <= 1, next(iter(windows), None)
        blocks = getattr(stage, "blocks", None) or [(None, stage)]
        self.layer_params = sum(p.numel() for _, b in blocks for p in b.parameters()) / len(blocks)  # packs or not
        self.done = False  # the ring's stop passed this stage for every group
        # Experts over data-parallel replicas: the expert group whose ranks run each op's forwards together.
        self.lock_group = model.dims.ep_mesh.get_group() if model.dims.ep_data > 1 else None
        self.hidden = int(model.config.get_text_config(decoder=True).hidden_size)

    def _new_cache(self) -> DynamicCache:
        """An empty cache for this stage's rows (its compiled blocks' kind when compiled: generation/kv_cache.py)."""
        return new_cache(self.model.config, encoder_decoder=False, stage=self.stage)

    takes_tokens = False  # kept rows' inputs are token ids sent in the states' bytes (encoder-decoder stages)

    def received_width(self, rows: list[NewRow]) -> int:
        """Columns of the joining rows' states this stage receives: the widest part of a prompt this op runs."""
        return max(r.width for r in rows)

    def first_ids(self, r: NewRow) -> torch.Tensor:
        """The ids a joining row's logits processors start from ``(1, L)``: its prompt."""
        return torch.tensor([r.prompt], dtype=torch.long, device=self.device)

    def cache_bytes(self) -> int:
        """The keys and values this stage holds: its groups' and chunked rows' caches, and its prefix cache's blocks."""
        held = sum(cache_nbytes(c) for c in [g.cache for g in self.state] + list(self.pending.values()))
        return held + (self.prefix.nbytes if self.prefix is not None else 0)

    def run(self, i: int, header: OpHeader, new: list[NewRow], old_in: torch.Tensor | None,
            new_in: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Group ``i``'s op: keep the header's kept rows, decode them on ``old_in``, prefill the joining ``new`` rows
        (stage 0: from their prompts; else on ``new_in``). Returns the kept and joining rows' outputs (None: none)."""
        old_slots = list(header.kept)
        g = self.state[i]
        self._keep(g, old_slots)
        # Packing is weighed only for an op with joining rows on a stage that packs (not on every decode step).
        op = (PackedOp(decoding=len(old_slots), columns=len(g.mask[0]) if old_slots else 0, rows=new,
                       device=self.device) if new and self.packs else None)
        packed = op is not None and all(r.prompt_logprobs is None for r in new) and op.pays(
            self.hidden, self.layer_params)
        pads = self._lock_step(bool(old_slots), new, packed)
        if packed:  # one forward for both (its time counted as prefill: the op ran because rows joined)
            old_out, new_out = self._timed("prefill", self._packed, g, op, old_in, new_in)
        else:
            old_out = self._timed("decode", self._decode, g, old_in) if old_slots else None
            new_out = self._timed("prefill", self._prefill, g, new, new_in) if new else None
        for _ in range(pads):
            self._pad_forward()
        g.slots = old_slots + [r.slot for r in new if r.final]
        return old_out, new_out

    def _timed(self, part: str, fn, *args):
        """``fn(*args)``, its seconds added to this stage's ``part`` ("decode" or "prefill")."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[part] += time.perf_counter() - start

    # ------------------------------------------------------------ lock step
    def _lock_step(self, decodes: bool, new: list[NewRow], packed: bool = False) -> int:
        """Experts over data-parallel replicas: the forwards this rank must add to its op's (a decode if
        ``decodes``, the prefill forwards of the joining ``new`` rows) so that every rank of its expert group runs
        as many (one MAX all-reduce over the group); 0 otherwise, counting nothing.

        Each forward calls transformers' all-to-all at every MoE layer of the stage, which every rank of the
        group must join; the replicas run the same ops in the same order (the coordinator plans them together,
        :mod:`.continuous_ring`), but an op's rows differ by replica, so its forwards may not: a decode of the
        kept rows if any, and the joining rows' prefill forwards. Only the count must match (every forward makes
        the same sequence of collectives), so the short ranks add forwards of one throwaway row."""
        if self.lock_group is None:
            return 0
        forwards = 1 if packed else int(decodes) + (len(self._batches(new)) if new else 0)
        most = torch.tensor([forwards], dtype=torch.long, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.lock_group)
        return int(most) - forwards

    def _pad_forward(self) -> None:
        """A forward of one throwaway row on a fresh cache (token 0 on stage 0, zero states elsewhere): its tokens
        reach the experts of the group like any other's, and per-token routing leaves the real rows' outputs as
        they are; its output is dropped."""
        one = torch.ones(1, 1, dtype=torch.long, device=self.device)
        received = (torch.zeros_like(one) if self.first
                    else torch.zeros(1, 1, self.hidden, dtype=self.model.dtype, device=self.device))
        self._forward(received, self._new_cache(), one, torch.zeros_like(one))

    # ------------------------------------------------------------ caches
    def _keep(self, g: _Group, slots: list[int]) -> None:
        """Keep only ``slots`` (in their order) in group ``g``; cut cache columns no kept row uses."""
        if slots == g.slots:
            return
        if not slots:
            g.slots, g.cache, g.mask, g.next_pos = [], None, None, None
            return
        keep = kept_rows(g.slots, slots, self.device)
        g.cache.batch_select_indices(keep)
        g.mask, g.next_pos, g.slots = g.mask[keep], g.next_pos[keep], slots
        g.mask = cut_unused(g.cache, g.mask)

    def _forward(self, received: torch.Tensor, cache, mask, positions, every_logit: bool = False,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        inputs: dict[str, Any] = {"cache": cache, "attention_mask": mask, "position_ids": positions}
        if self.first:
            inputs["input_ids"] = received
            hidden: tuple = ()
        else:
            hidden = (received,)
        if self.last and keep is not None:  # a packed op: the logits at these positions
            inputs["logits_to_keep"] = keep
        elif self.last and not every_logit:  # every position's logits: a joining row asked for its prompt's logprobs
            inputs["logits_to_keep"] = 1
        self.forwards += 1
        out = self.stage(*hidden, **inputs)
        return out[0] if isinstance(out, tuple) else out

    def _decode(self, g: _Group, received: torch.Tensor) -> torch.Tensor:
        """The kept rows' next step on the group cache."""
        g.mask = torch.cat([g.mask, g.mask.new_ones(g.mask.shape[0], 1)], dim=1)
        out = self._forward(received, g.cache, g.mask, g.next_pos[:, None])
        g.next_pos = g.next_pos + 1
        return out

    def _prefill(self, g: _Group, new: list[NewRow], received: torch.Tensor | None) -> torch.Tensor:
        """The joining rows' part of their prompts (``prompt[start:end]``); rows whose prompt is then in join the
        group's cache (right aligned), the others keep their own cache for their next chunk. All run in one
        forward (:meth:`_run_rows`); on sliding-window caches whole rows run batched, ahead of the others, which
        run one by one on their own cache (:mod:`.group_cache`: a window counts columns). ``received`` and the
        result: ``(joining, widest, X)``, each row's part right aligned."""
        batches = self._batches(new)
        # Every reused prefix is read before this op adds any block (the index's order: prefix_cache Note).
        taken = [self.prefix.take(r.prompt, r.reused) if r.reused else None for r in new]
        outs, finals = [], []
        self.prefill_ops += 1
        for ks in batches:
            rows = [new[k] for k in ks]
            part = None if self.first else received[ks.start: ks.stop, -max(r.width for r in rows):]
            out, cache, mask = self._run_rows(rows, part, taken[ks.start: ks.stop])
            outs.append(out)
            finals += self._settle(g, rows, cache, mask)
        self._record_prefixes(new, finals)
        widest = max(o.shape[1] for o in outs)
        return torch.cat([o if o.shape[1] == widest else torch.cat([o.new_zeros(o.shape[0], widest - o.shape[1],
                                                                                *o.shape[2:]), o], dim=1)
                          for o in outs])

    def _packed(self, g: _Group, op: PackedOp, old_in: torch.Tensor | None,
                new_in: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The group's decoding rows and the joining rows of ``op`` in one forward (:mod:`.packed_op`); their new
        keys and values then go where :meth:`_decode` and :meth:`_prefill` put them. Returns their outputs as
        those do (the last stage's joining rows: ``(joining, 1, V)``, zeros for rows part-way in)."""
        new, decoding = op.rows, op.decoding
        taken = [self.prefix.take(r.prompt, r.reused) if r.reused else None for r in new]  # before any add
        own = [_row_kv(self._row_cache(r, t), 0, 0) if r.start else None for r, t in zip(new, taken)]
        group = {k: (layer.keys, layer.values) for k, layer in filled(g.cache).items()} if decoding else {}
        cache = PackedCache(op.past(group, own))
        received, positions = op.inputs(self.first, old_in, new_in, g.next_pos)
        # transformers' hybrid models take a mask per attention kind; a model of one kind, its mask
        masks = {"full_attention": op.mask(g.mask)} if self.any_full else {}
        if self.window is not None:
            masks["sliding_attention"] = op.mask(g.mask, self.window)
        masks = {kind: attention_form(m, self.model.config, self.model.dtype) for kind, m in masks.items()}
        mask = masks if len(masks) > 1 else next(iter(masks.values()))
        out = self._forward(received, cache, mask, positions, keep=op.keep() if self.last else None)
        self.prefill_ops, self.prefill_forwards, self.packed_ops = (self.prefill_ops + 1, self.prefill_forwards + 1,
                                                                    self.packed_ops + 1)
        self.peak_stacked = max(self.peak_stacked, sum(bool(r.start) for r in new))
        decoded, rows = op.new_keys(cache.new, own)
        if decoding:  # a column more for the decoding rows, as _decode's
            for k, (keys, values) in decoded.items():
                g.cache.update(keys, values, k)
            g.mask = torch.cat([g.mask, g.mask.new_ones(decoding, 1)], dim=1)
            g.next_pos = g.next_pos + 1
        for r, kv in zip(new, rows):
            if not r.final:
                self.pending[r.slot] = stack(self._new_cache(), [kv], r.end, whole=True)
        finals = [(r, kv) for r, kv in zip(new, rows) if r.final]
        if finals:
            width = max(len(r.prompt) for r, _ in finals)
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r, _ in finals],
                                dtype=torch.long, device=self.device)
            self._join(g, stack(self._new_cache(), [kv for _, kv in finals], width, whole=True), mask)
        self._record_prefixes(new, finals)
        return op.outputs(out, self.last)

    def _record_prefixes(self, new: list[NewRow], finals: list) -> None:
        """After an op's joining rows ran: the prefix cache touched for the rows that reused a head (in row order),
        then given the whole blocks of each row whose prompt is in (``(row, {layer: (keys, values)})``), in the
        order the coordinator's index mirrors (:mod:`.prefix_cache` Note)."""
        if self.prefix is None:
            return
        for r in new:
            if r.reused:
                self.prefix.touch(r.prompt, r.reused)
                self.reused_tokens += r.reused
        for r, kv in finals:
            self.prefix.add(r.prompt, lambda b, kv=kv: _block(kv, b, self.prefix.block))

    def _batches(self, new: list[NewRow]) -> list[range]:
        """The joining rows of each prefill forward: all at once on full-attention caches; on sliding-window caches
        the whole prompts together, then each other row alone (:meth:`_prefill`)."""
        if self.full_attention:
            return [range(len(new))]
        n_whole = sum(r.whole for r in new)
        if any(r.whole for r in new[n_whole:]):
            raise InternalError("the ring's joining rows put whole prompts ahead of chunks and reused prefixes")
        return ([range(n_whole)] if n_whole else []) + [range(k, k + 1) for k in range(n_whole, len(new))]

    def _run_rows(self, rows: list[NewRow], received: torch.Tensor | None, taken: list) -> tuple:
        """One forward of ``rows``' parts: their pasts (earlier chunks, reused prefixes) stacked right aligned on
        one cache, then their parts, each right aligned (a mask hides the columns between; positions
        ``start..end-1``). Returns the output, the cache and its mask, each row's columns together at the right."""
        past, width = max(r.start for r in rows), max(r.width for r in rows)
        if not past:
            cache = self._new_cache()
        elif len(rows) == 1:  # its own cache as it is (a sliding layer's too)
            cache = self._row_cache(rows[0], taken[0])
        else:
            pasts = [_row_kv(self._row_cache(r, t), 0, 0) if r.start else None for r, t in zip(rows, taken)]
            cache = stack(self._new_cache(), pasts, past)
        self.peak_stacked = max(self.peak_stacked, sum(bool(r.start) for r in rows))
        pad = [width - r.width for r in rows]
        mask = torch.tensor([[0] * (past - r.start) + [1] * r.start + [0] * p + [1] * r.width
                             for r, p in zip(rows, pad)], dtype=torch.long, device=self.device)
        positions = torch.tensor([[0] * p + list(range(r.start, r.end)) for r, p in zip(rows, pad)],
                                 dtype=torch.long, device=self.device)
        if self.first:  # the padding positions' ids are masked out; 0 is any valid id
            received = torch.tensor([[0] * p + r.prompt[r.start: r.end] for r, p in zip(rows, pad)],
                                    dtype=torch.long, device=self.device)
        every = self.last and any(r.prompt_logprobs is not None for r in rows)
        out = self._forward(received, cache, mask, positions, every)
        self.prefill_forwards += 1
        if any(r.start and p for r, p in zip(rows, pad)):  # masked columns between a row's past and its part
            mask = compact(cache, mask)
        return out, cache, mask

    def _settle(self, g: _Group, rows: list[NewRow], cache: DynamicCache, mask: torch.Tensor) -> list:
        """After :meth:`_run_rows`: rows whose prompt is in join the group's cache, the others keep their own
        columns as their cache; each joining row with its keys and values ``(row, {layer: (keys, values)})``."""
        fin = [k for k, r in enumerate(rows) if r.final]
        for k, r in enumerate(rows):
            if not r.final:
                self.pending[r.slot] = cache if len(rows) == 1 else take_rows(
                    cache, mask, [k], self._new_cache())[0]
        if not fin:
            return []
        if len(fin) < len(rows):
            cache, mask = take_rows(cache, mask, fin, self._new_cache())
        width = mask.shape[1]
        finals = [(rows[k], _row_kv(cache, j, width - len(rows[k].prompt))) for j, k in enumerate(fin)]
        self._join(g, cache, mask)
        return finals

    def _row_cache(self, r: NewRow, taken: list | None) -> DynamicCache:
        """A chunked row's own cache: its earlier chunks', or a fresh one holding its reused prefix's blocks."""
        if r.start and not r.reused:
            if r.slot not in self.pending:
                raise InternalError(f"the ring continues slot {r.slot}'s prompt, which this stage did not start")
            return self.pending.pop(r.slot)
        cache = self._new_cache()
        for layer in taken[0] if taken else ():
            keys = torch.cat([blk[layer][0] for blk in taken], dim=1)[None]  # (1, heads, reused, D)
            values = torch.cat([blk[layer][1] for blk in taken], dim=1)[None]
            cache.update(keys, values, layer)
        return cache

    def _join(self, g: _Group, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Rows whose prompt is in (``cache``, ``mask``) join the group's cache after its rows."""
        lengths = mask.sum(dim=1)
        if g.cache is None:
            g.cache, g.mask, g.next_pos = cache, mask, lengths
            return
        g.mask = merge(g.cache, g.mask, cache, mask)
        g.next_pos = torch.cat([g.next_pos, lengths])

    # ------------------------------------------------------------ last stage: tokens
    def _row(self, r: NewRow) -> _Row:
        do_sample = r.temperature > 0
        key = (do_sample, r.temperature, r.top_p, r.max_new_tokens)
        if key not in self._configs:
            kw = {"do_sample": True, "temperature": r.temperature, "top_p": r.top_p} if do_sample else {
                "do_sample": False}
            self._configs[key] = prepare_generation_config(self.model, None, max_new_tokens=r.max_new_tokens, **kw)[0]
        prompt = torch.tensor([r.prompt], dtype=torch.long, device=self.device)
        ids = self.first_ids(r)  # what transformers' processors see: the decoder's ids (an encoder-decoder's start)
        custom = penalty_processors(prompt_length=ids.shape[1], presence=r.presence_penalty,
                                    frequency=r.frequency_penalty, repetition=r.repetition_penalty,
                                    bias={int(t): b for t, b in r.logit_bias})
        if r.min_tokens and r.stop_ids:
            # transformers' own processor, given the row's stop ids (EOS unless ignored, and its stop ids) as
            # vLLM's min_tokens suppresses both; a custom processor runs before the sampling warpers.
            custom.append(MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=ids.shape[1],
                                                            min_new_tokens=r.min_tokens, eos_token_id=r.stop_ids,
                                                            device=self.device))
        if r.grammar is not None:
            if self.grammars is None:
                raise InternalError("a row follows a grammar but the ring was given no tokenizer for it")
            custom.append(GrammarProcessor(self.grammars, r.grammar, prompt_length=ids.shape[1]))
        processors = generation_helper(self.model.skeleton, "_get_logits_processor")(
            generation_config=self._configs[key], input_ids_seq_length=ids.shape[1], encoder_input_ids=prompt,
            logits_processor=custom, device=self.device,
            model_kwargs={"attention_mask": torch.ones_like(prompt)},
        )
        gen = row_generators(r.seed if r.seed is not None else 0, [r.index], self.device)[0] if do_sample else None
        return _Row(ids=ids, processors=processors, generator=gen, logprobs=r.logprobs)

    def choose(self, i: int, new: list[NewRow], old_out, new_out) -> torch.Tensor:
        """Last stage: each row's token from its own processors (and generator); the reply to stage 0 with the
        log-probabilities the row asked for (:class:`~.wire.Reply`)."""
        slots = self.state[i].slots
        group = range(self.slot_base + i * self.group_size, self.slot_base + (i + 1) * self.group_size)
        for s in [s for s in self.rows if s in group and s not in slots]:
            del self.rows[s]  # left the ring
        fin = [k for k, r in enumerate(new) if r.final]  # rows whose prompt is in: their first token now
        for k in fin:
            self.rows[new[k].slot] = self._row(new[k])
        parts = [o[:, -1, :] for o in (old_out, None if new_out is None else new_out[fin]) if o is not None]
        logits = torch.cat(parts).float() if parts else None
        tokens: list[int] = [0] * len(slots)
        chosen: list[torch.Tensor | None] = [None] * len(slots)
        plain = [j for j, slot in enumerate(slots) if self.rows[slot].plain]
        if plain:
            # Greedy rows without processors nor logprobs: one pick for all of them, the same index each row's own
            # pick gives (the first maximum); a call per row cost more than the op's other Python on a small model.
            scores = logits if len(plain) == len(slots) else logits[plain]
            for j, token in zip(plain, select_tokens(scores, do_sample=False).tolist()):
                tokens[j] = token
        for j, slot in enumerate(slots):
            row = self.rows[slot]
            if row.plain:
                continue
            scores = row.processors(row.ids, logits[j: j + 1])
            gens = [row.generator] if row.generator is not None else None
            token = select_tokens(scores, do_sample=row.generator is not None, generators=gens)
            row.ids = torch.cat([row.ids, token[:, None].to(row.ids.device)], dim=1)
            tokens[j] = int(token[0])
            if row.logprobs is not None:
                chosen[j] = entries(torch.log_softmax(scores.float(), dim=-1), token, row.logprobs)[0]
        n_old = len(slots) - len(fin)
        prompts = [None] * n_old + [self._prompt_entries(new[k], new_out[k], new_out.shape[1]) for k in fin]
        layout = Reply.of([None] * n_old + [new[k] for k in fin], {s: self.rows[s].logprobs for s in slots}, slots)
        return layout.pack(tokens, chosen, prompts, self.device)

    @staticmethod
    def _prompt_entries(r: NewRow, logits: torch.Tensor, width: int) -> torch.Tensor | None:
        """A joining row's prompt log-probabilities from its prefill logits ``(width, V)`` (left padded):
        position ``p``'s raw logits give token ``p + 1``; None when it did not ask."""
        if r.prompt_logprobs is None:
            return None
        start = width - len(r.prompt)
        logprobs = torch.log_softmax(logits[start: width - 1].float(), dim=-1)  # (len - 1, V)
        return entries(logprobs, torch.tensor(r.prompt[1:], dtype=torch.long), r.prompt_logprobs)


def kept_rows(held: list[int], slots: list[int], device: torch.device) -> torch.Tensor:
    """The rows of a group holding slots ``held`` that keep ``slots`` (in their order), as an index tensor."""
    try:
        return torch.tensor([held.index(s) for s in slots], dtype=torch.long, device=device)
    except ValueError:
        raise InternalError(f"the ring kept slots {slots} that this stage does not hold ({held})") from None


def _row_kv(cache: DynamicCache, row: int, offset: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Row ``row``'s keys and values ``(heads, prompt, D)`` in each layer this stage filled, from column ``offset``
    (its left padding skipped): views, valid for this op (the ring replaces cache tensors, never writes into them)."""
    return {k: (layer.keys[row, :, offset:], layer.values[row, :, offset:]) for k, layer in filled(cache).items()}


def _block(kv: dict, b: int, size: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Block ``b`` of a row's keys and values, copied (a view would keep the row's whole cache alive)."""
    return {k: (keys[:, b * size: (b + 1) * size].clone(), values[:, b * size: (b + 1) * size].clone())
            for k, (keys, values) in kv.items()}
