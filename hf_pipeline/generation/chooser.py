"""The last stage's part of the decode ring: from logits to the next token of each row.

transformers' logits processors (built per microbatch from the merged ``GenerationConfig``, as its
``generate`` builds them), greedy or per-row seeded sampling (:mod:`.sampling`), its stopping
criteria, the sequences so far and where each row finished.

Note (the caller's stopping criteria): transformers calls its stopping criteria once per step with
the whole batch's ids ``(B, cur_len)``, and a caller's criterion may keep per-row state sized to the
batch (lm-eval's ``MultiTokenEOSCriteria`` keeps ``done_tracker = [False] * batch_size`` and reads
``input_ids[i]`` for every ``i``). So the criteria the config makes (max length, EOS, stop strings:
stateless, per row) run per microbatch as each chooses its token, and the caller's own run once per
step on the whole batch, in row order, from :meth:`TokenChooser.end_step`, which the ring calls once
every microbatch has chosen that step's token (finished rows padded, as transformers pads them).
By then the ring has already fed some of those rows' tokens on (no barrier between microbatches):
a row the caller's criteria stop at step ``t`` is marked finished at ``t``, as in transformers, and
gets the pad id for the next step, which is chosen only after ``end_step(t)``; the ring then drops it.
The caller's logits processors still see one microbatch's rows per call (a processor with per-row
state sized to the batch is not supported).

Example (the last stage's rank, inside the ring):
    >>> chooser = TokenChooser(model.skeleton, request, device)
    >>> tokens = chooser.choose(microbatch, step, live_rows, logits[:, -1, :])     # (rows,)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from ..compat import generation_helper
from ..errors import InternalError
from .request import Request
from .sampling import row_generators, select_from_noise, select_tokens, step_noise

__all__ = ["TokenChooser"]


@dataclass
class _Sequences:
    """Last stage, one microbatch: the sequences so far and what decides the next token."""

    ids: torch.Tensor  # (n, L) every row of the microbatch, finished rows padded
    unfinished: torch.Tensor  # (n,) bool
    finished_at: torch.Tensor  # (n,) step that finished the row, -1 while generating
    processors: Any
    generators: list[torch.Generator] = field(default_factory=list)
    steps: int = 0
    own_steps: int = 0  # steps until its last row finished (a microbatch may run on, see ``Ring``)
    scores_seen: list[torch.Tensor] = field(default_factory=list)  # processed scores per step (output_scores)
    logits_seen: list[torch.Tensor] = field(default_factory=list)  # raw logits per step (output_logits)


class TokenChooser:
    """The last stage's token choice: transformers' logits processors (built per microbatch from the
    merged ``GenerationConfig``, as its ``generate`` builds them), greedy or per-row seeded sampling,
    and its stopping criteria, in transformers' order."""

    def __init__(self, skeleton: Any, req: Request, device: torch.device):
        self.req, self.device = req, device
        cur_len = req.prompt.shape[1]
        mask_key = "decoder_attention_mask" if req.encoder_decoder else "attention_mask"
        self.seqs: dict[int, _Sequences] = {}
        for i, (lo, hi) in enumerate(req.bounds):
            processors = generation_helper(skeleton, "_get_logits_processor")(
                generation_config=req.config, input_ids_seq_length=cur_len,
                encoder_input_ids=req.enc_ids[lo:hi] if req.enc_ids is not None else req.prompt[lo:hi],
                logits_processor=LogitsProcessorList(req.logits_processor or []),
                device=device, model_kwargs={mask_key: req.mask[lo:hi] if req.mask is not None else None},
            )
            n = hi - lo
            rows = range(req.row_offset + lo, req.row_offset + hi)  # global row indices seed the generators
            gens = row_generators(req.seed, rows, device) if req.do_sample and not req.stream else []
            self.seqs[i] = _Sequences(
                ids=req.prompt[lo:hi].clone(), unfinished=torch.ones(n, dtype=torch.bool, device=device),
                finished_at=torch.full((n,), -1, dtype=torch.long, device=device), processors=processors,
                generators=gens,
            )
        user = list(req.stopping_criteria or [])
        merged = generation_helper(skeleton, "_get_stopping_criteria")(
            generation_config=req.config, stopping_criteria=StoppingCriteriaList(user), tokenizer=req.tokenizer,
        )
        # transformers' merge keeps a caller's criterion in place of its own of the same type: split by identity.
        callers = [c for c in merged if any(c is u for u in user)]
        self.stopping = StoppingCriteriaList([c for c in merged if not any(c is u for u in user)])  # per microbatch
        self.user_stopping = StoppingCriteriaList(callers)  # whole batch, once per step (see the Note)
        self.checked = -1  # the last step the caller's criteria were called for
        self.batch_scores: list[torch.Tensor] = []  # (B, vocab) per step: what transformers passes them as scores
        # Sampling from the global stream: the step whose draws ``noise`` holds, and how many steps drew.
        self.noise: torch.Tensor | None = None
        self.noise_step, self.draws = -1, 0

    def choose(self, i: int, t: int, live: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Step ``t`` of microbatch ``i``: ``logits`` (live rows, vocab) -> ``(n,)`` tokens, pad for finished rows."""
        st, req = self.seqs[i], self.req
        n = st.ids.shape[0]
        # Processors see the microbatch in transformers' shape (finished rows included, as there).
        # While every row generates (most steps), the logits are that shape already and are used
        # as they are (in float32; nothing else reads them, so processors may change them in place),
        # without the scatter into and gather out of a zero (n, vocab) block. This runs between the
        # last stage's forward and the token's send, on the ring's critical path: the scatter and
        # gather took a third of it (0.5 ms per call at 8 rows x 8192 vocab).
        every = live.numel() == n
        if every:
            raw = logits.float()
        else:
            raw = torch.zeros(n, logits.shape[-1], dtype=torch.float32, device=self.device)
            raw[live] = logits.float()
        scores = st.processors(st.ids, raw)
        # As transformers records them: the same objects (rows that finished earlier are still
        # computed when these are asked for, see ``Ring``).
        if req.config.return_dict_in_generate and req.config.output_scores:
            st.scores_seen.append(scores)
        if req.config.return_dict_in_generate and req.config.output_logits:
            st.logits_seen.append(raw)
        if req.stream:
            first = req.row_offset + req.bounds[i][0]  # the microbatch's first row in the whole batch
            noise = self._noise(t, scores.shape[-1])[first: first + n]
            chosen = select_from_noise(scores if every else scores[live], noise if every else noise[live])
        else:
            gens = [st.generators[j] for j in live.tolist()] if req.do_sample else None
            chosen = select_tokens(scores if every else scores[live], do_sample=req.do_sample, generators=gens)
        # A finished row still run (records asked for, or stopped by the caller's criteria after the ring
        # fed it on, see the Note) gets pad, as transformers gives it.
        if every:
            tokens = chosen if bool(st.unfinished.all()) else torch.where(st.unfinished, chosen, req.pad)
        else:
            tokens = torch.full((n,), req.pad, dtype=torch.long, device=self.device)
            tokens[live] = chosen
            tokens.masked_fill_(~st.unfinished, req.pad)
        st.ids = torch.cat([st.ids, tokens[:, None]], dim=1)
        stop = self.stopping(st.ids, None).to(self.device)
        st.finished_at[st.unfinished & stop] = t
        st.unfinished &= ~stop
        st.steps = t + 1
        if st.own_steps == 0 and not bool(st.unfinished.any()):
            st.own_steps = t + 1
        return tokens

    def _noise(self, t: int, vocab: int) -> torch.Tensor:
        """Step ``t``'s draws for the whole batch, drawn at its first choice (every step ``t - 1`` choice and the
        caller's criteria of ``t - 1`` came before) when some row of this replica still generates, as transformers'
        loop draws for every row while any generates; ones (every row finished: each gets pad) otherwise."""
        if t < self.noise_step:
            raise InternalError(f"step {t} chose a token after step {self.noise_step} began (protocol error)")
        if t != self.noise_step:
            self.noise_step = t
            if self.generated(t):
                self.noise, self.draws = step_noise(self.req.total_rows, vocab, self.device), self.draws + 1
            else:
                self.noise = torch.ones(self.req.total_rows, vocab, device=self.device)
        return self.noise

    def end_step(self, t: int) -> None:
        """Every microbatch has chosen its step-``t`` token (or left the ring): the caller's stopping
        criteria see the whole batch's ids ``(B, L + t + 1)`` once, as transformers calls them, and the
        rows they stop finish at ``t``. Nothing when there are none, or when no row generated at ``t``
        (transformers' loop had ended)."""
        if not self.user_stopping or t <= self.checked or not self.generated(t):
            return
        self.checked = t
        seqs, width = list(self.seqs.values()), self.req.prompt.shape[1] + t + 1
        for st in seqs:
            if st.ids.shape[1] < width and bool(st.unfinished.any()):
                raise InternalError(
                    f"the stopping criteria of step {t} ran before every microbatch chose its token (protocol error)"
                )
        # A microbatch that finished earlier is padded, as transformers pads its finished rows.
        ids = torch.cat([_to_width(st.ids, width, self.req.pad) for st in seqs])  # (B, L + t + 1)
        scores = None
        if self.req.config.return_dict_in_generate and self.req.config.output_scores:
            # Every microbatch ran step t (records asked for: no row leaves while any generates).
            self.batch_scores.append(torch.cat([st.scores_seen[t] for st in seqs]))
            scores = tuple(self.batch_scores)
        stop = self.user_stopping(ids, scores).to(self.device)  # (B,) bool
        lo = 0
        for st in seqs:
            n = st.ids.shape[0]
            hit = stop[lo: lo + n] & st.unfinished
            st.finished_at[hit] = t
            st.unfinished &= ~hit
            if st.own_steps == 0 and not bool(st.unfinished.any()):
                st.own_steps = t + 1
            lo += n

    def generated(self, t: int) -> bool:
        """Whether some row was still generating at step ``t`` (transformers' loop ran that step)."""
        return any(bool(((st.finished_at < 0) | (st.finished_at >= t)).any()) for st in self.seqs.values())

    def finished(self, i: int) -> bool:
        """Whether every row of microbatch ``i`` has finished."""
        return not bool(self.seqs[i].unfinished.any())

    def unfinished(self, i: int) -> torch.Tensor:
        """``(n,)`` bool: the rows of microbatch ``i`` still generating."""
        return self.seqs[i].unfinished

    def result(self) -> dict[str, Any]:
        """``sequences`` (B, L + steps) padded with ``pad``, generated ``lengths`` (B,), and the per-step
        ``scores`` / ``logits`` (tuples of ``(B, vocab)``, None unless asked for)."""
        steps = max(st.own_steps or st.steps for st in self.seqs.values())
        width = self.req.prompt.shape[1] + steps
        ids, lengths = [], []
        for st in self.seqs.values():
            ids.append(_to_width(st.ids, width, self.req.pad))
            # A finished row generated up to its stop token; the others, every step of the microbatch.
            lengths.append(
                torch.where(st.finished_at >= 0, st.finished_at + 1, torch.full_like(st.finished_at, st.steps))
            )
        return {
            "sequences": torch.cat(ids), "lengths": torch.cat(lengths).clamp(max=steps),
            "scores": _steps([st.scores_seen for st in self.seqs.values()], steps),
            "logits": _steps([st.logits_seen for st in self.seqs.values()], steps),
        }


def _to_width(ids: torch.Tensor, width: int, pad: int) -> torch.Tensor:
    """``ids`` cut or padded with ``pad`` to ``width`` columns."""
    if ids.shape[1] >= width:
        return ids[:, :width]
    return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=pad)


def _steps(seen: list[list[torch.Tensor]], steps: int) -> tuple[torch.Tensor, ...] | None:
    """Per step (up to ``steps``), the microbatches' recorded ``(rows, vocab)`` tensors in row order."""
    if not seen[0]:
        return None
    return tuple(torch.cat([s[t] for s in seen]) for t in range(steps))
