"""PipelinedModel: one model whose stages live on different ranks, called like a transformers model.

Every rank of a ``torchrun`` / ``accelerate launch`` job builds the same :class:`StagePlan` from the config,
materialises only its own stages (read shard by shard from safetensors) and joins the pipelined calls:
``model(**inputs)`` is collective, every rank passes the same inputs, and every rank gets the full output
(``gather_output=False`` keeps it on the last stage only).

Example (``torchrun --nproc_per_node 2 script.py``):
    >>> from hf_pipeline import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=4)
    >>> print(model.plan)
    >>> out = model(input_ids=ids, attention_mask=mask)
    >>> out.logits.shape
    torch.Size([8, 16, 32000])
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .compat import ACCELERATE_PREPARED_FLAG
from .distributed.agreement import check_same_on_all_ranks
from .distributed.context import RankContext
from .distributed.dims import ParallelDims
from .distributed.faults import raise_if_broken, spread_failures
from .distributed.groups import renew_groups
from .errors import InputError, InputTypeError, TraceError
from .families.router_loss import RouterAux, router_aux_of
from .integrations.peft_host import AdapterHost
from .integrations.trainer_refusals import refuse_plain_trainer
from .load_options import LoadOptions
from .loading.fsdp import resharded_after
from .loading.loader import LoadedPipeline, StageMaker, load_pipeline
from .loading.weights import LoadReport
from .planning.auto_choice import call_microbatches
from .planning.layout import ParamLayout, count_parameters, param_layout
from .planning.options import PipelineOptions
from .planning.plan import StagePlan
from .planning.resolve import ResolvedRecipe
from .planning.schedules import ScheduleSpec
from .recompute.layers import ActivationCheckpointingMixin
from .runtime import checks as validate
from .runtime.cache import PipelineRuntime, pad_batch, run_local_stages, signature
from .training.differentiable import differentiable_outputs
from .training.inference_loss import CallTargets, forward_result
from .training.router_aux import forward_aux_loss

if TYPE_CHECKING:  # imported when training starts (training.step is not needed to load or run a model)
    from .training.step import TrainStepState

__all__ = ["PipelinedModel", "TracedPipelinedModel", "load_pipelined"]


class PipelinedModel(ActivationCheckpointingMixin, AdapterHost, nn.Module):
    """A transformers model split into pipeline stages; this rank holds ``self.stages``.

    Attributes:
        plan: the :class:`StagePlan` (same on every rank).
        stages: this rank's :class:`StageModule` s, in stage order (checkpoint names inside).
        ctx: the :class:`RankContext`.
        config: the transformers config.
        load_report: what this rank read from the checkpoint.
        name_or_path: the path or hub id it was loaded from, as transformers'.

    Of what code written for a ``PreTrainedModel`` uses, it has ``config``, ``generation_config``,
    ``can_generate()``, ``num_parameters()``, ``get_input_embeddings()`` / ``get_output_embeddings()``
    (on the rank whose stage holds them, None elsewhere), ``device``, ``dtype``, ``name_or_path``,
    ``save_pretrained``, ``generate``, ``add_model_tags``, ``tie_weights()`` (the ties are made at load),
    ``train()`` / ``eval()``, ``activation_checkpointing_enable`` / ``_disable`` (and the
    ``gradient_checkpointing_*`` aliases, ``is_activation_checkpointing``). Absent, since each would have
    to change the whole model from one rank: ``resize_token_embeddings``, ``set_input_embeddings`` /
    ``set_output_embeddings``, ``push_to_hub``.
    ``to()`` moves only this rank's stages: load with ``device=`` / ``dtype=`` instead.

    The rooms below it (generation, continuous batching, training, recompute, checkpointing, memory
    planning, the integrations, the tools, serving) cannot import this class: they read it through
    :class:`hf_pipeline.core.PipelineCore`, the typed contract it implements, and nothing else.
    """

    def __init__(self, built: LoadedPipeline, *, gather_output: bool = True):
        super().__init__()
        maker = built.stage_maker
        self.config = maker.config
        self.options: PipelineOptions = built.options
        self.plan: StagePlan = maker.plan
        self.resolved: ResolvedRecipe = maker.resolved
        self.stages = nn.ModuleList(built.stages)
        # What the front end built (a dataclass, so nn.Module keeps it as a plain attribute). The meta-device model
        # in it is reached through the ``skeleton`` property, never assigned here: assigning an nn.Module would
        # register it as a submodule, and its meta parameters would join parameters(), state_dict() and to().
        self.stage_maker: StageMaker = maker
        self.ctx: RankContext = built.ctx
        self.dims: ParallelDims = built.dims
        self.schedule: ScheduleSpec = built.options.schedule
        self.n_microbatches: int = built.options.n_microbatches
        self.gather_output: bool = gather_output
        self.fused_head = None  # TRL's fused LM head's settings, once a TRL trainer asked for it (training/fused_head)
        self.checkpoint_dir: pathlib.Path | None = built.checkpoint_dir
        self.load_report: LoadReport = built.load_report
        self.name_or_path: str = str(built.checkpoint_dir or "")
        self.runtime: PipelineRuntime = self._new_runtime()
        self.check_inputs: bool = True  # every call checks its inputs are the same on every rank
        # What schedule="auto" / n_microbatches="auto" considered and chose (None when neither was asked).
        self.auto_choice = built.auto_choice
        # The training step's own state (loss function, gradient-sync buckets and the process groups
        # they reduce over), made by training.step on the first train_step / clip_grad_norm_: the
        # groups are created collectively and only training needs them. Kept on the model so that it
        # lives and dies with the model it describes.
        self.train_step_state: TrainStepState | None = None

    @property
    def skeleton(self) -> nn.Module:
        """The whole model on the meta device: never run, kept for its config-only helpers (T5's
        ``_shift_right``) and the shapes of every parameter. Not a submodule of this model."""
        return self.stage_maker.skeleton

    @functools.cached_property
    def param_layout(self) -> ParamLayout:
        """Which stages (and ranks) hold every checkpoint key; see :func:`hf_pipeline.planning.layout.param_layout`."""
        return param_layout(self.skeleton, self.plan, self.resolved.tied)

    @functools.cached_property
    def router_aux(self) -> RouterAux | None:
        """The routers' load-balancing loss transformers adds (``config.output_router_logits``), or None."""
        return router_aux_of(self.skeleton, self.config)

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    # ------------------------------------------------ what code written for a PreTrainedModel reads

    @property
    def generation_config(self):
        """The default ``GenerationConfig``: the checkpoint's ``generation_config.json``, else derived from the
        config (absent, an AttributeError, for a model that cannot generate), as in transformers. ``generate``
        reads it, so changing it (or assigning a new one) changes what ``generate`` does by default."""
        from .generation.generate import generation_config

        return generation_config(self)

    @generation_config.setter
    def generation_config(self, value) -> None:
        from .generation.generate import generation_config

        generation_config(self)  # read the checkpoint's file first, so it can never replace the value set here
        self.skeleton.generation_config = value

    def can_generate(self) -> bool:
        """Whether ``generate`` works: a generation head (as transformers' ``can_generate``) built from a recipe."""
        return bool(self.skeleton.can_generate()) and self.stage_maker.generate_refusal is None

    @property
    def loss_type(self) -> str | None:
        """transformers' loss type of the class (``ForCausalLM``...): its Trainer counts a batch's items by it."""
        return getattr(self.skeleton, "loss_type", None)

    def _get_name(self) -> str:  # nn.Module's: transformers' Trainer tells a causal LM by it (label smoothing's shift)
        return type(self.skeleton).__name__

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Model card tags, kept as transformers' ``add_model_tags`` keeps them (trl's trainers add theirs)."""
        self.skeleton.add_model_tags(tags)

    def num_parameters(
        self, only_trainable: bool = False, exclude_embeddings: bool = False, *, local: bool = False
    ) -> int:
        """The whole model's parameters as transformers' ``num_parameters`` counts them (a tied tensor once); ``local``:
        this rank's stages only. Collective with ``only_trainable`` or PEFT adapters (:func:`count_parameters`)."""
        return count_parameters(self, only_trainable, exclude_embeddings, local=local)

    @property
    def is_distributed_loading_by_transformers(self) -> bool:
        """False: the pipeline placed the stages. ``transformers.Trainer.__init__`` reads it (only there);
        a Trainer built without ``PipelineTrainerMixin`` (plain, or TRL's) is refused by it, naming the mixin."""
        return refuse_plain_trainer(type(self.skeleton).__name__)

    def tie_weights(self, missing_keys: set[str] | None = None, recompute_mapping: bool = True) -> None:
        """Nothing to do: the ties were made at load, as transformers makes them in ``from_pretrained``.

        Code written for a ``PreTrainedModel`` calls it after loading (lm-eval's ``HFLM`` does). Tied names are one
        Parameter within a rank's stages; on stages of different ranks, one copy per stage read from the same key,
        whose gradients ``train_step`` sums so the copies step alike. Local, not collective; returns None.
        """
        return None

    def _local_module(self, module: nn.Module | None) -> nn.Module | None:
        # The stage's copy of one of the meta model's modules, on the rank that holds its parameters.
        if module is None:
            return None
        fqn = next((n for n, m in self.skeleton.named_modules() if m is module), None)
        for stage in self.stages:
            try:
                found = stage.get_submodule(fqn) if fqn else None
            except AttributeError:
                continue
            if found is not None and next(found.parameters(), None) is not None:
                return found
        return None

    def get_input_embeddings(self) -> nn.Module | None:
        """The input embedding module on the rank whose stage holds it (the first stage's); None on other ranks."""
        return self._local_module(self.skeleton.get_input_embeddings())

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head on the rank whose stage holds it (the last stage's); None on other ranks and without one."""
        return self._local_module(self.skeleton.get_output_embeddings())

    @property
    def is_last_stage_rank(self) -> bool:
        return self.dims.pp_rank == self.plan.last_rank

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's pipeline replica."""
        return self.dims.global_rank(pp_rank)

    def rank_label(self, rank: int) -> str:
        """What global rank ``rank`` runs, for messages: ``"stage 1"``, ``"stages 0, 2 of replica 1"``."""
        replica, pp_rank, _ = self.dims.place(rank)
        idx = [s.index for s in self.plan.stages_for_rank(pp_rank)]
        label = f"stage{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"
        return label + (f" of replica {replica}" if self.dims.dp_size > 1 else "")

    def spreading_failures(self, what: str):
        """A failure inside the call reaches every rank, naming the failing rank's stage (faults.py)."""
        groups = (self.dims.pp_group, self.dims.dp_group, self.dims.tp_group, *self.dims.expert_groups)
        # FSDP2 keeps its process groups itself, which fresh groups cannot replace (distributed/groups.py's Note).
        recover = None if self.dims.fsdp_size > 1 else self._renew_groups
        calling = spread_failures(self.ctx, what, groups=groups, describe=self.rank_label, recover=recover)
        return resharded_after(self.stages, calling) if self.dims.fsdp_size > 1 else calling  # see its Note

    def _renew_groups(self) -> None:
        # Fresh groups after a failure stopped these (faults.py); stages, schedules, sync groups: rebuilt on use.
        made = [group for group, _ in self.train_step_state.buckets] if self.train_step_state else []
        self.ctx, self.dims = renew_groups(self.ctx, self.dims, *made, stages=self.stages)
        self.runtime, self.train_step_state = self._new_runtime(), None

    def checkpoint_named_parameters(self):
        """(checkpoint key, parameter) for this rank's parameters; tied copies within a stage once."""
        seen: set[int] = set()
        for stage in self.stages:
            for name, p in stage.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The call's inputs on this rank's device, without Nones, as the family's glue prepares them (T5: decoder)."""
        inputs = {k: v for k, v in inputs.items() if v is not None}
        for k, v in list(inputs.items()):
            if isinstance(v, torch.Tensor):
                inputs[k] = v.to(self.device)
        return self._glue.prepare_inputs(self.skeleton, inputs)

    @property
    def _glue(self):
        return self.stages[0].glue

    @staticmethod
    def batch_size(inputs: dict[str, Any]) -> int:
        """Rows of a call's inputs (from input_ids, inputs_embeds or decoder_input_ids)."""
        for key in ("input_ids", "inputs_embeds", "decoder_input_ids"):
            if key in inputs:
                return inputs[key].shape[0]
        raise InputError("pass input_ids (or inputs_embeds) to the pipelined model")

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        """Pipelined forward. Collective: every rank passes the same inputs.

        Under grad mode (and ``gather_output=True``) the outputs are differentiable: ``loss.backward()`` on a loss
        computed from them, called on every rank, runs the pipeline's training step (``training/differentiable.py``).

        Returns:
            The transformers output class of the head (e.g. ``CausalLMOutputWithPast``) with the full
            batch's outputs, on every rank (or only on the last stage's rank with ``gather_output=False``;
            other ranks then get None).
        """
        grad = torch.is_grad_enabled() and self.gather_output
        with torch.no_grad():
            return self._forward(input_ids, attention_mask, grad, **kwargs)

    def _forward(self, input_ids, attention_mask, grad: bool, **kwargs: Any):
        from .families.losses import get_loss

        # The loss's targets under transformers' names: labels, or start/end positions (question answering).
        head_loss = self.resolved.head.loss
        call = CallTargets.take(kwargs, get_loss(head_loss, class_name=self.resolved.class_name).targets
                                if head_loss else ())
        targets, labels = call.targets, call.targets.get("labels")
        raise_if_broken("a forward pass")
        given = dict(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        given = {k: v for k, v in given.items() if v is not None}
        if self.check_inputs:
            # Every argument (tensors by checksum) in one small digest, before anything else is exchanged.
            check_same_on_all_ranks(self.ctx, "model inputs", {**given, **targets}, describe=self.rank_label)
        # Same inputs everywhere (checked above): these raise on every rank before anything is sent.
        validate.check_model_inputs(self.config, self.resolved.head.loss, given, labels=labels, dtype=self.dtype)
        # Labels go through the glue's preparation too (T5 derives decoder_input_ids from them, as
        # its forward does), then leave: the loss is computed from the gathered logits below.
        inputs = self.prepare_inputs(given if labels is None else {**given, "labels": labels})
        inputs.pop("labels", None)
        batch = self.batch_size(inputs)
        with self.spreading_failures("a forward pass"):
            if self.router_aux is None:
                outputs = self._run_forward(inputs, batch)
            else:  # counted as it runs: transformers' aux_loss of the batch, added to its loss
                ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
                outputs, aux_loss = forward_aux_loss(self, self.router_aux, lambda: self._run_forward(inputs, batch),
                                                     ids.shape[:2].numel())
        if outputs is None:
            return None
        if grad:  # the step of its backward runs the inputs again (T5's decoder inputs as derived from the labels)
            given = {**given, **{k: inputs[k] for k in ("decoder_input_ids",) if k in inputs and k not in given}}
            outputs = differentiable_outputs(self, given, outputs, rows=batch, router_aux=self.router_aux is not None)
        aux = (aux_loss, self.router_aux.coef) if self.router_aux is not None else None
        return forward_result(self, outputs, call, aux, grad=grad)

    def _run_forward(self, inputs: dict[str, Any], batch: int) -> tuple[torch.Tensor, ...] | None:
        # forward() is inference at every world size: the stages run in eval mode (no dropout),
        # and go back to the mode the user set (model.train() / model.eval()) afterwards.
        modes = [stage.training for stage in self.stages]
        for stage in self.stages:
            stage.eval()
        try:
            return self._run_forward_eval(inputs, batch)
        finally:
            for stage, mode in zip(self.stages, modes):
                stage.train(mode)

    def _run_forward_eval(self, inputs: dict[str, Any], batch: int) -> tuple[torch.Tensor, ...] | None:
        if self.plan.pp_size == 1:
            return run_local_stages(self.stages, inputs)  # every stage is local: one after another, whole batch
        # Any batch runs: padded to a multiple of its microbatch count (fewer rows than that included); the padded
        # rows' outputs are dropped below.
        m = self.microbatches_for(batch, training=False)
        inputs = pad_batch(inputs, batch, m)
        _, schedule = self.runtime.get(signature(inputs), training=False, n_microbatches=m)
        out = schedule.step(**inputs)
        if self.is_last_stage_rank:
            out = out if isinstance(out, tuple) else (out,)
            out = tuple(t[:batch] for t in out)
        if not self.gather_output:
            return out if self.is_last_stage_rank else None
        return self.runtime.broadcast_from_last(out if self.is_last_stage_rank else None)

    # ------------------------------------------ training / saving / generation: each in its own module
    def train_step(self, batch: dict[str, Any], **kwargs: Any) -> torch.Tensor:
        """Forward + backward of one global batch; returns the mean loss on every rank. See ``training/step.py``."""
        from .training.step import train_step

        with self.spreading_failures("a training step"):
            return train_step(self, batch, **kwargs)

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False, *,
        memory_budget_bytes: int | str | None = None, budget_batch: tuple[int, int] | None = None,
    ):
        """As transformers' (non-reentrant; ``every_n_layers`` over the whole model's layers). With
        ``memory_budget_bytes`` (and the ``budget_batch=(batch, seq)`` it plans for): the fewest checkpointed layers
        whose predicted per-rank activation peak fits; returns that choice. See ``recompute/layers.py``."""
        from .memory.recompute_budget import enable_checkpointing

        return enable_checkpointing(self, activation_checkpointing_kwargs, every_n_layers, offload,
                                    memory_budget_bytes=memory_budget_bytes, budget_batch=budget_batch)

    def microbatches_for(self, rows: int, *, training: bool, seq: int | None = None) -> int:
        """Microbatches a call of ``rows`` rows (a step: ``seq`` tokens) runs; see ``auto_choice.call_microbatches``."""
        if not self.options.adapt_microbatches:
            return self.n_microbatches
        costs = self.auto_choice.stage_costs if self.auto_choice is not None else ()  # as the load's choice costed
        return call_microbatches(
            self.schedule.name, pp_size=self.plan.pp_size, virtual_stages=self.plan.virtual_stages,
            n_microbatches=self.n_microbatches, rows=rows, training=training, seq=seq,
            flops=costs or tuple(s.flops_per_token for s in self.plan.stages), device_type=self.ctx.device.type)

    def set_schedule(self, schedule: str | type, *, n_microbatches: int | None = None) -> None:
        """Train with another schedule that places the stages as loaded (1F1B <-> GPipe; interleaved
        1F1B <-> looped BFS <-> interleaved zero bubble; ZBV <-> DualPipeV), and/or another microbatch
        count. Same arguments on every rank. Built torch stages and schedules are dropped."""
        from .planning.auto_choice import with_schedule

        n_microbatches = self.n_microbatches if n_microbatches is None else n_microbatches
        options = with_schedule(self.options, schedule, n_microbatches)
        arguments = {"schedule": options.schedule.name, "n_microbatches": options.n_microbatches}
        check_same_on_all_ranks(self.ctx, "set_schedule arguments", arguments, describe=self.rank_label)
        self.runtime.clear()
        self.options, self.schedule, self.n_microbatches = options, options.schedule, options.n_microbatches
        self.runtime = self._new_runtime()

    def _new_runtime(self) -> PipelineRuntime:
        return PipelineRuntime(
            stages=list(self.stages), plan=self.plan, schedule=self.schedule, n_microbatches=self.n_microbatches,
            dims=self.dims, device=self.ctx.device,
        )

    def tune(self, batch: dict[str, Any], **kwargs: Any):
        """Time ``train_step`` on ``batch`` for each schedule of this placement and microbatch count, keep the
        fastest; returns the :class:`~hf_pipeline.planning.auto_choice.AutoChoice`. Collective. See
        ``tools/schedule_tuning.py``."""
        from .tools.schedule_tuning import tune

        return tune(self, batch, **kwargs)

    def measure_split(self, batch: dict[str, Any], **kwargs: Any):
        """Time each stage on ``batch``; return the split balanced on those times, a ``split_advice.SplitAdvice`` (load
        with ``split=advice.split``). Collective. See ``split_advice.py``."""
        from .tools.split_advice import measure_split

        return measure_split(self, batch, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the global norm across all stages (tied weights counted once). See ``training/step.py``."""
        from .training.clipping import clip_grad_norm_

        with self.spreading_failures("clip_grad_norm_"):
            return clip_grad_norm_(self, max_norm, norm_type)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write a normal HF checkpoint; every rank writes its own tensors. See ``checkpointing/save.py``. With
        adapters added by ``add_adapter`` / ``load_adapter``: the active adapter, as transformers
        (``integrations/peft_host.py``)."""
        if self._hf_peft_config_loaded:
            return self.save_adapter(save_directory, **kwargs)
        from .checkpointing.save import save_pretrained

        with self.spreading_failures("save_pretrained"):
            return save_pretrained(self, save_directory, **kwargs)

    def generate(
        self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Pipelined generation with per-stage KV caches. Collective. See ``generate.py``."""
        from .generation.generate import generate

        if self.stage_maker.generate_refusal is not None:
            raise TraceError(self.stage_maker.generate_refusal)
        with self.spreading_failures("generate"):
            # generate() agrees on its arguments across ranks first, then validates them on every rank.
            return generate(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def profile(self):
        """Context manager timing every pipeline action on this rank; ``.timeline()`` after it. See ``profile.py``."""
        from .tools.profile import record

        return record(self)

    def extra_repr(self) -> str:
        return f"rank={self.ctx.rank}, stages={[s.spec.index for s in self.stages]} of {self.plan.num_stages}"

    def __repr__(self) -> str:  # keep print(model) short: the plan says what matters
        return f"{type(self).__name__}({self.extra_repr()})\n{self.plan}"


# accelerate's "nothing left to wrap" flag (compat.py): ``accelerator.prepare`` returns the model as it is, not in
# DDP (each rank holds different stages; the pipeline syncs its gradients); optimizer, loader etc. are prepared.
setattr(PipelinedModel, ACCELERATE_PREPARED_FLAG, True)


class TracedPipelinedModel(PipelinedModel):
    """A :class:`PipelinedModel` whose stages come from ``torch.export`` tracing instead of a recipe: the same
    surface and loader; ``generate()`` raises, since KV-cached generation needs a recipe."""


def load_pipelined(
    auto_class: str | type, path: str | os.PathLike, options: LoadOptions | None = None, /, **kwargs: Any
) -> PipelinedModel:
    """Build this rank's stages of ``path`` and return the :class:`PipelinedModel` (collective).

    Args:
        auto_class: transformers Auto class (or name) the checkpoint is loaded as.
        path: local HF checkpoint directory, or a hub id present in the local cache.
        options: the :class:`~hf_pipeline.load_options.LoadOptions` (each field says what it does and where it
            acts); or give them as keyword arguments instead.
        **kwargs: the fields of :class:`~hf_pipeline.load_options.LoadOptions`, when ``options`` is not given.

    Raises:
        InputTypeError: ``options`` and keyword arguments together, or a keyword that is no option.
    """
    from .memory.auto_choice_costs import chooser

    if options is not None and kwargs:
        raise InputTypeError(f"pass the options either as a LoadOptions or as keywords, not both ({sorted(kwargs)})")
    if options is None:
        options = LoadOptions.from_kwargs(kwargs)
    choose = chooser(options.schedule, options.n_microbatches, **options.acting_in("choose"))
    built = load_pipeline(auto_class, path, options, choose=choose)
    model_class = TracedPipelinedModel if built.options.traced else PipelinedModel
    model = model_class(built, gather_output=options.gather_output)
    model.name_or_path = str(path)  # what was passed, as transformers' ``model.name_or_path``
    return model
