"""Every private torch, transformers and peft API the package relies on, in one place.

Each name here reaches into another library's internals because the public API lacks what the package needs; the
comment beside it says which. The third-party methods the package replaces for a while (peft's, while a pipelined
model is alive) are named here too, each with its reason. Nothing else in the package imports a private torch or
transformers name: when a release moves one, this is the only file to change, and ``pyproject.toml`` bounds the
versions it was tested with (torch 2.13, transformers 5.24-5.25).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

from .errors import InternalError

__all__ = [
    "Action", "ComputationType", "FakeTensorMode", "PROFILED_METHODS", "PipelineScheduleRuntime", "PipelineStageBase",
    "ACCELERATE_PREPARED_FLAG", "abort_process_group", "attn_implementation", "auto_model_mapping",
    "decoder_start_token_tensor",
    "default_store", "eos_token_tensor", "flatten_dense_tensors", "generation_helper", "pad_token_tensor", "pytree",
    "revert_weight_conversion", "torch_schedules", "unflatten_dense_tensors",
]

# --- torch.distributed -------------------------------------------------------------------------
def default_store() -> Any:
    """The default process group's TCP store (no public accessor: ``dist.get_default_store`` does not exist)."""
    return dist.distributed_c10d._get_default_store()


def abort_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Abort a process group so blocked collectives return (public ``abort`` exists only on some backends' objects)."""
    dist.distributed_c10d._abort_process_group(group)


# --- torch.distributed.pipelining ---------------------------------------------------------------
# A schedule built from an explicit action list: torch exposes the runtime that executes action lists (used by its
# own CSV schedules) only under this private name.
PipelineScheduleRuntime = torch_schedules._PipelineScheduleRuntime
# The action records (stage, computation, microbatch) such a runtime takes: no public constructor.
Action = torch_schedules._Action
ComputationType = torch_schedules._ComputationType


# What the profiler wraps to time every action: the methods torch's schedules run each action
# and P2P wait through (there is no public hook or callback per action).
from torch.distributed.pipelining import stage as _torch_stage  # noqa: E402

PipelineStageBase = _torch_stage._PipelineStageBase
PROFILED_METHODS = (
    (torch_schedules._PipelineSchedule, "_maybe_compute_loss"),
    (torch_schedules, "_batch_p2p"),
    (torch_schedules, "_wait_batch_p2p"),
)


# --- torch utilities ---------------------------------------------------------------------------
# Flat buckets for gradient all-reduce, as DDP builds them (no public flatten/unflatten pair).
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors  # noqa: E402
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors  # noqa: E402

# Output structure of a traced graph: torch.utils.pytree is public only from later releases.
from torch.utils import _pytree as pytree  # noqa: E402


def FakeTensorMode(*args: Any, **kwargs: Any):  # noqa: N802 - a class in torch
    """Shapes-and-dtypes-only tensors for the memory planner (torch has no public fake-tensor mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode as cls

    return cls(*args, **kwargs)


# --- transformers GenerationMixin --------------------------------------------------------------
# Pipelined generate must prepare the generation config, special tokens, lengths and logits processors exactly as
# ``GenerationMixin.generate`` does, so that sampling is identical; those steps exist only as private methods.
_GENERATION_HELPERS = (
    "_prepare_generation_config",
    "_prepare_special_tokens",
    "_prepare_attention_mask_for_generation",
    "_prepare_generated_length",
    "_get_logits_processor",
    "_get_stopping_criteria",
    # beam search (``generation/beam.py``): transformers' own beam steps, vectorised over (prompts, beams)
    "_get_top_k_continuations",
    "_get_running_beams_for_next_iteration",
    "_update_finished_beams",
    "_check_early_stop_heuristic",
    "_beam_search_has_unfinished_sequences",
)


def generation_helper(model: Any, name: str):
    """``model``'s GenerationMixin step ``name`` (one of the private helpers above), bound."""
    if name not in _GENERATION_HELPERS:
        raise InternalError(f"{name!r} is not a GenerationMixin helper this package uses; list it in compat.py")
    return getattr(model, name)


def pad_token_tensor(config: Any) -> torch.Tensor | None:
    """The pad token tensor ``_prepare_special_tokens`` set on a GenerationConfig (no public attribute)."""
    return config._pad_token_tensor


def eos_token_tensor(config: Any) -> torch.Tensor | None:
    """The EOS token ids tensor ``_prepare_special_tokens`` set on a GenerationConfig (no public attribute)."""
    return config._eos_token_tensor


def decoder_start_token_tensor(config: Any) -> torch.Tensor | None:
    """The decoder start tensor ``_prepare_special_tokens`` set on a GenerationConfig (no public attribute)."""
    return config._decoder_start_token_tensor


# --- transformers Auto classes and configs -----------------------------------------------------
def auto_model_mapping(auto_class: Any):
    """An Auto class's config -> model class mapping, or None for a concrete class (transformers
    exposes lookups by config only through this private attribute)."""
    return getattr(auto_class, "_model_mapping", None)


def attn_implementation(config: Any, name: str | None = None) -> str:
    """``config``'s attention implementation, first set to ``name`` if given (before a model is built from it,
    validated as ``from_pretrained(attn_implementation=...)`` validates it): the attribute is private."""
    if name is not None:
        config._attn_implementation = name
    return config._attn_implementation


def no_init_weights():
    """transformers' context that skips weight initialisation while a model is built (on the meta device it computes
    nothing and was most of the skeleton's build time): ``transformers.initialization`` has no public alias."""
    from transformers.initialization import no_init_weights as _no_init_weights

    return _no_init_weights()


# accelerate's "already prepared" flag: accelerator.prepare returns a module carrying it as it is instead of wrapping
# it in DDP (there is no public opt-out for a module that syncs its own gradients).
ACCELERATE_PREPARED_FLAG = "_is_accelerate_prepared"


# ------------------------------------------------------------------------------------------------
# Below: one section per room of the package that needs a private API, each beside the public API it stands in
# for. Each section lists its own names in an `__all__ += [...]` line of its own.

# --- for distributed/ ----------------------------------------------------------------------------

import datetime  # noqa: E402


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> datetime.timedelta:
    """The timeout ``group``'s backend for ``device`` was created with (``set_timeout`` has no ``get_timeout``)."""
    return group._get_backend(device).options._timeout


__all__ += ["group_timeout"]


# --- for families/ and planning/ ------------------------------------------------------------------
# A torch runtime schedule's action lists lowered again after a rewrite (fuse_backward): torch
# lowers compute actions to sends, receives and gradient reduction only inside its schedules'
# constructors and ``_PipelineScheduleRuntime._load_csv`` (no public "set pipeline_order" API).
def prepare_schedule_with_comms(schedule: Any, actions: dict[int, list]) -> None:
    """Lower ``actions`` (rank -> compute actions) into ``schedule.pipeline_order_with_comms``, as torch does."""
    schedule._prepare_schedule_with_comms(actions)


# torch's lowering passes on their own, for a schedule whose placement is set by the caller
# (runtime.forward_schedule): the public entry above validates that every forward has a backward.
def lower_compute_actions(
    actions: dict[int, list], *, stage_to_rank: dict[int, int], num_stages: int, n_microbatches: int
) -> dict[int, list]:
    """``actions`` (rank -> compute actions) with torch's unshard/reshard, grad-reduce, send and receive actions."""
    lowered = {
        rank: torch_schedules._add_reduce_grad(torch_schedules._add_unshard_reshard(acts), n_microbatches)
        for rank, acts in actions.items()
    }
    return torch_schedules._add_send_recv(lowered, stage_to_rank=stage_to_rank.__getitem__, num_stages=num_stages)


# The decoder inputs an encoder-decoder model builds from labels (labels shifted right, the decoder
# start token first): transformers' public ``prepare_decoder_input_ids_from_labels`` wraps this
# private method and exists on the ForConditionalGeneration classes only.
def shift_right(model: Any, labels: Any) -> Any:
    """``model._shift_right(labels)``: the decoder input ids transformers makes from ``labels``."""
    return model._shift_right(labels)


__all__ += ["lower_compute_actions", "prepare_schedule_with_comms", "shift_right"]


# --- for runtime/ and loading/ --------------------------------------------------------------------
def transformers_load_exceptions(
    model: Any, unexpected: set[str], missing: set[str]
) -> tuple[set[str], set[str]] | None:
    """(unexpected, missing) left after the model class's own exception rules, as ``from_pretrained`` applies them.

    Stands in for the filtering inside transformers' ``PreTrainedModel.from_pretrained`` (its
    ``_keys_to_ignore_on_load_*`` patterns plus the legacy ``rotary_emb.inv_freq`` / ``position_ids``
    buffers, ``_adjust_missing_and_unexpected_keys``), which has no public API.

    Returns:
        The two sets, or None on a transformers without that method: the caller applies the class's
        ``_keys_to_ignore_on_load_*`` patterns itself.
    """
    try:
        from transformers.utils.loading_report import LoadStateDictInfo

        info = LoadStateDictInfo(
            missing_keys=set(missing), unexpected_keys=set(unexpected), mismatched_keys=set(), error_msgs=[],
            conversion_errors={}, skipped_pp_keys=set(),
        )
        model._adjust_missing_and_unexpected_keys(info)
    except (ImportError, AttributeError, TypeError):
        return None
    return set(info.unexpected_keys), set(info.missing_keys)


def revert_weight_conversion(model: Any, state_dict: dict, conversions: list | None) -> dict:
    """transformers' ``revert_weight_conversion`` of ``state_dict`` (the keys and tensors its ``save_pretrained``
    writes), reverting ``conversions`` (None: transformers' default mapping for the class).

    transformers reverts the transforms its ``from_pretrained`` keeps on the model (``_weight_conversions``:
    those the checkpoint's keys matched); the function takes no argument for them, so they are set on the
    meta skeleton for the call and the attribute is put back after.
    """
    from transformers.core_model_loading import revert_weight_conversion as revert

    if conversions is not None and not conversions:
        return dict(state_dict)  # the checkpoint went through none: saved as it is, as transformers does
    had = "_weight_conversions" in vars(model)
    old = vars(model).get("_weight_conversions")
    model._weight_conversions = conversions
    try:
        return revert(model, state_dict)
    finally:
        if had:
            model._weight_conversions = old
        else:
            del model._weight_conversions


def mark_hf_initialized(obj: Any, initialized: bool = True) -> None:
    """Tell transformers' ``initialize_weights()`` to skip (True) or to visit (False) a tensor or module.

    Stands in for what ``from_pretrained`` does to the tensors it loaded before it initialises the
    rest (their ``_is_hf_initialized`` flag); transformers has no public API to mark them.
    """
    obj._is_hf_initialized = initialized


def module_registries(module: torch.nn.Module) -> tuple[dict, dict]:
    """``module``'s own parameter and child registries (``_parameters``, ``_modules``), to edit in place.

    Pruning a copy of a model to one stage deletes entries from them. ``named_parameters`` and
    ``named_children`` are no stand-in: they skip ``None`` entries and list a child registered under
    two names once, and torch has no public way to delete a registration by name without them.
    """
    return module._parameters, module._modules


def cache_dummy_layer(seq_length: Any) -> Any:
    """A transformers ``DummyLayer`` (a cache layer that stores nothing, which the mask functions skip)
    whose ``get_seq_length()`` answers ``seq_length()``.

    A pipeline stage's cache holds every layer of the model but fills only the stage's own; shown as dummies for
    the rest while the model's forward runs, the mask functions size the masks against the stage's own layers, and
    a forward that counts the past from layer 0 (Falcon, BLOOM) gets the stage's own count. ``cache_utils`` defines
    ``DummyLayer`` but transformers does not export it.
    """
    global _STAGE_DUMMY
    if _STAGE_DUMMY is None:
        from transformers.cache_utils import DummyLayer

        class StageDummyLayer(DummyLayer):
            def __init__(self, seq_length: Any) -> None:
                super().__init__()
                self.seq_length = seq_length

            def get_seq_length(self) -> int:
                return self.seq_length()

        _STAGE_DUMMY = StageDummyLayer
    return _STAGE_DUMMY(seq_length)


_STAGE_DUMMY: Any = None


def fx_graph_of(module: torch.nn.Module):
    """The fx graph an unflattened exported module runs, or None: torch's ``InterpreterModule`` keeps
    it as ``graph`` (or, in some releases, the private ``_graph``), with no public accessor."""
    return module.__dict__.get("graph") or getattr(module, "_graph", None)


__all__ += ["fx_graph_of", "mark_hf_initialized", "module_registries", "transformers_load_exceptions"]


# --- for generation/ -------------------------------------------------------------------------------


# --- for training/ and the model facade -------------------------------------------------------------
# Activation checkpointing: transformers' ``GradientCheckpointingLayer`` checkpoints its forward through the
# function ``PreTrainedModel._set_gradient_checkpointing`` stores on it as ``_gradient_checkpointing_func``;
# the pipeline's stages are pruned copies, not a PreTrainedModel, so they set (and the glue reads) it themselves.
def set_checkpointing_function(module: torch.nn.Module, function: Any) -> None:
    """Give a transformers module the function its checkpointed forward runs through."""
    module._gradient_checkpointing_func = function


def checkpointing_function(module: torch.nn.Module) -> Any:
    """The function a transformers module's checkpointed forward runs through (torch's ``checkpoint`` by default)."""
    from torch.utils.checkpoint import checkpoint

    return getattr(module, "_gradient_checkpointing_func", None) or checkpoint


__all__ += ["checkpointing_function", "set_checkpointing_function"]


# --- for tools/ and the command line ----------------------------------------------------------------
# The profiler asks a torch schedule which stages it runs and whether it computes a loss: torch keeps
# both in private attributes (``_stages`` of a multi-stage schedule, ``_stage`` of a single-stage one,
# ``_loss_fn``); the public API has no accessor (a schedule's constructor arguments are not kept).
def schedule_stages(schedule: Any) -> list[Any]:
    """The pipeline stages a torch schedule runs (``[None]`` when it exposes none)."""
    return getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]


