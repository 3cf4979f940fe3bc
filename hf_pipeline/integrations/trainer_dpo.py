"""TRL's ``DPOTrainer`` on a pipelined model: its loss computed on the last stage, microbatch by microbatch.

``class PipelineDPOTrainer(PipelineTrainerMixin, trl.DPOTrainer)`` trains as ``DPOTrainer`` does on one
process. TRL's collator gives a batch of ``B`` pairs as ``2B`` rows, ``[chosen; rejected]``; TRL's loss is a
function of each pair's four sequence log-probabilities (policy and reference, chosen and rejected), averaged
over the pairs. Here:

* **Pairs stay together.** The rows are reordered so that every microbatch (of every data-parallel replica)
  holds whole pairs: its chosen rows, then the same pairs' rejected rows (:meth:`DPOStep.ordered`).
* **The loss is the pipeline's.** ``model.train_step(batch, loss=...)`` runs :func:`dpo_loss` on the last
  stage: each microbatch's pair losses summed and divided by the global batch's pairs, so the microbatch losses
  add up to TRL's mean over pairs. The targets travel with the microbatch as one tensor: the labels (the input
  ids outside the completion masked with -100, as TRL builds them), the reference log-probability and the
  row's place in TRL's order.
* **The reference.** TRL's ``precompute_ref_log_probs=True`` columns; else a forward-only pipelined pass
  (no gradient) of ``ref_model`` (a second pipelined model) or, for a PEFT model without ``ref_model``, of the
  same model with its adapter disabled (or TRL's frozen ``"ref"`` adapter), as TRL does. The precomputed
  columns are made the same way, by the pipelined forward of the reference, on every rank.
* **Metrics.** The last stage records each row's log-probability, entropy, mean logit and top-1 hits; one
  all-reduce gives them to every rank, which logs TRL's ``rewards/*``, ``logps/*``, ``logits/*``,
  ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` into TRL's own metric store.

Refused at construction (:func:`check_dpo`), naming the option: loss types that are no per-pair function
(``aot``, ``aot_unpaired`` sort over the batch; ``sft`` is a token mean over the batch), ``f_divergence_type``
other than ``reverse_kl``, ``use_weighting``, ``padding_free``, ``ld_alpha``, ``sync_ref_model``, an MoE auxiliary
loss, an unpipelined ``ref_model`` and full
fine-tuning with neither ``ref_model`` nor ``precompute_ref_log_probs`` (TRL would load an unsplit copy of
the model on every rank).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ..compat import TRL_METRICS, TRL_TOKENS
from ..errors import UsageError
from ..families.losses import IGNORE_INDEX, LossFunction
from .peft_host import is_pipelined_model
from .trainer_data import single_process_loader

__all__ = [
    "DPO_TRAINERS", "PAIR_LOSSES", "DPOSettings", "DPOStep", "check_dpo", "completion_lengths", "dpo_loss", "is_dpo",
    "pair_loss", "row_stats",
]

# Trainer classes (module-qualified) whose loss DPOStep computes through the pipeline.
DPO_TRAINERS: frozenset[str] = frozenset({"trl.trainer.dpo_trainer.DPOTrainer"})


def is_dpo(trainer_class: type) -> bool:
    """Whether ``trainer_class`` is (or derives from) one of :data:`DPO_TRAINERS`."""
    return any(f"{c.__module__}.{c.__qualname__}" in DPO_TRAINERS for c in trainer_class.__mro__)


@dataclass(frozen=True, kw_only=True)
class DPOSettings:
    """What TRL's DPO loss reads from ``DPOConfig``."""

    beta: float
    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    label_smoothing: float
    discopop_tau: float

    @classmethod
    def of(cls, args) -> DPOSettings:
        types = tuple(args.loss_type) if isinstance(args.loss_type, (list, tuple)) else (args.loss_type,)
        weights = tuple(args.loss_weights) if args.loss_weights else (1.0,) * len(types)
        return cls(beta=args.beta, loss_types=types, loss_weights=weights, label_smoothing=args.label_smoothing,
                   discopop_tau=args.discopop_tau)


