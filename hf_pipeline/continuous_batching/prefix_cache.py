"""Prefix caching for the continuous ring: shared prompt heads' keys and values, computed once per stage.

As vLLM's automatic prefix caching: a prompt is cut into blocks of ``block`` tokens, and block ``b``
is named by a hash chained over the blocks before it (:func:`block_keys`), so a key stands for the
whole prefix up to that block. Each stage keeps, per key, its own layers' keys and values of that
block ``(heads, block, head_dim)``; a later row whose prompt starts with the same blocks copies them
into its own cache at join time and computes only the rest (at least its last prompt token: it
gives the row's first logits). Entries are evicted least recently used beyond ``capacity`` blocks
(:func:`~.kv_budget.prefix_blocks`: what the KV budget leaves beside the slot pool); a row's blocks
are touched tail first, so a shared head outlives the tails that hang from it.

Note (one index, mirrored): the coordinator (stage 0's lead, which plans) decides how many tokens a
joining row reuses, from an index of the same :class:`PrefixCache` without tensors; every stage's
cache then sees the same lookups, touches and additions in the same order (op order; within an op:
the joining rows' touches in row order, then the additions of the rows whose prompt is in), so each
holds exactly the blocks the index holds and never needs to ask. A block the header says to reuse
and the stage lacks is an :class:`~hf_pipeline.errors.InternalError`.

Only full-attention caches reuse prefixes (:func:`prefix_refusal`): a sliding-window layer keeps
only its window's last columns and chunked attention counts chunks in columns, so their rows run
their whole prompt as before.

Example:
    >>> index = PrefixCache(block=16, capacity=64)
    >>> index.match(prompt)                  # tokens the row may reuse (a multiple of 16, < len(prompt))
    >>> index.touch(prompt, 32); index.add(prompt)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any, Callable

from transformers.cache_utils import get_layer_types_and_kwargs

from ..errors import InternalError

__all__ = ["PrefixCache", "RingPrefix", "block_keys", "prefix_refusal"]


def prefix_refusal(config: Any) -> str | None:
    """Why rows of ``config``'s model cannot reuse cached prefixes, or None (every layer full attention)."""
    if config.is_encoder_decoder:
        return "an encoder-decoder's prompt is its encoder's input, which attends both ways (no prefix is final)"
    kinds = sorted(set(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]) - {"full_attention"})
    if not kinds:
        return None
    return f"cache layers of kind {', '.join(kinds)} keep only part of a prompt's columns"


def block_keys(prompt: list[int], block: int, n: int) -> list[bytes]:
    """The chained keys of ``prompt``'s first ``n`` blocks: key ``b`` names the whole prefix ``prompt[:(b+1)*block]``.

    Why SHA-256 and not Python's ``hash``: a key decides whose keys and values a row reuses, so two prefixes
    with one key would give one client's request another's prompt as context (and its answers would leak
    it). Python's tuple hash is 64 bits and not made to resist crafted collisions; SHA-256 is (vLLM's prefix
    caching moved to it for the same reason). It is also the same in every process, as the mirrored caches
    need.
    """
    keys, parent = [], b""
    for b in range(n):
        chunk = prompt[b * block: (b + 1) * block]
        parent = hashlib.sha256(parent + array("q", chunk).tobytes()).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """LRU blocks of prompt prefixes (see the module docstring); ``payload`` per block: a stage's keys and values,
    None in the coordinator's index.

    Args:
        block: tokens per block.
        capacity: blocks kept at most (0: nothing is kept).
    """

    def __init__(self, *, block: int, capacity: int):
        if block < 1 or capacity < 0:
            raise InternalError(f"a prefix cache needs block >= 1 and capacity >= 0, got {block}, {capacity}")
        self.block, self.capacity = block, capacity
        self.blocks: OrderedDict[bytes, Any] = OrderedDict()
        self.nbytes = 0  # the tensors' bytes of the payloads held (a stage's keys and values; 0 in an index)

    def match(self, prompt: list[int]) -> int:
        """Tokens at the head of ``prompt`` held here, whole blocks and at most ``len(prompt) - 1`` (the last prompt
        token always runs: its logits choose the first token). Touches nothing."""
        n = 0
        for key in block_keys(prompt, self.block, (len(prompt) - 1) // self.block):
            if key not in self.blocks:
                break
            n += 1
        return n * self.block

    def take(self, prompt: list[int], tokens: int) -> list[Any]:
        """The payloads of the blocks of ``prompt``'s first ``tokens`` (a stage copies them into a row's cache)."""
        keys = block_keys(prompt, self.block, tokens // self.block)
        missing = [b for b, key in enumerate(keys) if key not in self.blocks]
        if missing:
            raise InternalError(f"the prefix cache lacks blocks {missing} the plan reuses (the index and this "
                                f"stage's cache disagree)")
        return [self.blocks[key] for key in keys]

    def touch(self, prompt: list[int], tokens: int) -> None:
        """Mark the blocks of ``prompt``'s first ``tokens`` used now, tail first (the head is kept longest)."""
        for key in reversed(block_keys(prompt, self.block, tokens // self.block)):
            self.blocks.move_to_end(key)

    def add(self, prompt: list[int], payload: Callable[[int], Any] = lambda b: None) -> None:
        """Keep ``prompt``'s whole blocks (``payload(b)``: block ``b``'s, made only for blocks not held yet), touched
        tail first; then evict the least recently used beyond the capacity."""
        if not self.capacity:
            return
        keys = block_keys(prompt, self.block, len(prompt) // self.block)
        for b in reversed(range(len(keys))):
            if keys[b] in self.blocks:
                self.blocks.move_to_end(keys[b])
            else:
                self.blocks[keys[b]] = made = payload(b)
                self.nbytes += _payload_bytes(made)
        while len(self.blocks) > self.capacity:
            self.nbytes -= _payload_bytes(self.blocks.popitem(last=False)[1])


def _payload_bytes(payload: Any) -> int:
    """Bytes of a block's tensors (layer -> (keys, values)); 0 for an index's None."""
    if not payload:
        return 0
    return sum(t.numel() * t.element_size() for pair in payload.values() for t in pair)


class RingPrefix:
    """The prefix caches one rank keeps across rings (the engine holds it): each of its stages' and, on the
    coordinator, each data-parallel replica's index, all of ``block`` tokens and ``capacity`` blocks.

    Example:
        >>> prefix = RingPrefix(block=16, capacity=256)
        >>> prefix.stage(0).match(prompt), prefix.index(0).match(prompt)     # equal: mirrored
    """

    def __init__(self, *, block: int, capacity: int):
        self.block, self.capacity = block, capacity
        self._stages: dict[int, PrefixCache] = {}
        self._indexes: dict[int, PrefixCache] = {}

    def stage(self, index: int) -> PrefixCache:
        """Stage ``index``'s cache on this rank (keys and values of its layers)."""
        return self._stages.setdefault(index, PrefixCache(block=self.block, capacity=self.capacity))

    def index(self, replica: int) -> PrefixCache:
        """The coordinator's index of replica ``replica``'s caches."""
        return self._indexes.setdefault(replica, PrefixCache(block=self.block, capacity=self.capacity))

    def clear(self) -> None:
        """Forget everything (after a failure inside a ring the caches and the index may disagree)."""
        self._stages.clear()
        self._indexes.clear()
