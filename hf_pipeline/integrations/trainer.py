"""``PipelineTrainer``: ``transformers.Trainer`` for a pipelined model, same constructor, same loop.

transformers' Trainer runs its own loop (epochs, gradient accumulation, LR schedule, logging,
evaluation, checkpoints, callbacks); this subclass changes only what differs for a model whose
stages live on several ranks:

* **Data.** Every rank gets the same global batch of ``per_device_train_batch_size x dp`` rows
  (``dp`` pipeline replicas, or the fsdp ranks of a model loaded with ``fsdp_size``), in the order
  transformers' Trainer gives on one process with that batch; each replica trains on its own rows of
  it inside ``model.train_step`` (:mod:`.trainer_data`). Under FSDP the Trainer's optimizer steps each rank's
  parameter shards, and checkpoints gather the state whole as for any other mesh.
* **The step.** ``training_step`` is ``model.train_step`` (forward and backward through the
  pipeline schedule); its gradients are scaled as transformers' Trainer scales its loss under
  gradient accumulation (see :meth:`PipelineTrainer.loss_scale`). Clipping is
  ``model.clip_grad_norm_``: the norm over every stage, not over this rank's parameters.
* **A loss of the Trainer's own** (its ``compute_loss``: TRL's GRPO, a subclass's; ``label_smoothing_factor``, a
  ``compute_loss_func``): the Trainer's own step, its ``compute_loss`` on the pipelined model's differentiable
  outputs (``training/differentiable.py``), with accelerate's state saying one process (:mod:`.one_process`).
* **No wrapping.** accelerate returns the model as it is (it syncs its own gradients; see
  ``compat.ACCELERATE_PREPARED_FLAG``), and the model is never moved: its stages are placed.
* **Evaluation.** The pipelined forward gives every rank the whole batch's outputs, so nothing is
  gathered across ranks.
* **Checkpoints.** Written by every rank (:mod:`.trainer_checkpoints`) and read back as data only;
  ``save_total_limit`` rotates away only the checkpoints the Trainer wrote (each holds its mark), never
  a folder of the user's in ``output_dir``. A PEFT
  model wrapping the pipelined one (``get_peft_model(model, LoraConfig(...))``) is checkpointed as
  transformers' Trainer checkpoints one: its adapter in PEFT's format plus the training state
  (:mod:`.trainer_adapter_checkpoints`).

Every rank runs the same loop on the same batches, so every rank's ``TrainerState`` (global step,
log history) is the same.

Example (``torchrun --nproc-per-node 2 finetune.py``):
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=2)
    >>> args = TrainingArguments("out", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    >>> PipelineTrainer(model=model, args=args, train_dataset=ds, data_collator=collator).train()
"""

from __future__ import annotations

import contextlib
import inspect
import os
from functools import partial
from typing import Any

import torch
from accelerate.utils import recursively_apply, synchronize_rng_states
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainingArguments
from transformers.modeling_outputs import CausalLMOutput
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker
from transformers.utils import can_return_loss, find_labels

from ..checkpointing.directory import TRAINER_STATE_NAME
from ..checkpointing.training_state import load_training_state
from ..distributed.agreement import collective_errors
from ..errors import UsageError
from ..families.losses import get_loss
from ..training.differentiable import padded_rows
from ..training.fused_head import take_over
from .one_process import one_process, one_process_batches
from .padding_free import is_padding_free, unflatten
from .trainer_adapter_checkpoints import load_adapter_training_state, reload_adapter, save_adapter_checkpoint
from .trainer_checkpoints import (
    keep_only_checkpoint,
    mark_checkpoint,
    reload_weights,
    restore_rng,
    rotate_checkpoints,
    written_by_trainer,
)
from .trainer_data import count_items, single_process_loader, uncached_datasets
from .trainer_dpo import DPOStep, check_dpo, is_dpo
from .trainer_refusals import (
    building_pipeline_trainer,
    check_arguments,
    check_model,
    check_output_dir,
    check_own_step,
    own_loss_class,
    own_step_for_loss_options,
    pipelined_model_of,
)

__all__ = ["PipelineTrainer", "PipelineTrainerMixin"]


def _names_columns(trainer_class: type) -> bool:
    """Whether a class between the mixin and transformers' ``Trainer`` names its dataset's columns itself."""
    from transformers import Trainer

    mro = trainer_class.__mro__
    return any("_set_signature_columns_if_needed" in vars(c) for c in mro[mro.index(PipelineTrainerMixin) + 1:]
               if c is not Trainer and issubclass(c, Trainer))


