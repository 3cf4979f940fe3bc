"""What ``PipelineTrainer`` refuses at construction, as a table: a check and the message naming the argument.

Every rank builds the Trainer with the same arguments, and the Trainer agrees on these checks (and on its
own set-up, which creates ``output_dir`` on rank 0) through ``collective_errors``: a refusal or a failure on
one rank is an error on every rank. Each refusal says what to change.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..core import PipelineCore
from ..errors import CheckpointExistsError, PipelineError, UsageError
from .peft_host import is_pipelined_model
from .trainer_dpo import DPO_TRAINERS

__all__ = [
    "OWN_LOSS_TRAINERS", "OWN_STEP_TRAINERS", "Refusal", "REFUSALS", "building_pipeline_trainer", "check_arguments",
    "check_model", "check_own_step", "check_output_dir", "own_loss_class", "own_step_for_loss_options",
    "pipelined_model_of", "refuse_plain_trainer",
]

# Set while PipelineTrainerMixin runs the Trainer's own constructor (in this thread or task).
_BUILDING = contextvars.ContextVar("hf_pipeline_building_trainer", default=False)


@contextlib.contextmanager
def building_pipeline_trainer():
    """Around ``PipelineTrainerMixin``'s call of the Trainer constructor: the pipelined model may be given to it."""
    token = _BUILDING.set(True)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def refuse_plain_trainer(model_class: str) -> bool:
    """What a pipelined model answers ``transformers.Trainer.__init__`` asking whether transformers loaded it
    distributed (False: it is placed by the pipeline, not by a transformers ``DistributedConfig``), asked
    only while a Trainer is built. Outside ``PipelineTrainerMixin`` that is a Trainer (TRL's SFTTrainer or
    DPOTrainer too) whose own step would run the pipelined model as one module: refused at construction.

    Raises:
        UsageError: naming PipelineTrainerMixin, on every rank (each builds its Trainer).
    """
    if not _BUILDING.get():
        raise UsageError(
            f"a pipelined {model_class} is trained by hf_pipeline.PipelineTrainer, or a Trainer subclass with "
            f"hf_pipeline.integrations.trainer.PipelineTrainerMixin first among its bases (e.g. class "
            f"PipelineSFTTrainer(PipelineTrainerMixin, trl.SFTTrainer)); this Trainer's own step would run it as one "
            f"module"
        )
    return False


def pipelined_model_of(model: nn.Module):
    """The :class:`~hf_pipeline.model.PipelinedModel` a Trainer model is or wraps (a PEFT model), else None."""
    for candidate in (model, getattr(getattr(model, "base_model", None), "model", None)):
        if is_pipelined_model(candidate):
            return candidate
    return None


def check_model(model: nn.Module, model_init: Any) -> None:
    """Refuse ``model_init`` and a model that is not pipelined.

    Raises:
        UsageError: naming the argument.
    """
    if model_init is not None:
        raise UsageError(
            "PipelineTrainer does not take model_init: a pipelined model is loaded collectively by every rank "
            "(from_pretrained(path, pipeline=True)); load it once and pass it as model="
        )
    if pipelined_model_of(model) is None:
        raise UsageError(
            f"PipelineTrainer trains a pipelined model (from_pretrained(path, pipeline=True), or a PEFT model "
            f"wrapping one), got model={type(model).__name__}; use transformers.Trainer for an unsplit model"
        )


# Trainer classes whose own compute_loss / training_step compute the model's own token loss, which the mixin's
# step computes inside the pipeline instead (what they add besides, such as SFTTrainer's logged entropy and
# token accuracy, is dropped): module-qualified names, each checked equal to its Trainer on one process
# (tests/integrations/test_trl.py).
OWN_LOSS_TRAINERS: frozenset[str] = frozenset({"trl.trainer.sft_trainer.SFTTrainer"})
# Where a Trainer subclass puts a loss of its own.
_LOSS_METHODS = ("compute_loss", "training_step")