def schedule_has_loss(schedule: Any) -> bool:
    """Whether a torch schedule was built with a loss function (``loss_fn=`` of its constructor)."""
    return schedule._loss_fn is not None


# The memory report tells tensors sharing one storage apart by the storage's C object address:
# ``untyped_storage().data_ptr()`` is 0 for every meta tensor, and there is no public identity.
def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage that also tells meta-device storages apart."""
    return tensor.untyped_storage()._cdata


__all__ += ["schedule_has_loss", "schedule_stages", "storage_key"]


# --- for integrations/ (the Trainer) ---------------------------------------------------------------
# transformers.Trainer has no public hook for where its batches come from, how evaluation gathers, how a checkpoint
# is written and read back, how gradients are clipped, or which checkpoints rotation may remove (transformers removes
# any ``checkpoint-*`` folder): PipelineTrainer overrides these underscored methods (and calls the helpers listed after
# them on itself). Named here so that a transformers release renaming one fails a test
# (tests/integrations/test_trainer_single_process.py) instead of silently falling back to the Trainer's own behaviour.
TRAINER_OVERRIDES = (
    "_get_dataloader", "_set_signature_columns_if_needed", "_get_num_items_in_batch", "_track_num_input_tokens",
    "_clip_grad_norm", "_get_grad_norm", "_move_model_to_device", "_save_checkpoint", "_load_from_checkpoint",
    "_load_best_model", "_load_optimizer_and_scheduler", "_load_rng_state",
    "_finalize_training",  # its end-of-training removal with save_total_limit=1: only the Trainer's checkpoints
)
TRAINER_HELPERS = ("_remove_unused_columns", "_get_collator_with_removed_columns", "_get_output_dir", "_prepare_inputs")

__all__ += ["TRAINER_HELPERS", "TRAINER_OVERRIDES"]
# --- for integrations/ (trl's DPOTrainer): its ``_precompute_ref_logps`` reads per-process shards (overridden);
# its logged metrics (mode -> name -> values its ``log`` averages) and training token count have no public writer.
TRL_DPO_OVERRIDES, TRL_METRICS, TRL_TOKENS = ("_precompute_ref_logps",), "_metrics", "_total_train_tokens"
__all__ += ["TRL_DPO_OVERRIDES", "TRL_METRICS", "TRL_TOKENS"]
# --- for integrations/ (peft) ----------------------------------------------------------------------
# peft creates one adapter layer per target in the tuner's ``_create_and_replace`` and freezes the rest with
# ``_mark_only_adapters_as_trainable``; neither has a public equivalent. The integrations room replays the first per
# module (to draw each target's initial values from its one-process random state) and applies the second to a stage
# with no target (peft would raise there instead).
def peft_create_and_replace(tuner: Any) -> Any:
    """peft's per-target creation method of ``tuner``'s class (``_create_and_replace``), unbound."""
    return type(tuner)._create_and_replace


def peft_override_create_and_replace(tuner: Any, hook: Any | None) -> None:
    """Make ``hook`` the tuner's per-target creation (an instance attribute); None removes it again."""
    if hook is None:
        tuner.__dict__.pop("_create_and_replace", None)
    else:
        tuner.__dict__["_create_and_replace"] = hook


