"""What the rooms below the model facade need of a pipelined model, as one typed contract: :class:`PipelineCore`.

:class:`~hf_pipeline.model.PipelinedModel` sits above generation, continuous batching, training,
recompute, checkpointing, memory planning, the integrations, the tools and serving, so none of them
may import it. Each annotates the model it is handed as :class:`PipelineCore` instead, and reads
only what this protocol declares: the rank and its groups, the plan and options, this rank's stages
and their torch runtime, the meta-device model, and the few methods every feature shares
(``tests/test_house.py`` checks both: every ``model`` parameter below the facade is annotated, and
every attribute read off it is declared here or is an ``nn.Module``'s).

The model's own methods that these rooms call back (``generate``, ``train_step``,
``save_pretrained``...) are the user-facing surface, declared here too, so that a room calling them
is typed against the same object.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from .distributed.context import RankContext
    from .distributed.dims import ParallelDims
    from .loading.stages import StageMaker
    from .loading.weights import LoadReport
    from .planning.layout import ParamLayout
    from .planning.options import PipelineOptions
    from .planning.plan import StagePlan
    from .planning.resolve import ResolvedRecipe
    from .planning.schedules import ScheduleSpec
    from .runtime.cache import PipelineRuntime

__all__ = ["PipelineCore"]


@runtime_checkable
class PipelineCore(Protocol):
    """A pipelined model as the rooms below :mod:`hf_pipeline.model` see it (implemented by ``PipelinedModel``).

    Attributes:
        config: the transformers config.
        ctx: this rank's :class:`RankContext` (renewed after a failure stopped its groups).
        dims: the job's mesh (:class:`ParallelDims`: pp, dp, fsdp, tp ranks and groups).
        options: the resolved :class:`PipelineOptions` (replaced by ``set_schedule``).
        plan: the :class:`StagePlan`, the same on every rank.
        resolved: the recipe resolved on the meta model (blocks, head, ties, costs).
        param_layout: which stages (and ranks) hold every checkpoint key.
        stage_maker: what the front end built: the plan and how to make stages on the meta device.
        skeleton: the whole model on the meta device (never run; its config-only helpers and shapes).
        stages: this rank's stages, in stage order, their parameter names the checkpoint's keys.
        schedule, n_microbatches: the training schedule and microbatches per pipelined call.
        runtime: torch's ``PipelineStage`` objects and schedules per input signature.
        check_inputs: whether a call first checks its inputs are the same on every rank.
        train_step_state: the training room's state between steps (``training.step.TrainStepState``; owned,
            made and reset by that room and by what changes the parameters); None until the first step.
        training: ``nn.Module``'s mode flag.
        name_or_path, checkpoint_dir, load_report, gather_output, auto_choice: as loaded.
        adapter_loading: while an adapter is loaded, its name (``integrations.peft_host.AdapterHost``'s).
        fused_head: TRL's fused LM head's settings (``training.fused_head.FusedHead``) once a TRL trainer asked
            for it, else None.
    """

    config: Any
    ctx: RankContext
    dims: ParallelDims
    options: PipelineOptions
    plan: StagePlan
    resolved: ResolvedRecipe
    stage_maker: StageMaker
    stages: nn.ModuleList
    schedule: ScheduleSpec
    n_microbatches: int
    runtime: PipelineRuntime
    check_inputs: bool
    train_step_state: Any
    training: bool
    name_or_path: str
    checkpoint_dir: pathlib.Path | None
    load_report: LoadReport
    gather_output: bool
    auto_choice: Any
    adapter_loading: str | None  # the adapter being loaded (the integrations room's AdapterHost sets it)
    fused_head: Any

    @property
    def skeleton(self) -> nn.Module: ...

    @property
    def param_layout(self) -> ParamLayout: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def generation_config(self) -> Any: ...

    @property
    def is_last_stage_rank(self) -> bool: ...

    # ------------------------------------------------------------ shared by every feature
    def rank_label(self, rank: int) -> str: ...

    def global_rank(self, pp_rank: int) -> int: ...

    def prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]: ...

    def batch_size(self, inputs: dict[str, Any]) -> int: ...

    def checkpoint_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def spreading_failures(self, what: str) -> contextlib.AbstractContextManager: ...

    def can_generate(self) -> bool: ...

    # ------------------------------------------------------------ the user-facing surface features call back
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> Any: ...

    def train_step(self, batch: dict[str, Any], **kwargs: Any) -> torch.Tensor: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> None: ...

    def set_schedule(self, schedule: Any, *, n_microbatches: int | None = None) -> None: ...

    def microbatches_for(self, rows: int, *, training: bool) -> int: ...

    def activation_checkpointing_enable(self, *args: Any, **kwargs: Any) -> Any: ...

    def profile(self) -> Any: ...