@dataclass(frozen=True, kw_only=True)
class Pairs:
    """One microbatch's pairs: log-ratios to the reference and completion lengths, (pairs,) each."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor


def _exo(p: Pairs, s: DPOSettings) -> torch.Tensor:
    z = s.beta * (p.chosen - p.rejected)
    eps = torch.tensor(s.label_smoothing, device=z.device)
    return (torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - torch.log(eps)))


def _robust(p: Pairs, s: DPOSettings) -> torch.Tensor:
    z, e = s.beta * (p.chosen - p.rejected), s.label_smoothing
    return (-(1 - e) * F.logsigmoid(z) + e * F.logsigmoid(-z)) / (1 - 2 * e)


def _per_token(p: Pairs) -> torch.Tensor:
    return p.chosen / p.chosen_len - p.rejected / p.rejected_len


def _discopop(p: Pairs, s: DPOSettings) -> torch.Tensor:
    z = s.beta * (p.chosen - p.rejected)
    mix = torch.sigmoid(z / s.discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


# TRL 1.16's per-pair losses (DPOTrainer._compute_loss), with f_divergence_type="reverse_kl": the scores are the
# log-ratios. Each is a function of one pair alone, so a microbatch's pairs give their part of the mean.
PAIR_LOSSES: dict[str, Callable[[Pairs, DPOSettings], torch.Tensor]] = {
    "sigmoid": lambda p, s: -F.logsigmoid(s.beta * (p.chosen - p.rejected)),
    "hinge": lambda p, s: torch.relu(1 - s.beta * (p.chosen - p.rejected)),
    "ipo": lambda p, s: (_per_token(p) - 1 / (2 * s.beta)) ** 2,
    "exo_pair": _exo,
    "nca_pair": lambda p, s: (-F.logsigmoid(s.beta * p.chosen) - 0.5 * F.logsigmoid(-s.beta * p.chosen)
                              - 0.5 * F.logsigmoid(-s.beta * p.rejected)),
    "robust": _robust,
    "bco_pair": lambda p, s: -F.logsigmoid(s.beta * p.chosen) - F.logsigmoid(-s.beta * p.rejected),
    "sppo_hard": lambda p, s: (p.chosen - 0.5 / s.beta) ** 2 + (p.rejected + 0.5 / s.beta) ** 2,
    "apo_zero": lambda p, s: 1 - torch.sigmoid(s.beta * p.chosen) + torch.sigmoid(s.beta * p.rejected),
    "apo_down": lambda p, s: (torch.sigmoid(s.beta * p.chosen)
                              + 1 - torch.sigmoid(s.beta * (p.chosen - p.rejected))),
    "discopop": _discopop,
    "sigmoid_norm": lambda p, s: -F.logsigmoid(s.beta * _per_token(p)),
}

# Loss types that are no function of one pair: why, for the refusal.
_NOT_PER_PAIR = {
    "aot": "sorts the log-ratios over the whole batch",
    "aot_unpaired": "sorts the log-ratios over the whole batch",
    "sft": "is a mean over the chosen tokens of the whole batch",
}

_STATS = 5  # per row: log-probability, entropy sum, mean-logit sum, top-1 hits, completion tokens


def row_stats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, over the completion tokens (label not -100; position t predicts t+1), as TRL's fused head gives them.

    Args:
        logits: (rows, T, V).
        labels: (rows, T), -100 outside the completion.

    Returns:
        (rows, 5) fp32: the summed log-probability (with its gradient), then, detached, the summed entropy,
        the summed mean logit, the top-1 hits and the number of completion tokens.
    """
    logits, labels = logits[:, :-1].float(), labels[:, 1:].to(logits.device)  # (rows, T-1, V), (rows, T-1)
    mask = labels != IGNORE_INDEX
    logp = F.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (rows, T-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
        hits = logits.argmax(-1) == labels
        extra = [(entropy * mask).sum(1), (logits.mean(-1) * mask).sum(1), (hits & mask).sum(1).float(),
                 mask.sum(1).float()]
    return torch.stack([(picked * mask).sum(1), *extra], dim=1)


def completion_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Completion tokens per row, (rows,): TRL's ``completion_mask.sum(1)``, read from the labels."""
    return (labels != IGNORE_INDEX).sum(1).float()


def pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor,
              settings: DPOSettings) -> torch.Tensor:
    """TRL's weighted sum of loss types for each pair, (pairs,): ``chosen`` / ``rejected`` sequence log-probabilities,
    ``ref`` the reference's as ``[chosen; rejected]``, ``tokens`` the completion lengths as ``[chosen; rejected]``."""
    n = chosen.shape[0]
    ref = ref.to(chosen.device, chosen.dtype)
    # TRL's length normalisation counts completion_mask, at least 1.
    length = tokens.to(chosen.device).clamp(min=1.0)
    p = Pairs(chosen=chosen - ref[:n], rejected=rejected - ref[n:], chosen_len=length[:n], rejected_len=length[n:])
    return sum(w * PAIR_LOSSES[t](p, settings) for t, w in zip(settings.loss_types, settings.loss_weights))


