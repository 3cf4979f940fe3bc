"""Structured output: OpenAI's ``response_format`` JSON modes as a logits processor, built on llguidance.

llguidance (one of vLLM's structured-output backends) compiles a JSON schema to a grammar and, for each
step, says which tokens of the vocabulary may come next. :class:`GrammarProcessor` is a transformers
``LogitsProcessor`` that sets every other token's score to ``-inf``; once the grammar is complete (or the
row left it, which a mask never allows) only EOS remains. It is given to transformers' ``generate``
(``logits_processor=[...]``) exactly as the serving engine gives it to each row.

* :func:`json_grammar` turns ``{"type": "json_object"}`` (any JSON object) and ``{"type": "json_schema",
  "json_schema": {"schema": {...}}}`` into a checked grammar, as vLLM does (``{"type": "object"}`` for the
  former); whitespace is llguidance's compact default, not "any whitespace", so a small model cannot
  spend its tokens on blank space.
* :class:`GrammarTokenizer` compiles a tokenizer's vocabulary for llguidance once (it walks every token)
  and keeps each grammar's first matcher, so a row's processor costs a copy; the serving engine keeps one.

Note (state): a matcher follows one row's tokens. The processor finds each row's matcher by the row's
ids so far (the last call's ids plus one token), not by its place in the batch, so it serves a batch
that is split into microbatches, rows that finish or are reordered, and rows with equal prompts.

Example:
    >>> grammars = GrammarTokenizer(tokenizer, eos_token_ids=[2])
    >>> proc = GrammarProcessor(grammars, json_grammar({"type": "json_object"}), prompt_length=len(ids))
    >>> out = model.generate(torch.tensor([ids]), logits_processor=[proc], max_new_tokens=64, do_sample=False)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch
from transformers import LogitsProcessor

from ..errors import InputError

__all__ = ["GrammarProcessor", "GrammarTokenizer", "json_grammar"]

_MODES = ("text", "json_object", "json_schema")
# llguidance's JSON compiler options; vLLM's default is {"whitespace_flexible": True} (any whitespace).
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise InputError("response_format needs llguidance: pip install 'hf-pipeline[serve]' "
                         "(or pip install llguidance)") from None
    return llguidance


def json_grammar(response_format: Any) -> str | None:
    """OpenAI's ``response_format`` as an llguidance grammar; None for ``{"type": "text"}`` (or None).

    Raises:
        InputError: an unknown type, a missing or invalid schema (llguidance's message), or no llguidance.
    """
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in _MODES:
        raise InputError(f"response_format type must be one of {', '.join(_MODES)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise InputError('response_format json_schema must be an object {"name": ..., "schema": {...}}')
        if not isinstance(schema, (dict, bool)):
            raise InputError("response_format json_schema.schema must be a JSON schema object")
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as e:
        raise InputError(f"response_format schema is not valid: {e}") from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise InputError(f"response_format schema is not supported: {'; '.join(messages)}")
    return grammar


class GrammarTokenizer:
    """A tokenizer's vocabulary as llguidance needs it, compiled on first use (then kept), and each
    grammar's first matcher (the last ``keep`` grammars).

    Args:
        tokenizer: a fast transformers tokenizer (llguidance reads its ``tokenizers`` form).
        eos_token_ids: the ids that end a row (what the grammar allows once complete).
        vocab_size: the model's vocabulary (its logits' width), when larger than the tokenizer's.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int | None = None, keep: int = 32):
        self.tokenizer, self.eos = tokenizer, sorted(int(t) for t in eos_token_ids)
        self.vocab_size, self.keep = vocab_size, keep
        self._compiled: Any = None
        self._first: OrderedDict[str, Any] = OrderedDict()
        # The server checks grammars in its request threads while the ring builds rows' matchers.
        self._lock = threading.Lock()

    @property
    def compiled(self) -> Any:
        """llguidance's ``LLTokenizer`` (compiled once)."""
        if self._compiled is None:
            llg = _llguidance()
            n_vocab = max(self.vocab_size or 0, len(self.tokenizer)) or None
            self._compiled = llg.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab, eos_token=self.eos or None)
        return self._compiled

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher of ``grammar`` (a copy of the one compiled first)."""
        with self._lock:
            first = self._first.pop(grammar, None)
            if first is None:
                first = _llguidance().LLMatcher(self.compiled, grammar, log_level=0)
                if first.is_error():
                    raise InputError(f"response_format grammar failed to compile: {first.get_error()}")
            self._first[grammar] = first
            while len(self._first) > self.keep:
                self._first.popitem(last=False)
            return first.deep_copy()


class GrammarProcessor(LogitsProcessor):
    """Masks each row's scores to the tokens ``grammar`` allows next; only EOS once it is complete.

    Args:
        grammars: the tokenizer's compiled form (:class:`GrammarTokenizer`).
        grammar: from :func:`json_grammar`.
        prompt_length: columns of ``input_ids`` that are the prompt (the grammar starts after them).
    """

    def __init__(self, grammars: GrammarTokenizer, grammar: str, prompt_length: int):
        self.grammars, self.grammar, self.prompt_length = grammars, grammar, prompt_length
        self._rows: dict[tuple[int, ...], Any] = {}  # each row's ids so far -> its matcher (see the Note)

    def _matcher(self, row: tuple[int, ...]) -> Any:
        """The matcher of ``row`` (its ids so far), advanced by its last token."""
        if len(row) <= self.prompt_length:
            return self.grammars.matcher(self.grammar)
        previous = self._rows.get(row[:-1])
        m = previous.deep_copy() if previous is not None else self.grammars.matcher(self.grammar)
        if previous is None:  # never seen (a processor first called mid-row): follow the row's tokens
            m.consume_tokens(list(row[self.prompt_length:]))
        else:
            m.consume_token(row[-1])  # a token the grammar refused puts the matcher in its error state
        return m

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        llgt = _llguidance().torch
        rows = [tuple(r) for r in input_ids.tolist()]
        # Equal rows (n choices of one prompt, before they differ) are in the same state: one matcher for them.
        fresh = {r: self._matcher(r) for r in dict.fromkeys(rows)}
        vocab = self.grammars.compiled.vocab_size
        bitmask = llgt.allocate_token_bitmask(len(rows), vocab)  # (B, ceil(V / 32)) int32, one bit per token
        failed = [i for i, r in enumerate(rows) if fresh[r].is_error()]
        for i, r in enumerate(rows):
            if i not in failed:
                llgt.fill_next_token_bitmask(fresh[r], bitmask, i)
        # The package's apply_token_bitmask_inplace is torch.compile'd (about a minute to compile on CPU):
        # the bits unpacked here instead, little-endian within each int32 word as llguidance writes them.
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]  # (B, V)
        for i in failed:  # the row left the grammar (never by this mask: a finished row's padding): EOS only
            allowed[i] = False
            allowed[i, [t for t in self.grammars.eos if t < vocab]] = True
        width = min(vocab, scores.shape[-1])
        keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        keep[:, :width] = allowed[:, :width].to(scores.device)
        for r in rows:  # the previous states are done with: only this call's rows are looked up next
            self._rows.pop(r[:-1], None)
        self._rows.update(fresh)
        return scores.masked_fill(~keep, float("-inf"))