# TRL's trainers with a loss of their own that train through the mixin's own-loss step, each checked equal to itself
# on one process (tests/integrations/test_trl_grpo.py, _rloo, _kto, _reward): module-qualified names.
_ONLINE = ("trl.trainer.grpo_trainer.GRPOTrainer", "trl.trainer.rloo_trainer.RLOOTrainer")  # generate, then train
_KTO = "trl.trainer.kto_trainer.KTOTrainer"
OWN_STEP_TRAINERS: frozenset[str] = frozenset({*_ONLINE, _KTO, "trl.trainer.reward_trainer.RewardTrainer"})


def own_loss_class(trainer_class: type, mixin: type) -> type | None:
    """The class that gives ``trainer_class`` a loss of its own, if one does: one of its classes (below
    transformers' ``Trainer``, other than ``mixin`` and :data:`OWN_LOSS_TRAINERS`) defines ``compute_loss`` or
    ``training_step``.

    The mixin trains such a Trainer through its own step: its ``compute_loss`` calls the pipelined model, whose
    outputs are differentiable (``training/differentiable.py``), and its backward runs the pipeline's step, with
    accelerate's state saying one process (``one_process.py``). TRL's trainers other than those of
    :data:`OWN_STEP_TRAINERS` (distillation, the experimental ones...) are refused: they have not been checked against
    themselves on one process.

    Raises:
        UsageError: a TRL trainer other than SFT, DPO, GRPO, RLOO, KTO and reward, naming it.
    """
    from transformers import Trainer  # here: importing transformers' Trainer imports peft, which loading must not

    for cls in trainer_class.__mro__:
        if cls is Trainer:
            return None
        name = f"{cls.__module__}.{cls.__qualname__}"
        if cls is mixin or name in OWN_LOSS_TRAINERS | DPO_TRAINERS:
            continue
        if not any(method in vars(cls) for method in _LOSS_METHODS):
            continue
        if cls.__module__.split(".")[0] == "trl" and name not in OWN_STEP_TRAINERS:
            raise UsageError(
                f"{trainer_class.__name__} cannot train a pipelined model: {cls.__name__} is one of TRL's trainers "
                f"not yet checked through the pipeline (its loss over the model's outputs, the batches it sizes by "
                f"accelerate's process count); train with PipelineTrainerMixin on trl's SFTTrainer, DPOTrainer, "
                f"GRPOTrainer, RLOOTrainer, KTOTrainer or RewardTrainer, or on a Trainer whose compute_loss calls "
                f"the model"
            )
        return cls
    return None


def own_step_for_loss_options(trainer_class: type, args: Any, compute_loss_func: Any) -> bool:
    """Whether transformers' own loss options (``label_smoothing_factor``, ``compute_loss_func``) make a Trainer
    whose loss is the model's run the Trainer's own step: transformers' ``Trainer`` and its subclasses other than
    TRL's SFT and DPO trainers (whose step the mixin computes itself: such options there stay refused)."""
    if args.label_smoothing_factor == 0 and compute_loss_func is None:
        return False
    names = {f"{c.__module__}.{c.__qualname__}" for c in trainer_class.__mro__}
    return not names & (OWN_LOSS_TRAINERS | DPO_TRAINERS)


def check_own_step(trainer_class: type, args: Any, ref_model: Any, adapter: bool, tp_size: int) -> None:
    """Refuse what TRL's trainers of :data:`OWN_STEP_TRAINERS` that ``trainer_class`` derives from cannot do with a
    pipelined model, naming the option.

    Raises:
        UsageError: GRPO and RLOO: ``use_vllm`` (vLLM generates from its own unsplit copy of the weights),
            transformers' continuous batching (``generate_batch``: generate runs the pipeline), or ``beta != 0``
            when fully fine-tuning (the trainer would load an unsplit reference copy of the model on every rank).
            KTO: a ``ref_model``, full fine-tuning without ``precompute_ref_log_probs`` (an unsplit reference), and
            ``precompute_ref_log_probs`` under tensor parallelism (TRL hashes the model's tensors with numpy).
    """
    names = {f"{c.__module__}.{c.__qualname__}": c.__name__ for c in trainer_class.__mro__}
    online = [names[n] for n in _ONLINE if n in names]
    if _KTO in names:
        _check_kto(args, ref_model, adapter, tp_size)
    if not online:
        return
    if getattr(args, "use_vllm", False):
        raise UsageError("use_vllm=True is not supported with a pipelined model: vLLM generates from an unsplit "
                         "copy of the weights it syncs from the model; pass use_vllm=False (generate runs the "
                         "pipeline)")
    if getattr(args, "use_transformers_continuous_batching", False):
        raise UsageError("use_transformers_continuous_batching=True is not supported with a pipelined model (its "
                         "generate_batch runs one process's model); pass False: generate runs the pipeline")
    if getattr(args, "beta", 0.0) != 0.0 and not adapter:
        raise UsageError(
            f"beta={args.beta} with full fine-tuning is not supported with a pipelined model: {online[0]} would load "
            f"an unsplit reference copy of the model on every rank; pass beta=0.0, or train a PEFT adapter "
            f"(get_peft_model first: the reference is the model with its adapter disabled)"
        )