class RowRecorder:
    """The rows' statistics a stage's loss computed during one step: (row in TRL's order, stats) per microbatch."""

    def __init__(self) -> None:
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []

    def table(self, total_rows: int, device: torch.device) -> torch.Tensor:
        """(total_rows, 5): this rank's recorded rows, zeros elsewhere; emptied."""
        out = torch.zeros(total_rows, _STATS, dtype=torch.float64, device=device)
        for rows, stats in self.rows:
            out[rows.to(device)] = stats.to(device, torch.float64)
        self.rows.clear()
        return out


def _pack(given: dict[str, torch.Tensor], length: int) -> torch.Tensor:
    # One (rows, T + 2) float64 target the schedule splits with the inputs: labels (exact in float64), the
    # reference log-probability, the row's place in TRL's [chosen; rejected] order.
    labels = given["labels"].to(torch.float64)
    return torch.cat([labels, given["ref_logps"].to(torch.float64)[:, None], given["rows"].to(torch.float64)[:, None]],
                     dim=1)


def dpo_loss(settings: DPOSettings, recorder: RowRecorder) -> LossFunction:
    """TRL's DPO loss as a pipeline :class:`~hf_pipeline.families.losses.LossFunction`.

    Each microbatch's rows are its chosen rows, then the same pairs' rejected rows; its share is its pairs' losses
    summed over ``denominator`` (the global batch's pairs), so the shares add up to TRL's mean over pairs.
    """

    def share(outputs, targets, config, denominator):
        labels, ref, rows = targets[:, :-2].long(), targets[:, -2], targets[:, -1].long()
        stats = row_stats(outputs[0], labels)  # (rows, 5)
        n = stats.shape[0] // 2
        losses = pair_loss(stats[:n, 0], stats[n:, 0], ref, completion_lengths(labels), settings)
        recorder.rows.append((rows.detach(), stats.detach()))
        return losses.sum() / denominator

    return LossFunction(
        name="dpo", share=share, count=lambda targets, config: targets.shape[0] // 2, token_level=False,
        targets=("labels", "ref_logps", "rows"), make_targets=_pack, labels_as="causal_lm",
    )


