"""The last stage's part of the decode ring: from logits to the next token of each row.

transformers' logits processors (built per microbatch from the merged ``GenerationConfig``, as its
``generate`` builds them), greedy or per-row seeded sampling (:mod:`.sampling`), its stopping
criteria, the sequences so far and where each row finished.

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
from .request import Request
from .sampling import row_generators, select_tokens

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
            gens = row_generators(req.seed, rows, device) if req.do_sample else []
            self.seqs[i] = _Sequences(
                ids=req.prompt[lo:hi].clone(), unfinished=torch.ones(n, dtype=torch.bool, device=device),
                finished_at=torch.full((n,), -1, dtype=torch.long, device=device), processors=processors,
                generators=gens,
            )
        self.stopping = generation_helper(skeleton, "_get_stopping_criteria")(
            generation_config=req.config, stopping_criteria=StoppingCriteriaList(req.stopping_criteria or []),
            tokenizer=req.tokenizer,
        )

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
        gens = [st.generators[j] for j in live.tolist()] if req.do_sample else None
        chosen = select_tokens(scores if every else scores[live], do_sample=req.do_sample, generators=gens)
        if every:
            # A finished row still run (records asked for) gets pad, as transformers gives it.
            tokens = chosen if bool(st.unfinished.all()) else torch.where(st.unfinished, chosen, req.pad)
        else:
            tokens = torch.full((n,), req.pad, dtype=torch.long, device=self.device)
            tokens[live] = chosen
        st.ids = torch.cat([st.ids, tokens[:, None]], dim=1)
        stop = self.stopping(st.ids, None).to(self.device)
        st.finished_at[st.unfinished & stop] = t
        st.unfinished &= ~stop
        st.steps = t + 1
        if st.own_steps == 0 and not bool(st.unfinished.any()):
            st.own_steps = t + 1
        return tokens

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
            pad = width - st.ids.shape[1]
            ids.append(torch.nn.functional.pad(st.ids, (0, pad), value=self.req.pad) if pad > 0 else st.ids[:, :width])
            # A finished row generated up to its stop token; the others, every step of the microbatch.
            lengths.append(
                torch.where(st.finished_at >= 0, st.finished_at + 1, torch.full_like(st.finished_at, st.steps))
            )
        return {
            "sequences": torch.cat(ids), "lengths": torch.cat(lengths).clamp(max=steps),
            "scores": _steps([st.scores_seen for st in self.seqs.values()], steps),
            "logits": _steps([st.logits_seen for st in self.seqs.values()], steps),
        }


def _steps(seen: list[list[torch.Tensor]], steps: int) -> tuple[torch.Tensor, ...] | None:
    """Per step (up to ``steps``), the microbatches' recorded ``(rows, vocab)`` tensors in row order."""
    if not seen[0]:
        return None
    return tuple(torch.cat([s[t] for s in seen]) for t in range(steps))
