"""PipelinedModel: one model whose stages live on different ranks, called like a transformers model.

Every rank of a ``torchrun`` / ``accelerate launch`` job builds the same :class:`StagePlan` from the
config, materialises only its own stages (read shard by shard from safetensors) and joins the
pipelined calls: ``model(**inputs)`` is collective, every rank passes the same inputs, and every
rank gets the full output (``gather_output=False`` keeps it on the last stage only).

Example (``torchrun --nproc_per_node 2 script.py``):
    >>> from hf_pipeline import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, n_microbatches=4)
    >>> print(model.plan)
    >>> out = model(input_ids=ids, attention_mask=mask)
    >>> out.logits.shape
    torch.Size([8, 16, 32000])
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Sequence

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.pipelining import PipelineStage
from transformers import AutoConfig, modeling_outputs

from . import validate
from .dist import RankContext, check_same_on_all_ranks, collective_errors, init_distributed
from .faults import raise_if_broken, step_errors
from .plan import ResolvedRecipe, StagePlan, make_plan, resolve_recipe
from .recipe import get_recipe, list_recipes
from .schedules import ScheduleForwardInOrder, ScheduleSpec, get_schedule, validate_schedule
from .stages import StageModule, build_stage, materialize, meta_model
from .weights import CheckpointIndex, LoadReport, checkpoint_key_renames, load_tensors, resolve_checkpoint

__all__ = ["PipelinedModel", "SPLIT_METHODS", "load_pipelined"]

SPLIT_METHODS = ("auto", "recipe", "trace")


def _resolve_dtype(dtype: Any, config) -> torch.dtype:
    # As transformers' default dtype="auto": the config's dtype, else the default float dtype.
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(dtype, dtype)
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32', 'bfloat16' or torch.float16")
        dtype = getattr(torch, name)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point type, got {dtype}")
    return dtype


def _check_dtype_supported(dtype: torch.dtype, device: torch.device) -> None:
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"dtype {dtype} is not supported on device {device} ({e}); load with dtype='float32'") from None


class PipelinedModel(nn.Module):
    """A transformers model split into pipeline stages; this rank holds ``self.stages``.

    Attributes:
        plan: the :class:`StagePlan` (same on every rank).
        stages: this rank's :class:`StageModule` s, in stage order (checkpoint names inside).
        ctx: the :class:`RankContext`.
        config: the transformers config.
        load_report: what this rank read from the checkpoint.
    """

    def __init__(
        self,
        *,
        config,
        plan: StagePlan,
        resolved: ResolvedRecipe,
        stages: Sequence[StageModule],
        skeleton: nn.Module,
        ctx: RankContext,
        schedule: ScheduleSpec,
        n_microbatches: int,
        gather_output: bool = True,
        checkpoint_dir: pathlib.Path | None = None,
        load_report: LoadReport | None = None,
        pp_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        pp_rank: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        mesh: Any = None,
    ):
        super().__init__()
        self.config = config
        self.plan = plan
        self.resolved = resolved
        self.stages = nn.ModuleList(stages)
        # The meta-device model: never run, kept for its config-only helpers (T5's _shift_right).
        object.__setattr__(self, "skeleton", skeleton)
        self.ctx = ctx
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        self.gather_output = gather_output
        self.checkpoint_dir = checkpoint_dir
        self.load_report = load_report
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.pp_rank = pp_rank
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.mesh = mesh
        self._runtimes: dict[Any, tuple[list[PipelineStage], Any]] = {}
        self.check_inputs = True

    # ----------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    @property
    def is_first_stage_rank(self) -> bool:
        return self.pp_rank == self.plan.first_rank

    @property
    def is_last_stage_rank(self) -> bool:
        return self.pp_rank == self.plan.last_rank

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's pipeline replica."""
        if self.pp_group is None:
            return pp_rank
        return dist.get_global_rank(self.pp_group, pp_rank)

    def rank_label(self, rank: int) -> str:
        """What global rank ``rank`` runs, for messages: ``"stage 1"``, ``"stages 0, 2 of replica 1"``."""
        pp = self.plan.pp_size
        idx = [s.index for s in self.plan.stages_for_rank(rank % pp)]
        label = f"stage{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"
        return label + (f" of replica {rank // pp}" if self.dp_size > 1 else "")

    def _step_errors(self, what: str):
        # A failure inside a pipelined call reaches every rank with the failing rank's stage (faults.py).
        return step_errors(self.ctx, what, groups=(self.pp_group, self.dp_group), describe=self.rank_label)

    def checkpoint_named_parameters(self):
        """(checkpoint key, parameter) for this rank's parameters; tied copies within a stage once."""
        seen: set[int] = set()
        for stage in self.stages:
            for name, p in stage.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    # ----------------------------------------------------------------- forward
    def _prepare(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = {k: v for k, v in inputs.items() if v is not None}
        for k, v in list(inputs.items()):
            if isinstance(v, torch.Tensor):
                inputs[k] = v.to(self.device)
        return self.resolved_glue.prepare_inputs(self.skeleton, inputs)

    @property
    def resolved_glue(self):
        return self.stages[0].glue

    def _batch_size(self, inputs: dict[str, Any]) -> int:
        for key in ("input_ids", "inputs_embeds", "decoder_input_ids"):
            if key in inputs:
                return inputs[key].shape[0]
        raise ValueError("pass input_ids (or inputs_embeds) to the pipelined model")

    def _runtime(self, key: Any, *, training: bool, loss_fn=None, scale_grads: bool = True):
        """PipelineStage objects + torch schedule for one input signature (shapes fix the P2P buffers).

        ``scale_grads=False``: torch does not divide gradients by n_microbatches (the loss already
        is each microbatch's share of the global mean, see ``train.py``).
        """
        full_key = (key, training) if scale_grads else (key, training, "unscaled")
        if full_key not in self._runtimes:
            pstages = [
                PipelineStage(stage, stage.spec.index, self.plan.num_stages, self.device, group=self.pp_group)
                for stage in self.stages
            ]
            spec = self.schedule
            kwargs = {"n_microbatches": self.n_microbatches, "loss_fn": loss_fn, "scale_grads": scale_grads}
            if not training and not spec.multi:
                # forward only: GPipe runs exactly the forward actions
                schedule = get_schedule("gpipe").cls(pstages[0], **kwargs)
            elif not training:
                stage_to_rank = {s.index: s.rank for s in self.plan.stages}
                schedule = ScheduleForwardInOrder(pstages, self.n_microbatches, stage_to_rank=stage_to_rank)
            else:
                schedule = spec.cls(pstages if spec.multi else pstages[0], **kwargs)
            self._runtimes[full_key] = (pstages, schedule)
        return self._runtimes[full_key]

    def _signature(self, inputs: dict[str, Any]) -> tuple:
        return tuple(
            (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v)) for k, v in sorted(inputs.items())
        )

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        """Pipelined forward (inference). Collective: every rank passes the same inputs.

        Returns:
            The transformers output class of the head (e.g. ``CausalLMOutputWithPast``) with the full
            batch's outputs, on every rank (or only on the last stage's rank with ``gather_output=False``;
            other ranks then get None).
        """
        labels = kwargs.pop("labels", None)
        raise_if_broken("a forward pass")
        inputs = self._prepare(dict(input_ids=input_ids, attention_mask=attention_mask, **kwargs))
        if self.check_inputs:
            tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            check_same_on_all_ranks(self.ctx, "model inputs", tensors if labels is None else {**tensors, "labels": labels})
        batch = self._batch_size(inputs)
        # Same inputs everywhere (checked above): these raise on every rank before anything is sent.
        validate.check_model_inputs(self.config, self.resolved.head.loss, inputs, labels=labels)
        if self.plan.pp_size > 1:
            validate.check_microbatches(batch=batch, n_microbatches=self.n_microbatches, training=False)
        with self._step_errors("a forward pass"):
            outputs = self._run_forward(inputs, batch)
        if outputs is None:
            return None
        result = dict(zip(self.resolved.head.outputs, outputs))
        if labels is not None:
            from .losses import model_loss

            result["loss"] = model_loss(self, result["logits"], labels.to(self.device))
        return self._output_class()(**result)

    def _output_class(self) -> type:
        # The transformers output class the head's outputs are returned in (a traced model records its own).
        return getattr(modeling_outputs, self.resolved.head.output_class)

    def _run_forward(self, inputs: dict[str, Any], batch: int) -> tuple[torch.Tensor, ...] | None:
        if self.plan.pp_size == 1:
            # Every stage is local: run them one after another on the whole batch.
            x: tuple = ()
            for stage in self.stages:
                x = stage(*x, **inputs)
                x = x if isinstance(x, tuple) else (x,)
            return x
        m = self.n_microbatches
        if batch < m:
            raise ValueError(
                f"batch size {batch} is smaller than n_microbatches={m}; pass at least {m} sequences or load with a "
                f"smaller n_microbatches"
            )
        pad = (-batch) % m
        if pad:
            # Torch's schedules need equal microbatches: repeat the last row, drop its outputs after.
            inputs = {
                k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch else v
                for k, v in inputs.items()
            }
        _, schedule = self._runtime(self._signature(inputs), training=False)
        for stage in self.stages:
            stage.eval()
        out = schedule.step(**inputs)
        if self.is_last_stage_rank:
            out = out if isinstance(out, tuple) else (out,)
            out = tuple(t[:batch] for t in out)
        if not self.gather_output:
            return out if self.is_last_stage_rank else None
        return self._broadcast_from_last(out if self.is_last_stage_rank else None)

    def _broadcast_from_last(self, tensors: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
        src = self.global_rank(self.plan.last_rank)
        meta = [None if tensors is None else [(tuple(t.shape), t.dtype) for t in tensors]]
        dist.broadcast_object_list(meta, src=src, group=self.pp_group)
        if tensors is None:
            tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[0])
        else:
            tensors = tuple(t.contiguous() for t in tensors)
        for t in tensors:
            dist.broadcast(t, src=src, group=self.pp_group)
        return tensors

    # ------------------------------------------------------- training / saving / generation
    # Each lives in its own module; these methods are the user-facing entry points.
    def train_step(self, batch: dict[str, Any], **kwargs: Any) -> torch.Tensor:
        """Forward + backward of one global batch; returns the mean loss on every rank. See ``train.py``."""
        from .train import train_step

        with self._step_errors("a training step"):
            return train_step(self, batch, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the global norm across all stages (tied weights counted once). See ``train.py``."""
        from .train import clip_grad_norm_

        with self._step_errors("clip_grad_norm_"):
            return clip_grad_norm_(self, max_norm, norm_type)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write a normal HF checkpoint; every rank writes its own tensors. See ``checkpoint.py``."""
        from .checkpoint import save_pretrained

        with self._step_errors("save_pretrained"):
            return save_pretrained(self, save_directory, **kwargs)

    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Pipelined generation with per-stage KV caches. Collective. See ``generate.py``."""
        from .generate import generate

        with self._step_errors("generate"):
            validate.check_generate_inputs(input_ids)
            if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not self.config.is_encoder_decoder:
                # Inside the guard: if only some ranks got a too-long prompt, the others are told, not left waiting.
                new = kwargs.get("max_new_tokens")
                validate.check_sequence_length(self.config, input_ids.shape[1], what="the prompt", new_tokens=new if isinstance(new, int) else 0)
            return generate(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def profile(self):
        """Context manager timing every pipeline action on this rank; ``.timeline()`` after it. See ``profile.py``."""
        from .profile import record

        return record(self)

    def extra_repr(self) -> str:
        return f"rank={self.ctx.rank}, stages={[s.spec.index for s in self.stages]} of {self.plan.num_stages}"

    def __repr__(self) -> str:  # keep print(model) short: the plan says what matters
        return f"PipelinedModel({self.extra_repr()})\n{self.plan}"


def _build_groups(ctx: RankContext, pp_size: int):
    """(mesh, pp_group, dp_group, pp_rank, dp_rank, dp_size): ranks [d*pp, (d+1)*pp) form pipeline replica d."""
    if ctx.world_size % pp_size:
        raise ValueError(
            f"world size {ctx.world_size} is not a multiple of the pipeline size {pp_size} (= num_stages / "
            f"virtual_stages); launch a multiple of {pp_size} processes or change num_stages"
        )
    dp_size = ctx.world_size // pp_size
    if not ctx.is_distributed:
        return None, None, None, 0, 0, 1
    if dp_size == 1:
        return None, None, None, ctx.rank, 0, 1
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
    # Sub-groups get torch's 30-minute default, not the job's timeout: a dead peer must not hang them.
    ctx.apply_timeout(mesh.get_group("pp"), mesh.get_group("dp"))
    return mesh, mesh.get_group("pp"), mesh.get_group("dp"), mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), dp_size


def load_pipelined(
    auto_class: str | type,
    path: str | os.PathLike,
    *,
    n_microbatches: int | None = None,
    num_stages: int | None = None,
    virtual_stages: int | None = None,
    schedule: str | None = None,
    split: str | Sequence[str] = "auto",
    dtype: Any = None,
    device: str | torch.device | None = None,
    gather_output: bool = True,
    revision: str | None = None,
    progress: bool | None = None,
    config=None,
    split_method: str = "auto",
) -> PipelinedModel:
    """Build this rank's stages of ``path`` and return the :class:`PipelinedModel` (collective).

    Args:
        auto_class: transformers Auto class (or name) the checkpoint is loaded as.
        path: local HF checkpoint directory, or a hub id present in the local cache.
        n_microbatches: microbatches per pipelined call (default: number of stages).
        num_stages: total stages (default world size x virtual_stages; fewer ranks per pipeline than
            the world size gives data-parallel replicas).
        virtual_stages: stages per rank (default: what the schedule needs, 1 or 2).
        schedule: a name from :data:`hf_pipeline.schedules.SCHEDULES` (default "1f1b", or
            "interleaved-1f1b" with virtual_stages > 1).
        split: "auto" (cost balanced, cutting a block between its attention and MLP halves where
            the recipe allows and that balances better), "uniform" (whole blocks), or what starts
            stages 1..S-1: block FQNs or a block's second half ("model.layers.4.post_attention_layernorm").
        dtype: weights dtype ("auto" = the config's).
        device: force a device ("cpu"); default cuda:LOCAL_RANK when available.
        gather_output: give outputs to every rank (else only the last stage's rank).
        split_method: "recipe" (a recipe from ``model_recipes/`` must exist), "trace" (split with
            torch.export, see ``trace.py``: forward and training, no generation), or "auto": the
            recipe for ``config.model_type`` when there is one, else the tracer.
    """
    ctx = init_distributed(device=device)
    with collective_errors(ctx, "reading the checkpoint config"):
        ckpt = resolve_checkpoint(path, revision=revision)
        if config is None:
            config = AutoConfig.from_pretrained(ckpt)
        if split_method not in SPLIT_METHODS:
            raise ValueError(f"split_method must be one of {list(SPLIT_METHODS)}, got {split_method!r}")
        traced = split_method == "trace" or (split_method == "auto" and config.model_type not in list_recipes())
        recipe = None if traced else get_recipe(config.model_type)
        if schedule is None:
            schedule = "interleaved-1f1b" if (virtual_stages or 1) > 1 else "1f1b"
        sched = get_schedule(schedule)
        if virtual_stages is None:
            virtual_stages = sched.default_virtual_stages()
        if num_stages is None:
            num_stages = ctx.world_size * virtual_stages
        if num_stages % virtual_stages:
            raise ValueError(f"num_stages={num_stages} is not a multiple of virtual_stages={virtual_stages}")
        pp_size = num_stages // virtual_stages
        if ctx.world_size % pp_size:
            raise ValueError(
                f"num_stages={num_stages} with virtual_stages={virtual_stages} needs a multiple of {pp_size} processes, "
                f"but the world size is {ctx.world_size}; launch {pp_size} (or k x {pp_size}) processes or change num_stages"
            )
        if n_microbatches is None:
            n_microbatches = num_stages
        validate_schedule(sched, pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=n_microbatches)
        dtype = _resolve_dtype(dtype, config)
        _check_dtype_supported(dtype, ctx.device)
        if not traced:
            skeleton = meta_model(config, auto_class)
            resolved = resolve_recipe(skeleton, recipe)
            plan = make_plan(skeleton, resolved, pp_size=pp_size, virtual_stages=virtual_stages, layout=sched.layout, split=split, dtype=dtype)
    if traced:
        from .trace import load_traced

        return load_traced(
            auto_class, ckpt, config=config, ctx=ctx, schedule=sched, pp_size=pp_size, virtual_stages=virtual_stages,
            n_microbatches=n_microbatches, split=split, dtype=dtype, gather_output=gather_output, progress=progress,
        )
    mesh, pp_group, dp_group, pp_rank, dp_rank, dp_size = _build_groups(ctx, pp_size)

    local = plan.stages_for_rank(pp_rank)
    stages: list[StageModule] = []
    report = LoadReport(files_opened=[], keys_read=[], bytes_read=0)
    with collective_errors(ctx, "loading weights"):
        index = CheckpointIndex.from_directory(ckpt)
        stages = [build_stage(skeleton, resolved, spec) for spec in local]
        wanted, aliases, expected, ignore = _wanted_tensors(skeleton, resolved, stages, index, dtype)
        tensors, report = load_tensors(
            index, wanted, aliases=aliases, device=ctx.device, expected_keys=expected, ignore_unexpected=ignore,
            progress=ctx.is_main_process if progress is None else progress,
        )
        made: dict = {}  # one Parameter per checkpoint tensor on this rank, across its stages
        for stage in stages:
            materialize(stage, tensors, device=ctx.device, tied=resolved.tied, made=made)
            stage.eval()
        del tensors
    return PipelinedModel(
        config=config, plan=plan, resolved=resolved, stages=stages, skeleton=skeleton, ctx=ctx, schedule=sched,
        n_microbatches=n_microbatches, gather_output=gather_output, checkpoint_dir=ckpt, load_report=report,
        pp_group=pp_group, dp_group=dp_group, pp_rank=pp_rank, dp_rank=dp_rank, dp_size=dp_size, mesh=mesh,
    )


def _wanted_tensors(skeleton: nn.Module, resolved: ResolvedRecipe, stages: Sequence[StageModule], index: CheckpointIndex, dtype: torch.dtype):
    """What to read for these stages: names + (shape, dtype), alternative keys, the whole model's keys."""
    ckpt_keys = index.keys()
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    full_sd = skeleton.state_dict(keep_vars=True)
    groups = {name: g for g in resolved.tied for name in g}

    # Keys transformers renames on load (LayerNorm.gamma -> .weight, ...), by the name they load as.
    legacy: dict[str, str] = {}
    for key, renamed in checkpoint_key_renames(skeleton, ckpt_keys).items():
        legacy.setdefault(renamed, key)

    def variants(name: str) -> list[str]:
        # A base model (BertModel) can load a head checkpoint (bert.embeddings...) and a head model a
        # base checkpoint (embeddings...), as transformers allows.
        out = [name]
        if prefix and name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        elif prefix and not resolved.base:
            out.append(f"{prefix}.{name}")
        return out + [legacy[v] for v in out if v in legacy]

    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    aliases: dict[str, list[str]] = {}
    for stage in stages:
        sd = stage.state_dict(keep_vars=True)
        for name, t in sd.items():
            is_param = isinstance(t, nn.Parameter)
            alts = [v for member in groups.get(name, (name,)) for v in variants(member)]
            if not is_param and not any(a in ckpt_keys for a in alts):
                continue  # a buffer the checkpoint does not store keeps its constructed value
            wanted[name] = (tuple(t.shape), dtype if t.is_floating_point() else t.dtype)
            aliases[name] = [a for a in alts if a != name]
    expected = {v for name in full_sd for member in groups.get(name, (name,)) for v in variants(member)}
    ignore = list(getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or [])
    if prefix and not resolved.base and any(k.startswith(prefix + ".") for k in ckpt_keys):
        ignore.append(rf"^(?!{prefix}\.)")  # a head checkpoint loaded as its base model: heads are ignored
    return wanted, aliases, expected, ignore