# ----------------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------------
def check_dpo(args, given: dict[str, Any], adapter: bool, rows: Callable[[int], int]) -> None:
    """Refuse what :class:`DPOStep` cannot compute as TRL does, before TRL's constructor runs.

    Args:
        args: the ``DPOConfig``.
        given: the other constructor arguments (``ref_model``, ``peft_config``).
        adapter: the model is a PEFT model wrapping the pipelined one.
        rows: microbatches a training step of this many rows runs (``model.microbatches_for``).

    Raises:
        UsageError: naming the option and what to pass instead.
    """
    types = DPOSettings.of(args).loss_types
    for t in types:
        if t in _NOT_PER_PAIR:
            raise UsageError(
                f"loss_type={t!r} is not supported by PipelineTrainerMixin with DPOTrainer: it {_NOT_PER_PAIR[t]}, "
                f"while the pipeline computes the loss microbatch by microbatch; use a per-pair loss_type "
                f"({', '.join(sorted(PAIR_LOSSES))})"
            )
        if t not in PAIR_LOSSES:
            raise UsageError(f"loss_type={t!r} is not known to PipelineTrainerMixin's DPO loss; use one of "
                             f"{sorted(PAIR_LOSSES)}")
    ref_model = given.get("ref_model")
    refused = [
        (args.f_divergence_type != "reverse_kl", f"f_divergence_type={args.f_divergence_type!r}",
         "pass f_divergence_type='reverse_kl'"),
        (args.use_weighting, "use_weighting=True", "pass use_weighting=False"),
        (getattr(args, "padding_free", False), "padding_free=True",
         "pass padding_free=False (the pipeline's DPO step reorders whole rows of pairs, which a padding-free batch's "
         "one row has not)"),
        (args.ld_alpha is not None, f"ld_alpha={args.ld_alpha}", "pass ld_alpha=None"),
        (args.sync_ref_model, "sync_ref_model=True", "pass sync_ref_model=False"),
        (bool(args.router_aux_loss_coef), f"router_aux_loss_coef={args.router_aux_loss_coef}",
         "pass router_aux_loss_coef=0 (a mixture of experts' auxiliary loss is not computed)"),
        (ref_model is not None and not is_pipelined_model(ref_model), f"ref_model={type(ref_model).__name__}",
         "load the reference with from_pretrained(path, pipeline=True) too"),
        (ref_model is None and not adapter and not args.precompute_ref_log_probs, "ref_model=None",
         "pass ref_model=<a second pipelined model> or precompute_ref_log_probs=True (TRL would load an unsplit "
         "copy of the model on every rank)"),
    ]
    for applies, what, fix in refused:
        if applies:
            raise UsageError(f"{what} is not supported by PipelineTrainerMixin with DPOTrainer; {fix}")
    pairs = args.per_device_train_batch_size
    m = rows(2 * pairs)
    if pairs % m:
        raise UsageError(
            f"per_device_train_batch_size={pairs} pairs (2 x {pairs} rows) do not split into {m} microbatches of "
            f"whole pairs; pass a multiple of {m} pairs or load the model with another n_microbatches"
        )