def _check_kto(args: Any, ref_model: Any, adapter: bool, tp_size: int) -> None:
    if ref_model is not None:
        raise UsageError(
            f"ref_model={type(ref_model).__name__} is not supported by PipelineTrainerMixin with KTOTrainer; pass "
            f"ref_model=None with precompute_ref_log_probs=True (the model's own log-probabilities before training) "
            f"or with a PEFT adapter (the reference is the model with its adapter disabled)"
        )
    precompute = getattr(args, "precompute_ref_log_probs", False)
    if not adapter and not precompute:
        raise UsageError(
            "ref_model=None with full fine-tuning is not supported by PipelineTrainerMixin with KTOTrainer unless "
            "precompute_ref_log_probs=True: KTOTrainer would load an unsplit reference copy of the model on every "
            "rank; pass precompute_ref_log_probs=True, or train a PEFT adapter (get_peft_model first)"
        )
    if precompute and tp_size > 1:
        raise UsageError(
            f"precompute_ref_log_probs=True is not supported by PipelineTrainerMixin with KTOTrainer on a model "
            f"loaded with tp_size={tp_size}: KTOTrainer fingerprints the model's tensors with numpy, which cannot "
            f"read tensor-parallel shards (DTensors); train a PEFT adapter (the reference is the model with its "
            f"adapter disabled), or load the model with tp_size=1"
        )


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """One argument combination the pipeline cannot honour."""

    applies: Callable[[Any, Any, dict[str, Any]], bool]  # (args, pipelined model, constructor extras) -> refused
    message: Callable[[Any, Any], str]  # (args, pipelined model) -> what to change


def _misfits(rows: int, model: PipelineCore) -> bool:
    """Whether a training step of ``rows`` rows cannot be split into the microbatches the model runs (its
    ``n_microbatches``, or, where the default chose the count, the most up to it that split the rows)."""
    try:
        return rows % model.microbatches_for(rows, training=True) != 0
    except PipelineError:
        return True


def _batch_message(args, model: PipelineCore) -> str:
    return (
        f"per_device_train_batch_size={args.per_device_train_batch_size} (the batch of one pipeline replica) does "
        f"not divide into the model's n_microbatches={model.n_microbatches}; pass a multiple of {model.n_microbatches} "
        "or load the model with another n_microbatches"
    )


def _lacks_checkpointing(args, model: PipelineCore) -> bool:
    asked = getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)
    has = hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")
    return bool(asked) and not has


