"""What travels down the continuous ring with each op: its header (a typed message) and the joining rows.

Stage 0 decides, before each op of a group, which rows stay, which leave and which join; every
other stage learns it from the op's :class:`OpHeader`, sent ahead of the activations, and, when rows
join, from their :class:`NewRow` list as JSON. Both own their packing into tensors and their parsing
back, as torch's pipelining ``_Action`` owns its string form, so no stage reads a field by position.

Note (layout): the header is an int64 tensor of ``OpHeader.FIELDS + group_size`` entries::

    [run (1) or stop (0), rows kept, rows joining, JSON bytes, slots kept..., slots joining..., -1...]

a fixed size for a given ``group_size``, so the next stage can post its receive before the op is
planned. A stop is ``[0, 0, 0, 0, -1...]``. ``tests/continuous_batching/test_wire.py`` pins the layout.

Example:
    >>> header = OpHeader(run=True, kept=(2, 0), joining=(1,), payload_bytes=97)
    >>> header.pack(group_size=4).tolist()
    [1, 2, 1, 97, 2, 0, 1, -1]
    >>> OpHeader.unpack(header.pack(group_size=4)) == header
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from ..errors import InternalError
from ..generation.logprobs import TokenLogprob, entry_width, read_entries

__all__ = ["NewRow", "OpHeader", "Reply", "ReplyRow", "pack_rows", "unpack_rows"]


@dataclass(frozen=True, kw_only=True)
class OpHeader:
    """One op of one group, as stage 0 planned it: whether it runs, and the slots of its rows in row order.

    Attributes:
        run: True for an op that runs its rows; False for a stop (the ring ends after this step).
        kept: slots of the rows that stay, in the order of the group's cache rows.
        joining: slots of the rows that run part of their prompt (:class:`NewRow`); those whose prompt is then
            in join the group after the kept rows.
        payload_bytes: size of the joining rows' JSON (:func:`pack_rows`), sent after the header; 0 when none join.
    """

    run: bool
    kept: tuple[int, ...] = ()
    joining: tuple[int, ...] = ()
    payload_bytes: int = 0

    FIELDS = 4  # entries before the slots: run, rows kept, rows joining, JSON bytes

    def __post_init__(self) -> None:
        if not self.run and (self.kept or self.joining or self.payload_bytes):
            raise InternalError(f"a stop header carries no rows, got {self}")
        if bool(self.joining) != (self.payload_bytes > 0):
            raise InternalError(f"joining rows and their JSON come together, got {self}")

    @classmethod
    def stop(cls) -> OpHeader:
        """The header that stops the ring (one per group of the last step)."""
        return cls(run=False)

    @property
    def slots(self) -> tuple[int, ...]:
        """Every row's slot in row order: the kept rows, then the joining ones."""
        return self.kept + self.joining

    @classmethod
    def nbytes(cls, group_size: int) -> int:
        """Bytes of a packed header for groups of ``group_size`` slots (the same for every op)."""
        return 8 * (cls.FIELDS + group_size)

    def pack(self, group_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The int64 tensor ``(FIELDS + group_size,)`` sent down the ring (layout in the module docstring)."""
        slots = self.slots
        if len(slots) > group_size:
            raise InternalError(f"{len(slots)} rows do not fit a group of {group_size} slots")
        values = [int(self.run), len(self.kept), len(self.joining), self.payload_bytes, *slots]
        return torch.tensor(values + [-1] * (group_size - len(slots)), dtype=torch.long, device=device)

    @classmethod
    def unpack(cls, tensor: torch.Tensor) -> OpHeader:
        """The header a packed int64 tensor holds (the inverse of :meth:`pack`)."""
        values = [int(v) for v in tensor.tolist()]
        if len(values) < cls.FIELDS:
            raise InternalError(f"a ring header has at least {cls.FIELDS} entries, got {values}")
        run, n_kept, n_joining, payload_bytes = values[: cls.FIELDS]
        slots = values[cls.FIELDS:]
        n = n_kept + n_joining
        valid = n_kept >= 0 and n_joining >= 0 and n <= len(slots) and all(s >= 0 for s in slots[:n])
        if run not in (0, 1) or not valid or any(s != -1 for s in slots[n:]):
            raise InternalError(f"not a ring header: {values}")
        return cls(run=bool(run), kept=tuple(slots[:n_kept]), joining=tuple(slots[n_kept:n]),
                   payload_bytes=payload_bytes)


@dataclass(kw_only=True)
class NewRow:
    """A row joining the ring: one choice of one request, as every stage needs it (plain JSON data).

    Attributes:
        slot: the slot it takes (global slot id; group ``slot // group_size``).
        prompt: its prompt's token ids.
        max_new_tokens: its own limit (the feeder ends it; the processors see it as transformers would).
        temperature / top_p: 0 for greedy; its sampling parameters.
        seed: its request's seed (sampling).
        index: its choice index within the request (seeds its generator with ``seed``).
        stop_ids: the ids that end it (EOS unless ignored, its stop ids): none of them before ``min_tokens``.
        min_tokens: tokens before any of ``stop_ids`` may be chosen.
        logprobs: None, or the chosen tokens' log-probabilities come back with this many alternatives.
        prompt_logprobs: None, or its prompt tokens' log-probabilities come back (with this many alternatives).
        presence_penalty / frequency_penalty / repetition_penalty / logit_bias: its penalties
            (:func:`~hf_pipeline.generation.penalties.penalty_processors`); logit_bias as ``[[id, bias], ...]``.
        grammar: None, or the llguidance grammar its tokens follow (``response_format``:
            :class:`~hf_pipeline.generation.grammar.GrammarProcessor`).
        start / end: the prompt tokens this op runs, ``prompt[start:end]`` (chunked prefill: a long prompt joins
            over several ops; the tokens before ``start`` are in the row's own cache already). ``end`` -1: the
            whole prompt.
        reused: on the row's first chunk, prompt tokens whose keys and values each stage copies from its prefix
            cache (:mod:`.prefix_cache`) instead of computing them (``start`` then equals it); 0 otherwise.
    """

    slot: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    index: int = 0
    stop_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[list[float]] = field(default_factory=list)
    grammar: str | None = None
    start: int = 0
    end: int = -1
    reused: int = 0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise InternalError("a row joining the ring needs a prompt of at least one token")
        if self.end == -1:
            self.end = len(self.prompt)
        if not 0 <= self.start < self.end <= len(self.prompt) or self.reused not in (0, self.start):
            raise InternalError(f"a joining row runs a non-empty part of its prompt, got start={self.start} "
                                f"end={self.end} reused={self.reused} of {len(self.prompt)} tokens")

    @property
    def width(self) -> int:
        """Tokens this op runs for the row."""
        return self.end - self.start

    @property
    def final(self) -> bool:
        """Its whole prompt is in after this op: it joins the group's cache and gets its first token."""
        return self.end == len(self.prompt)

    @property
    def whole(self) -> bool:
        """Its whole prompt runs in this op on a fresh cache (such rows run batched, ahead of the others)."""
        return self.start == 0 and self.final


def pack_rows(rows: list[NewRow], device: torch.device | str | None = None) -> torch.Tensor:
    """The joining rows as JSON bytes (uint8), their ``payload_bytes`` in the header."""
    data = json.dumps([r.__dict__ for r in rows]).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def unpack_rows(payload: torch.Tensor) -> list[NewRow]:
    """The joining rows a uint8 JSON payload holds (the inverse of :func:`pack_rows`)."""
    return [NewRow(**r) for r in json.loads(bytes(payload.tolist()))]


@dataclass(frozen=True)
class ReplyRow:
    """What one row of an op sends back: its token, and the log-probabilities it asked for.

    Attributes:
        logprobs: None, or alternatives with the chosen token's log-probability.
        prompt_logprobs: None, or alternatives with each prompt token's (joining rows only).
        prompt_len: its prompt's length (joining rows with ``prompt_logprobs``).
    """

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_len: int = 0

    @property
    def size(self) -> int:
        n = 1 + (0 if self.logprobs is None else entry_width(self.logprobs))
        return n + (0 if self.prompt_logprobs is None else (self.prompt_len - 1) * entry_width(self.prompt_logprobs))


@dataclass(frozen=True)
class Reply:
    """The last stage's answer to one op: float64, for each row in header order ``[token, its entry (when
    asked), its prompt's entries (when asked)]`` (entries: :func:`~hf_pipeline.generation.logprobs.entries`).

    Note (layout): its size follows from the op's rows, which stage 0 planned and the last stage received,
    so stage 0 posts the receive ahead with the exact size; at least one float (an op without rows).

    Example:
        >>> layout = Reply((ReplyRow(), ReplyRow(logprobs=1)))
        >>> layout.size                            # 1 + (1 + 1 + 3)
        5
    """

    rows: tuple[ReplyRow, ...]

    @classmethod
    def of(cls, rows: list[NewRow | None], asked: dict[int, int | None], slots: list[int]) -> Reply:
        """The layout of an op whose rows are ``slots``: the kept ones' ``logprobs`` read from ``asked`` (slot ->
        logprobs), the joining ones' from their :class:`NewRow` (``rows``, aligned to ``slots``; None: kept)."""
        out = []
        for slot, r in zip(slots, rows):
            if r is None:
                out.append(ReplyRow(logprobs=asked.get(slot)))
            else:
                out.append(ReplyRow(logprobs=r.logprobs, prompt_logprobs=r.prompt_logprobs, prompt_len=len(r.prompt)))
        return cls(tuple(out))

    @property
    def size(self) -> int:
        return max(1, sum(r.size for r in self.rows))

    def pack(self, tokens: list[int], chosen: list[torch.Tensor | None], prompts: list[torch.Tensor | None],
             device: torch.device | str | None = None) -> torch.Tensor:
        """The message: each row's token, its ``chosen`` entry ``(entry_width,)`` and ``prompts`` entries
        ``(prompt_len - 1, entry_width)`` where it asked for them (None elsewhere)."""
        parts: list[torch.Tensor] = []
        run: list[float] = []  # tokens since the last entries: one tensor for them all, not one a row
        for token, c, p in zip(tokens, chosen, prompts):
            run.append(float(token))
            extra = [x.reshape(-1).double().cpu() for x in (c, p) if x is not None]
            if extra:
                parts += [torch.tensor(run, dtype=torch.float64), *extra]
                run = []
        if run or not parts:
            parts.append(torch.tensor(run or [0.0], dtype=torch.float64))  # an op without rows: one float
        return (torch.cat(parts) if len(parts) > 1 else parts[0]).to(device)

    def unpack(self, message: torch.Tensor, prompts: list[list[int] | None]
               ) -> list[tuple[int, TokenLogprob | None, list[TokenLogprob] | None]]:
        """Each row's ``(token, TokenLogprob or None, prompt TokenLogprobs or None)``; ``prompts``: the
        joining rows' prompt ids, aligned to the rows (None for a kept row)."""
        flat, at, out = message.cpu(), 0, []
        for r, prompt in zip(self.rows, prompts):
            token = int(flat[at])
            at += 1
            chosen = None
            if r.logprobs is not None:
                w = entry_width(r.logprobs)
                chosen = read_entries(flat[at: at + w].view(1, w), [token], r.logprobs)[0]
                at += w
            prompt_lp = None
            if r.prompt_logprobs is not None:
                w = entry_width(r.prompt_logprobs)
                n = (r.prompt_len - 1) * w
                prompt_lp = read_entries(flat[at: at + n].view(-1, w), prompt[1:], r.prompt_logprobs)
                at += n
            out.append((token, chosen, prompt_lp))
        return out