def peft_freeze_base(tuner: Any, module: torch.nn.Module) -> None:
    """Freeze every parameter of ``module`` that is not the tuner's adapter, as peft does after injecting."""
    tuner._mark_only_adapters_as_trainable(module)


# peft's methods replaced while a pipelined model is alive (integrations/peft_patches.py installs the wrappers and
# puts peft's own methods back; each wrapper calls peft's own method for any other model). peft has no extension point
# for a model whose modules are spread over ranks, and its entry points (``get_peft_model``,
# ``PeftModel.from_pretrained``, a PeftModel's methods) are called by the user on peft, with no call of this package
# around them: peft consults nothing on the model object that could route the injection (the tuner class comes from
# peft's registry keyed by the config's peft_type, and the tuner is built and injects inside PeftModel's constructor).
# (module, class, method, reason):
PEFT_PATCHED_METHODS = (
    ("peft.tuners.tuners_utils", "BaseTuner", "inject_adapter",
     "peft walks one process's modules by their local names and raises on a rank whose stages hold no target; "
     "a pipelined model injects stage by stage with one-process names and one-process initial values"),
    ("peft.peft_model", "PeftModel", "save_pretrained",
     "peft writes what the local process holds from every rank; a pipelined model gathers its adapter to rank 0, "
     "which writes it once under one-process keys"),
    ("peft.peft_model", "PeftModel", "load_adapter",
     "peft maps the file's keys to local module names; a pipelined model maps one-process keys to its stages"),
    ("peft.tuners.lora.layer", "ParamWrapper", "get_delta_factors", "an expert-parallel rank's parameter is a DTensor "
     "of its experts: the factors of all E experts are put on its mesh (integrations/peft_experts.py)"),
    ("peft.tuners.lora.layer", "ParamWrapper", "get_delta_weight", "the same for the delta (merge, several adapters)"),
    ("peft.tuners.lora.layer", "ParamWrapper", "_activate_lora", "transformers' ep kernels take the local part of "
     "unparametrized DTensor parameters only; the adapted one is given to them as its local part"),
)
# torch's parametrize.cached() has no public setter of what a parametrized tensor reads as (peft_experts.run_locally).
PARAMETRIZE_CACHE = ("torch.nn.utils.parametrize", "_cache")
# Module globals swapped only while ``PeftModel.load_adapter`` runs on a pipelined model (context managers in
# integrations/peft_patches.py): peft looks ``modules_to_save`` copies up by its own module names (``stages.1.
# classifier``), which a one-process file cannot have; it asks transformers for the model's weight conversions.
PEFT_WEIGHTS_READER = ("peft.peft_model", "load_peft_weights")
PEFT_CONVERSIONS = ("peft.utils.transformers_weight_conversion", "get_model_conversion_mapping")
# peft sizes the LoRA factors of a DTensor layer by its local shard; while injecting into a tensor-parallel stage
# it is given the whole layer's features (integrations/peft_tensor_parallel.py: the factors stay whole).
PEFT_FEATURES = ("peft.tuners.lora.layer", "_get_in_out_features")
__all__ += [
    "PARAMETRIZE_CACHE", "PEFT_CONVERSIONS", "PEFT_FEATURES", "PEFT_PATCHED_METHODS", "PEFT_WEIGHTS_READER",
    "peft_create_and_replace", "peft_freeze_base", "peft_override_create_and_replace",
]
# --- for loading/tensor_parallel ----------------------------------------------------------------------
# A packed weight (GPT-2's fused q, k, v) sharded block by block is torch's strided shard placement (what
# transformers' packed styles use too); it has no public name yet.
def strided_shard(dim: int, split_factor: int) -> Any:
    """A DTensor placement: ``split_factor`` blocks along ``dim``, each sharded over the mesh dim."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


__all__ += ["strided_shard"]
# --- for distributed/groups (renewing a tensor-parallel mesh) ----------------------------------------
# A DeviceMesh names its process groups (``_dim_group_names``) and looks each up by name on use; there is no public
# way to point a mesh at other groups. After a failure stopped the groups, the fresh mesh's names go into the old mesh
# object, so every DTensor, optimizer state and parallel style that holds that object (torch's Colwise/RowwiseParallel
# hooks capture it) communicates in the new groups.
def mesh_group_names(mesh: Any) -> list[str]:
    """The names of the process groups ``mesh`` communicates in, one per mesh dim."""
    return list(mesh._dim_group_names)


def set_mesh_group_names(mesh: Any, names: list[str]) -> None:
    """Make ``mesh`` communicate in the process groups named ``names`` (one per mesh dim, same ranks)."""
    mesh._dim_group_names = list(names)


__all__ += ["mesh_group_names", "set_mesh_group_names"]
# --- for loading/fsdp (a packed bias kept whole on each fsdp rank) ---------------------------------
# FSDP2 takes a per-parameter mesh from ``shard_placement_fn`` (``ShardPlacementResult``, its mesh info types have no
# public name yet), and a (fsdp ranks, 1) view of the fsdp mesh, sharing its root mesh so that FSDP can concatenate it
# with the tp mesh, comes from ``DeviceMesh._unflatten``.
def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``mesh`` (1-D) as a mesh of ``sizes`` named ``names`` over the same ranks (collective over the world)."""
    return mesh._unflatten(0, sizes, names)