def _checkpointing_name(args) -> str:
    # transformers turns gradient_checkpointing=True into activation_checkpointing=True as well: name what was set.
    names = [n for n in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, n, False)]
    return " / ".join(names)


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        applies=lambda args, model, extra: bool(args.deepspeed),
        message=lambda args, model: (
            "deepspeed= is not supported by PipelineTrainer: the pipeline places its stages and syncs its "
            "gradients itself; remove the DeepSpeed config"
        ),
    ),
    Refusal(
        applies=lambda args, model, extra: bool(args.fsdp) or bool(args.fsdp_config and args.fsdp_config.get("fsdp")),
        message=lambda args, model: (
            f"fsdp={args.fsdp!r} is not supported by PipelineTrainer: the pipeline places its stages itself; "
            "remove fsdp= / fsdp_config="
        ),
    ),
    Refusal(
        applies=lambda args, model, extra: bool(args.torch_compile),
        message=lambda args, model: (
            "torch_compile=True is not supported by PipelineTrainer: the pipeline's stages run inside torch's "
            "pipeline schedule, which the Trainer cannot compile; pass torch_compile=False"
        ),
    ),
    Refusal(
        applies=lambda args, model, extra: bool(args.fp16),
        message=lambda args, model: (
            "fp16=True is not supported by PipelineTrainer (it needs a gradient scaler around the pipeline's "
            "backward); pass bf16=True (the step runs under bf16 autocast) or neither"
        ),
    ),
    Refusal(
        applies=lambda args, model, extra: getattr(args, "train_sampling_strategy", None) == "batch_rebalance",
        message=lambda args, model: (
            "train_sampling_strategy='batch_rebalance' is not supported by PipelineTrainer: it shards batches by "
            "global rank, where the ranks of one pipeline need the same rows; pick another train_sampling_strategy"
        ),
    ),
    Refusal(
        applies=lambda args, model, extra: _misfits(args.per_device_train_batch_size, model),
        message=_batch_message,
    ),
    Refusal(
        applies=lambda args, model, extra: not extra.get("own_step") and args.label_smoothing_factor != 0,
        message=lambda args, model: (
            f"label_smoothing_factor={args.label_smoothing_factor} is not supported by PipelineTrainerMixin with trl's "
            "SFTTrainer or DPOTrainer: their step trains on the model's own loss; pass label_smoothing_factor=0"
        ),
    ),
    Refusal(
        applies=lambda args, model, extra: not extra.get("own_step") and extra.get("compute_loss_func") is not None,
        message=lambda args, model: (
            "compute_loss_func= is not supported by PipelineTrainerMixin with trl's SFTTrainer or DPOTrainer: their "
            "step trains on the model's own loss (or DPO's); remove compute_loss_func"
        ),
    ),
    Refusal(
        # trl's SFTConfig: "dft" weighs each token's loss by its probability, which the model's own loss does not.
        applies=lambda args, model, extra: not (extra.get("dpo") or extra.get("own_loss"))
        and getattr(args, "loss_type", "nll") != "nll",
        message=lambda args, model: (
            f"loss_type={args.loss_type!r} is not supported by PipelineTrainer: the pipeline trains on the model's own "
            "loss; pass loss_type='nll'"
        ),
    ),
    Refusal(
        applies=lambda args, model, extra: _lacks_checkpointing(args, model),
        message=lambda args, model: (
            f"{_checkpointing_name(args)}=True needs {type(model).__name__}.activation_checkpointing_enable "
            f"(or gradient_checkpointing_enable), which this version of the model lacks; pass "
            f"{_checkpointing_name(args)}=False (trl's SFTConfig sets gradient_checkpointing=True by default)"
        ),
    ),
)


def check_arguments(args: Any, model: nn.Module, **extra: Any) -> None:
    """Raise the first refusal that applies to these ``TrainingArguments`` and this pipelined model.

    Args:
        args: the ``TrainingArguments``.
        model: the :class:`~hf_pipeline.model.PipelinedModel` (unwrapped).
        extra: other constructor arguments some refusals look at (``compute_loss_func``; ``adapter``: the
            Trainer's model is a PEFT model wrapping the pipelined one).

    Raises:
        UsageError: naming the argument and what to pass instead.
    """
    for refusal in REFUSALS:
        if refusal.applies(args, model, extra):
            raise UsageError(refusal.message(args, model))


def check_output_dir(output_dir: str | os.PathLike) -> None:
    """Refuse an ``output_dir`` that is not a directory and cannot become one (itself or its nearest
    existing parent is a file), on this rank (the Trainer writes checkpoints there from every rank).

    Raises:
        CheckpointExistsError: (a ``FileExistsError``) naming the path and what is in the way.
    """
    path = os.path.abspath(os.fspath(output_dir))
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if os.path.exists(existing) and not os.path.isdir(existing):
        where = "is" if existing == path else f"lies under {existing!r}, which is"
        raise CheckpointExistsError(
            f"TrainingArguments(output_dir={os.fspath(output_dir)!r}) {where} a file, not a directory: the Trainer "
            "writes its checkpoints there; pass a directory (or move the file away)"
        )
