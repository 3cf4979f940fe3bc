"""Beam search on the last stage of the decode ring: transformers' own beam steps, one microbatch at a time.

transformers' ``_beam_search`` is vectorised over ``(prompts, beams)``: each step it turns the
logits into log-probabilities, runs the logits processors, keeps the top ``K`` continuations of
every prompt, picks the ``num_beams`` best running ones and merges the finished ones. Every prompt's
beams are independent of the other prompts', so the same steps run here on one microbatch's rows at
a time, with transformers' own helper methods (``_get_top_k_continuations``,
``_update_finished_beams``, ...) and the same state tensors, and give the same beams.

A microbatch holds whole beam groups (all ``num_beams`` rows of a prompt; ``request.py`` cuts
the rows so): the chosen beams' source rows (:meth:`BeamChooser.sources`, microbatch-local row
indices, transformers' ``beam_idx``) go back round the ring with the tokens, and every stage
reorders its cache of that microbatch by them (``Cache.reorder_cache``) before its next forward.

Note (when a microbatch stops): transformers stops the loop when no prompt of the *batch* can still
change; here a microbatch leaves the ring when none of *its* prompts can (``_beam_search_has_unfinished
_sequences`` on its rows). A finished prompt's beams are frozen in transformers' loop (every new
candidate gets -1e9), so stopping it earlier changes nothing. One corner differs: transformers also
goes on while any prompt of the batch has a continuation that hits no stopping criterion; a
microbatch whose every top-K candidate ends at once (e.g. all of them EOS) stops here.
A done microbatch stays in the ring while others go on when per-step scores are asked for, or in the ring's
lock step (experts over data-parallel ranks): :meth:`BeamChooser.choose` then goes on with transformers' steps,
as its loop does for every prompt of the batch, and a prompt done for good keeps its finished beams (every new
candidate of it gets -1e9), so the result is the same; the corner above only goes on there as in transformers.

Note (the caller's stopping criteria): they run with the config's, per microbatch, on its top-K
candidates ``(g * beams_to_keep, cur_len + 1)``, where transformers calls them once per step on
the whole batch's ``(B * beams_to_keep, cur_len + 1)``. Unlike greedy and sampling (``chooser.py``),
they cannot be deferred: the same step's beam choice reads their answer, so a whole-batch call would
stop every microbatch until the last one reached that step (a barrier per step). A criterion that
reads each row alone behaves as in transformers; one with per-row state sized to the batch does not.

Example (the last stage's rank, inside the ring):
    >>> chooser = BeamChooser(model.skeleton, request, device)
    >>> tokens = chooser.choose(microbatch, step, live_rows, logits[:, -1, :])   # (rows,)
    >>> chooser.sources(microbatch)                                              # (rows,) beam_idx
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from ..compat import eos_token_tensor, generation_helper, pad_token_tensor
from .request import Request

__all__ = ["BeamChooser", "beam_fill"]


def beam_fill(config: Any) -> int:
    """The id transformers' beam search fills unused positions with: ``(pad or eos[0]) if eos else -1``,
    its operator precedence included (a pad id of 0 gives the first EOS id)."""
    eos, pad = eos_token_tensor(config), pad_token_tensor(config)
    return int(pad or eos[0]) if eos is not None else -1


@dataclass
class _Beams:
    """One microbatch's beam search state, transformers' tensors of shape ``(prompts, beams, ...)``."""

    running: torch.Tensor  # (g, nb, max_length) running sequences
    sequences: torch.Tensor  # (g, nb, max_length) finished sequences
    running_scores: torch.Tensor  # (g, nb)
    scores: torch.Tensor  # (g, nb) finished scores
    finished: torch.Tensor  # (g, nb) is_sent_finished
    improvable: torch.Tensor  # (g, 1) is_early_stop_heuristic_unsatisfied
    hits: torch.Tensor  # (g, nb) next_token_hits_stopping_criteria
    running_indices: torch.Tensor  # (g, nb, max_length - prompt) running beam indices
    indices: torch.Tensor  # (g, nb, max_length - prompt) finished beam indices
    processors: Any
    cur_len: int
    done: bool = False
    steps: int = 0
    own_steps: int = 0  # steps until its own search was done (it may run on, see ``Ring``)
    scores_seen: list[torch.Tensor] = field(default_factory=list)  # processed log-probs per step (output_scores)
    logits_seen: list[torch.Tensor] = field(default_factory=list)  # raw logits per step (output_logits)


class BeamChooser:
    """The last stage's beam search: per microbatch, transformers' beam steps on its logits."""

    def __init__(self, skeleton: Any, req: Request, device: torch.device):
        self.skeleton, self.req, self.device = skeleton, req, device
        gc = req.config
        self.num_beams, self.max_length = int(gc.num_beams), int(gc.max_length)
        self.prompt_len = req.prompt.shape[1]
        eos = eos_token_tensor(gc)
        self.n_eos = eos.shape[0] if eos is not None else 0
        self.beams_to_keep = max(2, 1 + self.n_eos) * self.num_beams
        self.top_mask = torch.zeros(self.beams_to_keep, dtype=torch.bool, device=device)
        self.top_mask[: self.num_beams] = True
        self.fill = beam_fill(gc)
        self.helper = lambda name: generation_helper(skeleton, name)
        self.stopping = self.helper("_get_stopping_criteria")(
            generation_config=gc, stopping_criteria=StoppingCriteriaList(req.stopping_criteria or []),
            tokenizer=req.tokenizer,
        )
        mask_key = "decoder_attention_mask" if req.encoder_decoder else "attention_mask"
        self.beams: dict[int, _Beams] = {}
        for i, (lo, hi) in enumerate(req.bounds):
            processors = self.helper("_get_logits_processor")(
                generation_config=gc, input_ids_seq_length=self.prompt_len,
                encoder_input_ids=req.enc_ids[lo:hi] if req.enc_ids is not None else req.prompt[lo:hi],
                logits_processor=LogitsProcessorList(req.logits_processor or []),
                device=device, model_kwargs={mask_key: req.mask[lo:hi] if req.mask is not None else None},
            )
            self.beams[i] = self._start(req.prompt[lo:hi], processors)

    def _start(self, prompt: torch.Tensor, processors: Any) -> _Beams:
        """transformers' initial beam state for the rows ``prompt`` (``(g * nb, L)``)."""
        nb, dev = self.num_beams, self.device
        g = prompt.shape[0] // nb
        running = torch.full((g, nb, self.max_length), self.fill, dtype=torch.int64, device=dev)
        running[:, :, : self.prompt_len] = prompt.reshape(g, nb, -1)
        running_scores = torch.zeros((g, nb), dtype=torch.float, device=dev)
        running_scores[:, 1:] = -1e9  # only the first beam's tokens count at the first step
        indices = torch.full((g, nb, self.max_length - self.prompt_len), -1, dtype=torch.int32, device=dev)
        return _Beams(
            running=running, sequences=running.clone(), running_scores=running_scores,
            scores=torch.full((g, nb), -1e9, dtype=torch.float, device=dev),
            finished=torch.zeros((g, nb), dtype=torch.bool, device=dev),
            improvable=torch.ones((g, 1), dtype=torch.bool, device=dev),
            hits=torch.zeros((g, nb), dtype=torch.bool, device=dev),
            running_indices=indices, indices=indices.clone(), processors=processors, cur_len=self.prompt_len,
        )

    def choose(self, i: int, t: int, live: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Step ``t`` of microbatch ``i``: ``logits`` ``(rows, vocab)`` -> the running beams' next tokens ``(rows,)``.

        ``live`` is every row (a beam microbatch never drops single rows); kept for the chooser interface.
        """
        b, gc, nb, helper = self.beams[i], self.req.config, self.num_beams, self.helper
        g, cur_len = b.running.shape[0], b.cur_len
        logits = logits.to(dtype=torch.float32, copy=True)
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        log_probs = b.processors(b.running[:, :, :cur_len].reshape(g * nb, cur_len), log_probs)
        if gc.return_dict_in_generate and gc.output_logits:
            b.logits_seen.append(logits.clone())
        if gc.return_dict_in_generate and gc.output_scores:
            b.scores_seen.append(log_probs.clone())
        log_probs = log_probs.reshape(g, nb, -1) + b.running_scores[:, :, None]
        log_probs = log_probs.reshape(g, -1)  # (g, nb * vocab)
        topk_log_probs, topk_running, topk_indices = helper("_get_top_k_continuations")(
            accumulated_log_probs=log_probs, running_sequences=b.running, running_beam_indices=b.running_indices,
            cur_len=cur_len, decoder_prompt_len=self.prompt_len, do_sample=False,
            beams_to_keep=self.beams_to_keep, num_beams=nb, batch_size=g,
        )
        hits = self.stopping(topk_running[:, :, : cur_len + 1].reshape(g * self.beams_to_keep, -1), None)
        b.hits = hits.to(self.device).reshape(g, self.beams_to_keep)
        b.running, b.running_scores, b.running_indices = helper("_get_running_beams_for_next_iteration")(
            topk_log_probs=topk_log_probs, topk_running_sequences=topk_running,
            topk_running_beam_indices=topk_indices, next_token_hits_stopping_criteria=b.hits, num_beams=nb,
        )
        b.sequences, b.scores, b.indices, b.finished = helper("_update_finished_beams")(
            sequences=b.sequences, topk_running_sequences=topk_running, beam_scores=b.scores,
            topk_log_probs=topk_log_probs, beam_indices=b.indices, topk_running_beam_indices=topk_indices,
            is_early_stop_heuristic_unsatisfied=b.improvable, is_sent_finished=b.finished,
            next_token_hits_stopping_criteria=b.hits, top_num_beam_mask=self.top_mask, num_beams=nb,
            cur_len=cur_len, decoder_prompt_len=self.prompt_len, length_penalty=gc.length_penalty,
            early_stopping=gc.early_stopping,
        )
        b.cur_len = cur_len + 1
        b.improvable = helper("_check_early_stop_heuristic")(
            is_early_stop_heuristic_unsatisfied=b.improvable, running_beam_scores=b.running_scores,
            beam_scores=b.scores, is_sent_finished=b.finished, cur_len=b.cur_len, max_length=self.max_length,
            decoder_prompt_len=self.prompt_len, early_stopping=gc.early_stopping, length_penalty=gc.length_penalty,
        )
        b.done = not bool(
            helper("_beam_search_has_unfinished_sequences")(b.improvable, b.finished, b.hits, gc.early_stopping)
        )
        b.steps = t + 1
        if b.done and b.own_steps == 0:
            b.own_steps = t + 1
        return b.running[:, :, cur_len].reshape(-1)  # (g * nb,) the next input tokens

    def end_step(self, t: int) -> None:
        """Nothing: beam search calls the caller's stopping criteria inside each microbatch's step (see the Note)."""

    def sources(self, i: int) -> torch.Tensor:
        """``(rows,)`` int64: the microbatch-local row each running beam continues (transformers' ``beam_idx``)."""
        b = self.beams[i]
        return b.running_indices[..., b.cur_len - 1 - self.prompt_len].reshape(-1).long()

    def finished(self, i: int) -> bool:
        """Whether microbatch ``i``'s beam search is done."""
        return self.beams[i].done

    def unfinished(self, i: int) -> torch.Tensor:
        """``(rows,)`` bool: every row while the microbatch's beam search goes on, none once it is done."""
        b = self.beams[i]
        n = b.running.shape[0] * self.num_beams
        return torch.full((n,), not b.done, dtype=torch.bool, device=self.device)

    def result(self) -> dict[str, Any]:
        """The best ``num_return_sequences`` beams of every prompt, as transformers returns them.

        Returns:
            ``sequences`` ``(B * r, L + new)`` (new: the longest returned beam's), ``lengths`` (its rows'
            generated lengths), ``sequences_scores`` ``(B * r,)``, ``beam_indices`` ``(B * r, new)`` and
            ``scores`` / ``logits`` (tuples of ``(B * nb, vocab)`` per step, or None if not asked for).
        """
        r = int(self.req.config.num_return_sequences or 1)
        seqs = torch.cat([b.sequences[:, :r].reshape(-1, self.max_length) for b in self.beams.values()])
        scores = torch.cat([b.scores[:, :r].reshape(-1) for b in self.beams.values()])
        # transformers' beam indices count rows over the whole batch: this microbatch's first row is ``lo``.
        indices = torch.cat([
            torch.where(b.indices >= 0, b.indices + lo, b.indices)[:, :r].reshape(-1, b.indices.shape[-1])
            for b, (lo, _) in zip(self.beams.values(), self.req.bounds)
        ])
        lengths = (indices + 1).bool().sum(dim=1)
        new = int(lengths.max())
        return {
            "sequences": seqs[:, : self.prompt_len + new], "lengths": lengths, "sequences_scores": scores,
            "beam_indices": indices[:, :new], "scores": self._steps("scores_seen"),
            "logits": self._steps("logits_seen"),
        }

    def _steps(self, name: str) -> tuple[torch.Tensor, ...] | None:
        """Per step, the microbatches' recorded ``(rows, vocab)`` tensors stacked in row order."""
        seen = [getattr(b, name) for b in self.beams.values()]
        if not seen[0]:
            return None
        # Every microbatch runs until all are done (see the ring), some one step more: cut to transformers' steps.
        steps = max(b.own_steps or b.steps for b in self.beams.values())
        return tuple(torch.cat([s[t] for s in seen]) for t in range(steps))