# ----------------------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------------------
class DPOStep:
    """What a pipelined Trainer runs for ``DPOTrainer``: the training step, the evaluation loss, the reference."""

    def __init__(self, args, pipelined) -> None:
        self.settings = DPOSettings.of(args)
        self.pipelined = pipelined
        self.recorder = RowRecorder()
        self.loss = dpo_loss(self.settings, self.recorder)

    @staticmethod
    def labels(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """TRL's labels: the input ids, -100 outside the completion."""
        return inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)

    def reference_logps(self, trainer, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's sequence log-probabilities, (2B,) in TRL's order: the batch's precomputed columns, else a
        forward-only pipelined pass (collective: every rank passes the same batch)."""
        if "ref_chosen_logps" in inputs:
            return torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).float()
        ref_model = trainer.ref_model
        context = contextlib.nullcontext()
        if ref_model is None:  # the policy itself: a PEFT model's adapter off (or TRL's frozen "ref" adapter)
            ref_model = trainer.model
            if trainer.adapter_model is not None:
                from trl.trainer.utils import use_adapter

                context = use_adapter(ref_model, adapter_name="ref" if "ref" in ref_model.peft_config else None)
        with torch.no_grad(), context:
            logits = ref_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            return row_stats(logits, self.labels(inputs))[:, 0]

    def ordered(self, inputs: dict[str, torch.Tensor], ref: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch for ``train_step``: rows reordered so that each microbatch of each replica holds whole pairs
        (its chosen rows, then theirs rejected), with the loss's targets."""
        rows = inputs["input_ids"].shape[0]
        pairs, dims = rows // 2, self.pipelined.dims
        groups = dims.dp_size * self.pipelined.microbatches_for(rows // dims.dp_size, training=True,
                                                                 seq=inputs["input_ids"].shape[1])
        size = pairs // groups
        order = torch.cat([torch.cat([torch.arange(g * size, (g + 1) * size),
                                      pairs + torch.arange(g * size, (g + 1) * size)]) for g in range(groups)])
        batch = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                 "labels": self.labels(inputs), "ref_logps": ref, "rows": torch.arange(rows)}
        return {k: v[order.to(v.device)] for k, v in batch.items()}

    def train(self, trainer, inputs: dict[str, Any], scale: float, autocast) -> torch.Tensor:
        """One training step: the reference, the pipelined step on whole pairs, TRL's metrics. Returns the loss."""
        ref = self.reference_logps(trainer, inputs)
        self.recorder.rows.clear()
        loss = self.pipelined.train_step(self.ordered(inputs, ref), loss_scale=scale, autocast=autocast,
                                         loss=self.loss)
        model = self.pipelined
        table = self.recorder.table(ref.shape[0], model.device)
        if model.dims.tp_rank != 0:  # its tensor-parallel peer's rows are the same
            table.zero_()
        if model.ctx.is_distributed:
            dist.all_reduce(table, group=model.ctx.group)
        self.log_metrics(trainer, "train", inputs, table, ref)
        return loss

    def eval_loss(self, trainer, policy: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The evaluation loss and logits (TRL's metrics logged) from the pipelined forward, which every rank holds."""
        ref = self.reference_logps(trainer, inputs)
        with torch.no_grad():
            logits = policy(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            stats = row_stats(logits, self.labels(inputs))
        n = stats.shape[0] // 2
        self.log_metrics(trainer, "eval", inputs, stats.double(), ref)
        lengths = inputs["completion_mask"].sum(1)
        return pair_loss(stats[:n, 0], stats[n:, 0], ref, lengths, self.settings).mean(), logits

    def log_metrics(self, trainer, mode: str, inputs, table: torch.Tensor, ref: torch.Tensor) -> None:
        """TRL's metrics of one batch into TRL's store (averaged and cleared by its ``log``)."""
        n = table.shape[0] // 2
        logps = table[:, 0].float()
        chosen = self.settings.beta * (logps[:n] - ref[:n].to(logps.device))
        rejected = self.settings.beta * (logps[n:] - ref[n:].to(logps.device))
        tokens = table[:, 4]
        store = getattr(trainer, TRL_METRICS)[mode]
        store["entropy"].append((table[:, 1].sum() / tokens.sum()).item() if tokens.sum() > 0 else 0.0)
        if mode == "train":
            setattr(trainer, TRL_TOKENS, getattr(trainer, TRL_TOKENS) + int(inputs["attention_mask"].sum()))
        store["num_tokens"] = [getattr(trainer, TRL_TOKENS)]
        for side, part in (("chosen", slice(0, n)), ("rejected", slice(n, None))):
            count = tokens[part].sum()
            store[f"logits/{side}"].append((table[part, 2].sum() / count).item() if count > 0 else 0.0)
        count = tokens[:n].sum()
        store["mean_token_accuracy"].append((table[:n, 3].sum() / count).item() if count > 0 else 0.0)
        store["rewards/chosen"].append(chosen.mean().item())
        store["rewards/rejected"].append(rejected.mean().item())
        store["rewards/accuracies"].append((chosen > rejected).float().mean().item())
        store["rewards/margins"].append((chosen - rejected).mean().item())
        store["logps/chosen"].append(logps[:n].mean().item())
        store["logps/rejected"].append(logps[n:].mean().item())

    def precompute(self, trainer, dataset, name: str, batch_size: int):
        """TRL's ``precompute_ref_log_probs`` columns, from the pipelined reference, the same on every rank.

        TRL's own pass shards the dataset over the processes, where every rank of a pipeline needs the same rows;
        this one reads it whole on every rank (accelerate's loader for one process), in order.
        """
        loader = single_process_loader(
            trainer.accelerator, DataLoader(dataset, batch_size=batch_size, collate_fn=trainer.data_collator)
        )
        chosen, rejected = [], []
        for batch in loader:
            ref = self.reference_logps(trainer, batch).cpu()
            chosen.append(ref[: ref.shape[0] // 2])
            rejected.append(ref[ref.shape[0] // 2:])
        dataset = dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
        return dataset.add_column("ref_rejected_logps", torch.cat(rejected).tolist())