def _accepts_loss_kwargs(module: torch.nn.Module) -> bool:
    # transformers' own rule (Trainer.__init__), applied to the transformers class the stages come from.
    if hasattr(module, "accepts_loss_kwargs"):
        return bool(module.accepts_loss_kwargs)
    params = inspect.signature(module.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


class PipelineTrainerMixin:
    """What makes a ``transformers.Trainer`` (or a subclass of it) train a pipelined model.

    Put it first among the bases: ``class PipelineSFTTrainer(PipelineTrainerMixin, trl.SFTTrainer)``.
    Its methods replace the Trainer's for data, the step, evaluation's gathering and checkpoints;
    everything else (the loop, logging, callbacks, the subclass's own dataset preparation) stays.
    On trl's ``DPOTrainer`` the step computes DPO's loss through the pipeline (:mod:`.trainer_dpo`).
    """

    def __init__(self, model: nn.Module=None, args: TrainingArguments | None = None, *more: Any, **kwargs: Any):
        # The next class's constructor (transformers' Trainer, or a subclass's): its own argument order.
        names = [n for n in inspect.signature(super().__init__).parameters if n not in ("model", "args")]
        given = {**dict(zip(names, more)), **kwargs}
        check_model(model, given.get("model_init"))
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        self.pipelined = pipelined_model_of(model)
        # A PEFT model wrapping the pipelined one: its checkpoints are the adapter and the training state.
        self.adapter_model = model if model is not self.pipelined else None
        # TRL's peft_config= wraps the model in its own constructor: a PEFT model from then on.
        adapter, dpo = self.adapter_model is not None or given.get("peft_config") is not None, is_dpo(type(self))
        extra = {"compute_loss_func": given.get("compute_loss_func"), "adapter": adapter, "dpo": dpo}
        # Agreed: a refusal, a bad output_dir or a failure of the Trainer's own set-up (rank 0 creates output_dir)
        # on one rank raises on every rank, instead of one rank raising while the others train on.
        ctx, describe = self.pipelined.ctx, self.pipelined.rank_label
        with collective_errors(ctx, "checking PipelineTrainer's arguments", describe=describe):
            # A loss of the class's own (its compute_loss), or transformers' compute_loss_func or label smoothing over
            # the outputs: the Trainer's own step, through the differentiable pipelined forward.
            own = own_loss_class(type(self), PipelineTrainerMixin)
            self.own_loss = own is not None or own_step_for_loss_options(type(self), args, extra["compute_loss_func"])
            check_arguments(args, self.pipelined, own_loss=own is not None, own_step=self.own_loss, **extra)
            check_output_dir(args.output_dir)
            one_process_batches(args, self.pipelined.dims.dp_size)
            if own is not None:
                check_own_step(type(self), args, given.get("ref_model"), adapter, self.pipelined.dims.tp_size)
            if dpo:
                check_dpo(args, given, adapter, rows=partial(self.pipelined.microbatches_for, training=True))
        # TRL's DPOTrainer's loss, reference and metrics through the pipeline (its constructor may already need them).
        self.dpo = DPOStep(args, self.pipelined) if dpo else None
        self.pipeline_loss = get_loss(self.pipelined.resolved.head.loss, class_name=self.pipelined.resolved.class_name)
        with collective_errors(ctx, "setting up the Trainer", describe=describe), building_pipeline_trainer():
            super().__init__(model=model, args=args, **given)
        self._find_adapter()
        # Every rank holds the whole batch and counts its items itself (_get_num_items_in_batch): nothing to average
        # across devices, which transformers' compute_loss would do by multiplying by accelerate's process count.
        self.args.average_tokens_across_devices = False
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # from an accelerate launch config
            raise UsageError(
                "PipelineTrainer cannot run under DeepSpeed or FSDP (set by the accelerate launch config): the "
                "pipeline places its stages and syncs its gradients itself; launch without them"
            )
        # The ranks are one process to the Trainer: one random stream (TRL's GRPO re-seeds per process, so that
        # processes sample differently; every rank here holds the same rows, as one process would).
        device = self.pipelined.device.type
        synchronize_rng_states(["torch"] + ([device] if device != "cpu" else []))
        self._take_over_fused_head()
        # What transformers reads from the model's class, read from the class the stages come from.
        skeleton = type(self.pipelined.skeleton)
        self.model_accepts_loss_kwargs = _accepts_loss_kwargs(self.pipelined.skeleton)
        if self.args.label_names is None:
            self.label_names = find_labels(skeleton)
        self.can_return_loss = can_return_loss(skeleton)

    # ----------------------------------------------------------------------------------------
    # Data: one global batch on every rank
    # ----------------------------------------------------------------------------------------
    def _get_dataloader(
        self, dataset, description: str, batch_size: int, sampler_fn=None, is_training: bool = False,
        dataloader_key: str | None = None,
    ) -> DataLoader:
        collator = self.data_collator
        if hasattr(dataset, "column_names") and not isinstance(dataset, IterableDataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        params: dict[str, Any] = {
            "batch_size": batch_size * self.pipelined.dims.dp_size,  # every replica's rows
            "collate_fn": collator,
            "num_workers": self.args.dataloader_num_workers,
            "pin_memory": self.args.dataloader_pin_memory,
            "persistent_workers": self.args.dataloader_persistent_workers,
            "multiprocessing_context": self.args.dataloader_multiprocessing_context,
            "prefetch_factor": self.args.dataloader_prefetch_factor,
            "in_order": self.args.dataloader_in_order,
        }
        if not isinstance(dataset, IterableDataset):
            sampler = sampler_fn(dataset) if sampler_fn is not None else None
            if sampler is not None:
                params["sampler"] = sampler
            params["drop_last"] = self.args.dataloader_drop_last
            if is_training:  # rank 0's worker seeds on every rank: the same rows everywhere
                params["worker_init_fn"] = partial(seed_worker, num_workers=self.args.dataloader_num_workers, rank=0)
        return single_process_loader(self.accelerator, DataLoader(dataset, **params))

    def _set_signature_columns_if_needed(self) -> None:
        # DPOTrainer's own (prompt / chosen / rejected ids, reference columns), and those of a Trainer class that names
        # the columns its collator reads (TRL's GRPO prompts, reward trainer's chosen / rejected ids).
        if self.dpo is not None or _names_columns(type(self)):
            return super()._set_signature_columns_if_needed()
        # The columns the transformers model's forward takes (the pipelined forward takes **kwargs).
        if self._signature_columns is None:
            columns = list(inspect.signature(self.pipelined.skeleton.forward).parameters)
            self._signature_columns = columns + list({"label", "label_ids", *self.label_names})

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Rows per optimizer step: the replica batch x replicas x accumulation steps."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.pipelined.dims.dp_size

    def _track_num_input_tokens(self, inputs) -> None:
        # transformers sums every process's count; every rank here holds the whole batch: count it once.
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        added = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + added // self.pipelined.ctx.world_size

    def store_flos(self) -> None:
        # transformers sums every process's count of its own rows; every rank here counted the whole batch (and the
        # whole model's parameters): the count of one, as one process counts it.
        self.state.total_flos += self.current_flos
        self.current_flos = 0

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        if self.own_loss:  # transformers' count of the whole batch (average_tokens_across_devices is off)
            return super()._get_num_items_in_batch(batch_samples, device)
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return None
        return count_items(self.pipeline_loss, batch_samples, self.pipelined.config, device)

    # ----------------------------------------------------------------------------------------
    # The step
    # ----------------------------------------------------------------------------------------
    def loss_scale(self, inputs: dict[str, Any], num_items_in_batch) -> float:
        """The factor on this batch's mean loss that makes its gradient what transformers' Trainer computes.

        transformers passes ``num_items_in_batch`` (the real items of all batches of the optimizer
        step) to a model whose forward takes loss kwargs, and then does not divide by the
        accumulation steps. Token-level losses use it (summed loss / items of the step: the batch's
        mean x its share of the items); a head whose loss is a plain mean ignores it, so its batch
        means add up. Without ``num_items_in_batch`` the mean is divided by the accumulation steps.
        """
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if not scaled:
            return 1.0 / self.current_gradient_accumulation_steps
        if not self.pipeline_loss.token_level or num_items_in_batch is None:
            return 1.0
        mine = count_items(self.pipeline_loss, [inputs], self.pipelined.config, torch.device("cpu"))
        return float(mine) / max(float(num_items_in_batch), 1.0)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """``model.train_step`` on the global batch; returns the loss as transformers' Trainer logs it.

        A Trainer with a loss of its own runs its own step: its ``compute_loss`` on the pipelined model's
        differentiable outputs, whose backward runs the pipeline's step (``training/differentiable.py``)."""
        if self.own_loss:
            with one_process(self.accelerator):
                return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        inputs = self._padding_free_rows(self._prepare_inputs(inputs), training=True)
        scale = self.loss_scale(inputs, num_items_in_batch)
        if scale == 0:  # no real item in this batch: no gradient, as transformers' summed loss of nothing
            return torch.zeros((), device=self.args.device)
        autocast = torch.bfloat16 if self.args.bf16 else None
        if self.dpo is not None:
            loss = self.dpo.train(self, inputs, scale, autocast)
        else:
            loss = self.pipelined.train_step(inputs, loss_scale=scale, autocast=autocast)
        return (loss * scale).detach().to(self.args.device)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch=None):
        """The pipelined forward's loss (evaluation; training runs :meth:`training_step`), or the class's own."""
        if self.own_loss:
            with one_process(self.accelerator):
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
        if self.dpo is not None:
            loss, logits = self.dpo.eval_loss(self, model, inputs)
            return (loss, CausalLMOutput(loss=loss, logits=logits)) if return_outputs else loss
        outputs = model(**self._padding_free_rows(inputs, training=False))
        loss = outputs["loss"]
        return (loss, outputs) if return_outputs else loss

    def _padding_free_rows(self, inputs: dict[str, Any], training: bool) -> dict[str, Any]:
        """A padding-free batch (TRL's packing) as rows the pipeline splits (:mod:`.padding_free`); else as given."""
        if not is_padding_free(inputs):
            return inputs
        pad = getattr(self.pipelined.config, "pad_token_id", None)
        rows = (lambda n, longest: padded_rows(self.pipelined, n, longest)) if training else (lambda n, longest: n)
        return unflatten(inputs, pad_token_id=pad if isinstance(pad, int) else 0, rows_for=rows)

    # DPOTrainer's reference log-probabilities (precompute_ref_log_probs): the pipelined reference on every rank.
    def compute_ref_log_probs(self, model: nn.Module, inputs: dict[str, Any]):
        if self.dpo is None:
            return super().compute_ref_log_probs(model, inputs)
        return self.dpo.reference_logps(self, inputs).chunk(2)

    def _take_over_fused_head(self) -> None:
        # TRL's trainers patch the model's forward with their fused LM head: the pipelined forward computes it.
        head = take_over(self.pipelined, getattr(self, "temperature", 1.0))
        self.pipelined.fused_head = head or self.pipelined.fused_head

    def _find_adapter(self) -> None:
        # A PEFT model TRL made from peft_config= in its constructor (or the one given) is the model the Trainer trains.
        if getattr(self, "model", None) is not None and self.model is not self.pipelined:
            self.adapter_model = self.model

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        self._find_adapter()  # inside TRL's constructor, after it applied peft_config=: the reference is adapter-off
        if self.dpo is not None:
            return self.dpo.precompute(self, dataset, name, batch_size)
        if not self.own_loss:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        # TRL's KTO precomputes inside its constructor, its fused head already patched in: the pipelined forward's
        # from now on. Every rank computes the whole dataset's log-probabilities as one process, into its own file.
        self._take_over_fused_head()
        with one_process(self.accelerator), uncached_datasets():
            return super()._precompute_ref_logps(dataset, name, batch_size)

    def _clip_grad_norm(self, model: nn.Module):
        return self.pipelined.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        return self.pipelined.clip_grad_norm_(float("inf")) if grad_norm is None else grad_norm

    def _move_model_to_device(self, model: nn.Module, device) -> None:
        """Nothing to move: the pipeline placed each stage on its rank's device when it loaded."""

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        """The Trainer's own; a Trainer with a loss of its own runs it as one process (TRL's GRPO generates and
        scores its evaluation completions there)."""
        with one_process(self.accelerator) if self.own_loss else contextlib.nullcontext():
            return super().prediction_step(model, inputs, *args, **kwargs)

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """transformers' loop, gathering nothing: every rank holds the whole batch's outputs.

        The loop weighs each batch's loss by ``args.eval_batch_size`` rows; a batch here holds every
        replica's rows, so that is the replica batch x replicas while the loop runs.
        """
        if not self.pipelined.gather_output:  # the same on every rank: all raise before any forward
            raise UsageError(
                "evaluate() / predict() read the model's outputs on every rank, but the model was loaded with "
                "gather_output=False; load it with gather_output=True (the default)"
            )
        self.gather_function = self._gather_nothing
        per_replica = self.args.per_device_eval_batch_size
        self.args.per_device_eval_batch_size = per_replica * self.pipelined.dims.dp_size
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.args.per_device_eval_batch_size = per_replica

    def _gather_nothing(self, data: Any, **kwargs: Any) -> Any:
        """``accelerator.gather_for_metrics`` without the gather: every rank holds the whole batch's outputs.

        Like it, the values of the last batch are cut to the rows the dataset has left (the loop
        repeats each batch's loss ``eval_batch_size`` times, also for a shorter last batch).
        """
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return recursively_apply(lambda t: t[: state.remainder], data)
        return data

    # ----------------------------------------------------------------------------------------
    # Checkpoints: written by every rank, read back as data
    # ----------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model as a transformers checkpoint (a PEFT model: its adapter, in PEFT's format). Collective:
        every rank calls it."""
        output_dir = output_dir or self.args.output_dir
        if self.adapter_model is not None:
            save_adapter_checkpoint(self.adapter_model, self.pipelined, output_dir, tokenizer=self.processing_class)
            return
        self.pipelined.save_pretrained(output_dir, tokenizer=self.processing_class)

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        # A folder of that name the Trainer did not write (the user's) gets no mark: rotation never removes it.
        foreign = os.path.exists(output_dir) and not written_by_trainer(output_dir)
        with_state = not self.args.save_only_model
        optimizer, scheduler = (self.optimizer, self.lr_scheduler) if with_state else (None, None)
        if self.adapter_model is not None:
            save_adapter_checkpoint(
                self.adapter_model, self.pipelined, output_dir, optimizer=optimizer, scheduler=scheduler,
                tokenizer=self.processing_class,
            )
            self.pipelined.ctx.barrier()  # every rank's files are written before trainer_state.json
        else:
            self.pipelined.save_pretrained(
                output_dir, optimizer=optimizer, scheduler=scheduler, step=self.state.global_step,
                tokenizer=self.processing_class,
            )
        best = self.state.best_global_step
        if best and os.path.exists(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")):
            self.state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
        self._store_callback_states()  # on every rank: every rank's TrainerState stays the same
        if self.args.should_save:
            # transformers' TrainerState in its own file name, replacing the package's (same step).
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
            if not foreign:
                mark_checkpoint(output_dir)  # last: the checkpoint is complete, and the Trainer's
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
        self.pipelined.ctx.barrier()  # the checkpoint is complete (and old ones gone) on every rank's return

    def _finalize_training(self, trial, num_train_samples, start_time):
        # transformers removes every checkpoint-<number> folder but the best here when save_total_limit=1, the
        # user's own too: the Trainer's checkpoints are removed instead, and transformers' removal is skipped.
        limit, best = self.args.save_total_limit, self.state.best_model_checkpoint
        if limit != 1 or best is None:
            return super()._finalize_training(trial, num_train_samples, start_time)
        if self.args.should_save:
            keep_only_checkpoint(self._get_output_dir(trial), best)
        self.args.save_total_limit = None
        try:
            return super()._finalize_training(trial, num_train_samples, start_time)
        finally:
            self.args.save_total_limit = limit

    def _store_callback_states(self) -> None:
        # As transformers' _save_checkpoint: the stateful callbacks' state goes into TrainerState.
        from transformers.trainer_callback import ExportableState

        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, state = type(cb).__name__, cb.state()
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(state)
            else:
                self.state.stateful_callbacks[name] = state

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module=None) -> None:
        self._reload_model(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        self._reload_model(self.state.best_model_checkpoint)

    def _reload_model(self, directory: str) -> None:
        if self.adapter_model is not None:
            reload_adapter(self.adapter_model, self.pipelined, directory)
        else:
            reload_weights(self.pipelined, directory)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = {"optimizer": self.optimizer, "scheduler": self.lr_scheduler}
        if self.adapter_model is not None:
            load_adapter_training_state(self.pipelined, checkpoint, **state)
        else:
            load_training_state(self.pipelined, checkpoint, rng=False, **state)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            restore_rng(self.pipelined, checkpoint)


class PipelineTrainer(PipelineTrainerMixin, Trainer):
    """``transformers.Trainer`` for a model loaded with ``from_pretrained(path, pipeline=True)``. Collective.

    Same constructor and methods as ``transformers.Trainer``; every rank of the job builds it with
    the same arguments and calls the same methods (``train``, ``evaluate``, ``predict``,
    ``save_model``). ``per_device_train_batch_size`` is the batch of one pipeline replica and must
    divide into the model's ``n_microbatches``.

    Raises:
        UsageError: at construction, on every rank, for what the pipeline cannot do (``model_init``,
            an unpipelined model, DeepSpeed, FSDP, ``torch_compile``, fp16, an indivisible batch,
            ``compute_loss_func``, label smoothing, a subclass with a loss of its own; see
            :mod:`.trainer_refusals`).
    """