def whole_placement(mesh: Any) -> Any:
    """A ``shard_placement_fn`` result: shard dim 0 over ``mesh``'s 1-rank dim 1, replicate over its dim 0
    (FSDP2 all-reduces the gradient over dim 0's ranks)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    return ShardPlacementResult(Shard(0), HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0))


__all__ += ["unflatten_mesh", "whole_placement"]
# ---- mixtures of experts: transformers' expert dispatch (no public entry point for one module) and router records
def install_expert_dispatch(
    experts: torch.nn.Module, mesh: Any, implementation: str, *, batch_mesh: Any = None
) -> None:
    """Make ``experts`` (whose stacked parameters hold this rank's experts) reach its tokens through
    transformers' ``EPImplementationInterface[implementation]`` over ``mesh``. ``batch_mesh`` is transformers'
    tp_mesh, the ranks sharing this rank's batch: by default ``mesh`` itself (ep mesh and tp mesh at once, as in
    transformers with ``ep_size == tp_size``); across replicas their tp ranks (size 1 without tensor parallelism),
    and transformers then exchanges the routed tokens all-to-all."""
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

    EpDispatchExpertsParallel().install_forward(
        experts, ep_mesh=mesh, tp_mesh=mesh if batch_mesh is None else batch_mesh, ep_implementation=implementation)


def router_logits_recorder(model_class: type) -> tuple[type, int] | None:
    """(router class, output index) transformers records as ``router_logits`` (``_can_record_outputs``)."""
    recorder = (getattr(model_class, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    return None if target is None else (target, int(getattr(recorder, "index", 0) or 0))


def experts_gate(experts: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """An experts module's own gating of its gate_up output, ``(..., 2I) -> (..., I)`` (transformers.integrations.moe:
    ``_apply_gate``, which ``use_experts_implementation`` gives every experts class, gpt-oss its own)."""
    return experts._apply_gate(gate_up)


__all__ += ["experts_gate", "install_expert_dispatch", "router_logits_recorder"]
