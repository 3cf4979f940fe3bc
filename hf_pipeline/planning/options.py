"""The one place where the options of a pipelined model get their defaults and checks.

Every entry point — ``from_pretrained(..., pipeline=True)``, the memory planner, the converter,
the CLI and the scripts — turns what the user passed into a :class:`PipelineOptions` with
:meth:`PipelineOptions.resolve`, so one checkpoint planned by ``hf-pipeline plan``, converted by
``hf-pipeline convert`` and loaded by the library is split the same way, with the same model
class, dtype, schedule and stage counts. The small parsers every entry point needs (dtypes,
sizes, model classes) live here too, once.

Example:
    >>> opts = PipelineOptions.resolve(config, world_size=4, auto_class="AutoModelForCausalLM", virtual_stages=2)
    >>> opts.schedule.name, opts.num_stages, opts.pp_size, opts.n_microbatches
    ('interleaved-1f1b', 8, 4, 8)
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import transformers

from ..checked_files import is_regular_file, read_json
from ..compat import auto_model_mapping
from ..errors import CheckpointNotFoundError, InputError
from ..families.recipe import list_recipes
from .ep_plan import ep_plan, without_experts
from .mesh_rules import check_fsdp_schedule
from .schedules import ScheduleSpec, check_layout, choose_schedule, default_schedule, get_schedule
from .tp_plan import ParallelRequest, ep_data_ranks, tp_plan

__all__ = [
    "SPLIT_METHODS", "PipelineOptions", "load_config", "model_class_for", "parse_dtype", "parse_size", "split_starts",
]

SPLIT_METHODS = ("auto", "recipe", "trace")

# Short names users write for dtypes (``--dtype bf16``), beside torch's own attribute names.
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def parse_dtype(dtype: Any, config=None) -> torch.dtype:
    """The floating point torch dtype for ``dtype``.

    ``None`` or ``"auto"`` mean what transformers' ``dtype="auto"`` means: the config's dtype,
    else the default float dtype. Strings may be torch's names (``"bfloat16"``, ``"torch.float16"``)
    or the short ones (``"bf16"``, ``"fp32"``, ``"half"``).
    """
    if dtype is None or dtype == "auto":
        dtype = (getattr(config, "dtype", None) if config is not None else None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise InputError(
                f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32', 'bfloat16' (or 'bf16') or torch.float16"
            )
        dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating point torch dtype (e.g. torch.bfloat16 or 'bf16'), got {dtype!r}")
    return dtype


def parse_size(size: int | str, *, what: str = "size") -> int:
    """Bytes in ``size``: an int, or ``"500MB"``, ``"2GB"``, ``"1.5GiB"``, ``"64KiB"``
    (transformers' ``max_shard_size`` forms).

    Decimal units are powers of 1000, binary ones (``KiB``, ``GiB``) of 1024.

    Raises:
        InputError: for anything else, or a size below 1 byte ("... must be positive").
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise InputError(f"cannot read the size {size!r} ({what}); write e.g. '500MB', '2GB' or a number of bytes")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", size.upper())
        if not m:
            raise InputError(f"cannot read the size {size!r} ({what}); write e.g. '500MB', '2GB' or a number of bytes")
        unit = m.group(2).rstrip("B")
        base = 1024 if unit.endswith("I") else 1000
        power = "KMGT".find(unit[:1]) + 1 if unit else 0
        value = int(float(m.group(1)) * base**power)
    if value < 1:
        raise InputError(f"{what} must be positive, got {size!r}")
    return value


def split_starts(split: str | Sequence[str] | Mapping[str, Any]) -> str | tuple[str, ...]:
    """``split`` in the form the planner takes: ``"auto"``, ``"uniform"`` or the names that start stages 1..S-1.

    Besides those, takes the ``split_spec`` form of ``torch.distributed.pipelining`` (and PiPPy): a
    dict of module names to torch's own ``SplitPoint``. ``SplitPoint.BEGINNING`` of X starts a stage
    at X; ``SplitPoint.END`` of X starts one at the module after X, the next block of X's list
    (``model.layers.9`` -> ``model.layers.10``). The entries keep their order, and the planner checks
    the names exactly as it checks a list of them (same messages).

    Example:
        >>> split_starts({"model.layers.4": SplitPoint.BEGINNING, "model.layers.9": SplitPoint.END})
        ('model.layers.4', 'model.layers.10')
    """
    if isinstance(split, str):
        return split
    if not isinstance(split, Mapping):
        return tuple(split)
    from torch.distributed.pipelining import SplitPoint

    starts: list[str] = []
    for name, point in split.items():
        if not isinstance(name, str):
            raise InputError(f"split keys must be module names (str), got {name!r}")
        if point == SplitPoint.BEGINNING:
            starts.append(name)
        elif point == SplitPoint.END:
            parent, _, index = name.rpartition(".")
            if not (parent and index.isdigit()):
                raise InputError(
                    f"split: SplitPoint.END of {name!r} needs a block of a module list (a name ending in its index, "
                    f"e.g. 'model.layers.9'); give the module that starts the next stage SplitPoint.BEGINNING instead"
                )
            starts.append(f"{parent}.{int(index) + 1}")
        else:
            raise InputError(
                f"split: the value for {name!r} must be torch.distributed.pipelining.SplitPoint.BEGINNING or "
                f"SplitPoint.END, got {point!r}"
            )
    return tuple(starts)


def model_class_for(config, auto_class: str | type | None = None) -> type:
    """The concrete transformers class a checkpoint with ``config`` is loaded as.

    ``auto_class`` may be an Auto class or its name (mapped through its model mapping, as
    transformers does: ``AutoModelForCausalLM`` + a LLaMA config -> ``LlamaForCausalLM``) or a
    concrete class (or its name). Without one: the config's ``architectures`` (what the checkpoint
    was saved as), else the head its kind suggests (seq2seq LM for encoder-decoders, masked LM for
    encoders, causal LM for decoders), else the base model.
    """
    if auto_class is None:
        for arch in getattr(config, "architectures", None) or ():
            if isinstance(getattr(transformers, arch, None), type):
                return getattr(transformers, arch)
        order = (
            ("AutoModelForSeq2SeqLM",)
            if config.is_encoder_decoder
            else ("AutoModelForMaskedLM", "AutoModelForCausalLM")
        )
        for name in order + ("AutoModel",):
            # An encoder with a masked-LM head (BERT) is planned as that; a decoder as a causal LM.
            if name == "AutoModelForMaskedLM" and getattr(config, "is_decoder", False):
                continue
            if type(config) in auto_model_mapping(getattr(transformers, name)):
                auto_class = name
                break
        else:
            raise InputError(f"transformers has no model class for config {type(config).__name__}; pass auto_class")
    if isinstance(auto_class, str):
        found = getattr(transformers, auto_class, None)
        if not isinstance(found, type):
            raise InputError(
                f"transformers has no class {auto_class!r}; use e.g. AutoModelForCausalLM, AutoModelForMaskedLM, "
                f"AutoModelForSeq2SeqLM or AutoModel"
            )
        auto_class = found
    mapping = auto_model_mapping(auto_class)
    if mapping is None:
        return auto_class  # already a concrete class
    try:
        return mapping[type(config)]
    except KeyError:
        raise InputError(
            f"{auto_class.__name__} has no model for config {type(config).__name__} "
            f"(model_type {config.model_type!r}); "
            f"pick the Auto class that matches the checkpoint"
        ) from None


# Sub-configs naming a tower for inputs other than text (Gemma 3's vision_config, Qwen2.5-VL's, LLaVA's):
# their models run the tower and merge its features into the text embeddings before the first layer.
NON_TEXT_TOWERS = ("vision", "audio", "speech", "video", "image")


def refuse_non_text(config, model_class: type) -> None:
    """Refuse, naming the class and its towers, a model that takes inputs other than text."""
    towers = sorted(
        name for name in getattr(config, "sub_configs", {}) or {}
        if any(kind in name for kind in NON_TEXT_TOWERS) and getattr(config, name, None) is not None
    )
    if towers:
        raise InputError(
            f"{model_class.__name__} is a multimodal model ({', '.join(towers)} besides its text model): pipeline=True "
            f"splits text-only language models, and running its tower on the first stage is not supported. Load it "
            f"without pipeline=True, or pipeline a text-only checkpoint of its language model "
            f"(AutoModelForCausalLM with its text_config)"
        )


def load_config(path_or_config: Any):
    """A transformers config from a config object, a dict, a config.json file or a checkpoint directory."""
    if isinstance(path_or_config, transformers.PretrainedConfig):
        return path_or_config
    if isinstance(path_or_config, dict):
        d = dict(path_or_config)
        if "model_type" not in d:
            raise InputError("a config dict needs a 'model_type' key (e.g. 'llama')")
        return transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    path = pathlib.Path(path_or_config).expanduser()
    if not path.is_dir() and is_regular_file(path, "the model config"):
        d = read_json(path, "the model config", expect=dict)
        if "model_type" not in d:
            raise InputError(f"{path} has no 'model_type'; pass the checkpoint directory or a transformers config.json")
        return transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    if path.is_dir():
        if not is_regular_file(path / "config.json", "the model config"):
            raise CheckpointNotFoundError(
                f"{path} has no config.json; pass a checkpoint directory, a config.json file or a config object"
            )
        read_json(path / "config.json", "the model config", expect=dict)  # truncated or foreign: named here
    # A directory, or a hub id already in the local cache: only config.json is read.
    return transformers.AutoConfig.from_pretrained(str(path_or_config))


def _base_class_name(config) -> str | None:
    """Name of the family's base model class for ``config`` (``BertModel``), if transformers has one."""
    mapping = auto_model_mapping(transformers.AutoModel)
    cls = mapping[type(config)] if type(config) in mapping else None
    return cls.__name__ if cls is not None else None


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive_if_given(**values: Any) -> None:
    for name, value in values.items():
        if value is not None:
            _positive(name, value)


def _stage_counts(
    spec: ScheduleSpec, world_size: int | None, virtual_stages: int | None, num_stages: int | None,
    parallel: ParallelRequest, traced: bool = False,
) -> tuple[int, int, int]:
    """(virtual_stages, num_stages, pp_size) with their defaults, checked against the world size and
    the tensor-parallel ranks per stage."""
    tp, fsdp = parallel.tp_size, parallel.fsdp_size
    if virtual_stages is None:
        virtual_stages = spec.default_virtual_stages()
    if world_size is not None and world_size % tp:
        raise InputError(f"tp_size={tp} does not divide the world size {world_size}; launch a multiple of {tp} ranks")
    if world_size is not None and world_size % (tp * fsdp):
        raise InputError(
            f"fsdp_size={fsdp} (x tp_size={tp}) does not divide the world size {world_size}; launch a multiple of "
            f"{tp * fsdp} ranks or change fsdp_size"
        )
    if num_stages is None:
        num_stages = (parallel.pp_size or (world_size or tp * fsdp) // (tp * fsdp)) * virtual_stages
    if num_stages % virtual_stages:
        raise InputError(f"num_stages={num_stages} is not a multiple of virtual_stages={virtual_stages}")
    pp_size = num_stages // virtual_stages
    if parallel.pp_size is not None and parallel.pp_size != pp_size:
        raise InputError(
            f"pp_size={parallel.pp_size} conflicts with num_stages={num_stages} / virtual_stages={virtual_stages}"
            f" = {pp_size} ranks per pipeline; pass one of them"
        )
    if world_size is not None and world_size % (pp_size * tp):
        with_tp = f" and tp_size={tp}" if tp > 1 else ""
        raise InputError(
            f"num_stages={num_stages} with virtual_stages={virtual_stages}{with_tp} needs a multiple of "
            f"{pp_size * tp} processes, but the world size is {world_size}; launch {pp_size * tp} (or k x "
            f"{pp_size * tp}) processes or change num_stages{' / tp_size' if tp > 1 else ''}"
        )
    data = (world_size or pp_size * tp * fsdp) // (pp_size * tp)  # data-parallel ranks: replicas x fsdp
    if data % fsdp:
        raise InputError(
            f"fsdp_size={fsdp} does not divide world size {world_size} / (pp_size {pp_size} x tp_size {tp}) = {data} "
            "data-parallel ranks (replicas of FSDP-sharded pipelines x fsdp_size); change num_stages or fsdp_size"
        )
    _refuse_with_fsdp(spec, fsdp, traced)
    replicas = data // fsdp
    if parallel.dp_size is not None and parallel.dp_size != replicas:
        with_fsdp = f" x fsdp_size {fsdp}" if fsdp > 1 else ""
        raise InputError(
            f"dp size {parallel.dp_size} (dp_replicate_size / the mesh's 'dp' dim) conflicts with world size "
            f"{world_size} / (pp_size {pp_size} x tp_size {tp}{with_fsdp}) = {replicas} pipeline replicas"
        )
    return virtual_stages, num_stages, pp_size


def _stage_plans(config, parallel: ParallelRequest, *, traced: bool, schedule: str, model_class: type):
    """``(tp_plan, ep_plan)`` of each stage: the expert rules take precedence over the tensor-parallel ones."""
    shards = tp_plan(config, parallel.tp_size, override=parallel.plan, traced=traced, schedule=schedule,
                     model_class=model_class.__name__)
    experts = ep_plan(config, parallel.ep_size, override=parallel.ep_plan, traced=traced,
                      implementation=parallel.ep_implementation, model_class=model_class.__name__)
    return without_experts(shards, experts), experts


def _data_ranks(world_size: int | None, pp_size: int, parallel: ParallelRequest) -> int:
    """Data-parallel ranks (replicas x fsdp): the world's, or without one (planning) one pipeline's fsdp ranks, or the
    replicas one ep group over data spans (``ep_over="data"``)."""
    return (world_size or pp_size * parallel.tp_size * max(parallel.fsdp_size, parallel.ep_data)) // (
        pp_size * parallel.tp_size)


def _refuse_with_fsdp(spec: ScheduleSpec, fsdp: int, traced: bool) -> None:
    """What FSDP stages cannot run: traced stages (no blocks to make units of) and the schedules of
    :data:`~hf_pipeline.planning.mesh_rules.FSDP_REFUSED_SCHEDULES`."""
    if fsdp > 1 and traced:
        raise InputError(
            f"fsdp_size={fsdp}: FSDP needs the stages of a recipe (its blocks are the FSDP units), and this model "
            "is split by the tracer (no recipe for its family or head); load it without fsdp_size"
        )
    check_fsdp_schedule(spec.name, fsdp)


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """How one model is pipelined; the same on every rank.

    Attributes:
        model_class: the concrete transformers class (``LlamaForCausalLM``).
        schedule: the training schedule (its layout also places the stages).
        virtual_stages: stages per rank.
        num_stages: stages in one pipeline.
        pp_size: ranks in one pipeline (``num_stages / virtual_stages``).
        dp_size: pipeline replicas (``world_size / (pp_size x tp_size)``; 1 when planning without a world).
        tp_size: tensor-parallel ranks per stage (1: none).
        fsdp_size: data-parallel ranks sharding each stage's parameters with FSDP2 (1: none).
        tp_plan: ``(module pattern, style)`` pairs sharding each stage (empty without tensor parallelism).
        ep_size: ranks splitting a stage's experts (1: none; ``tp_size``: the stage's own ranks; with
            ``ep_over="data"`` a multiple k > 1 of it: ``tp_size`` ranks times k consecutive replicas).
        ep_plan: ``(pattern, style)`` pairs splitting each stage's experts (empty without expert parallelism).
        ep_implementation: how tokens reach the experts (``planning/ep_plan.py``).
        ep_over: ``"stage"`` or ``"data"`` (:class:`~hf_pipeline.planning.tp_plan.ParallelRequest`).
        n_microbatches: microbatches per pipelined call.
        dtype: the weights' dtype.
        split: ``"auto"``, ``"uniform"`` or the names that start stages 1..S-1.
        traced: True when the stages come from the torch.export tracer instead of a recipe.
        schedule_note: for reports, how the schedule was picked when the user named none (which one,
            and why: the default's automatic choice, ``planning/auto_choice.py``, or
            :func:`~hf_pipeline.planning.schedules.choose_schedule`); "" when named.
        adapt_microbatches: ``n_microbatches`` was chosen by the default for a planned batch, not named:
            a call whose rows it cannot split runs the most that can
            (:func:`~hf_pipeline.planning.schedules.fitting_microbatches`) instead of being refused.
    """

    model_class: type
    schedule: ScheduleSpec
    virtual_stages: int
    num_stages: int
    pp_size: int
    dp_size: int
    n_microbatches: int
    dtype: torch.dtype
    split: str | tuple[str, ...]
    traced: bool
    schedule_note: str = ""
    adapt_microbatches: bool = False
    tp_size: int = 1
    tp_plan: tuple[tuple[str, str], ...] = ()
    fsdp_size: int = 1
    ep_size: int = 1
    ep_plan: tuple[tuple[str, str], ...] = ()
    ep_implementation: str = "auto"
    ep_over: str = "stage"

    def __post_init__(self) -> None:
        # Here, not in resolve, so options made with dataclasses.replace (auto_choice.with_schedule) are
        # checked too. Only what the placement needs: forward and generate run with any microbatch
        # count, and a training schedule's microbatch rules are checked when training starts (train.py).
        for name in ("virtual_stages", "num_stages", "pp_size", "dp_size", "n_microbatches", "tp_size", "fsdp_size",
                     "ep_size"):
            _positive(name, getattr(self, name))
        if self.ep_over == "stage" and self.ep_size > 1 and self.ep_size != self.tp_size:
            raise InputError(f"ep_size={self.ep_size} must equal the ranks of a stage, tp_size={self.tp_size}")
        if self.ep_data > 1 and self.dp_size % self.ep_data:
            raise InputError(
                f"ep_over='data' with ep_size={self.ep_size}: its experts span ep_size / tp_size = {self.ep_data} "
                f"data-parallel replicas, which must divide the {self.dp_size} replicas (world size / (pp_size "
                f"{self.pp_size} x tp_size {self.tp_size})); launch a multiple of {self.ep_data} replicas or change "
                "ep_size"
            )
        if self.ep_data > 1 and self.fsdp_size > 1 and self.fsdp_size % self.ep_data:
            # Over FSDP an ep group is k consecutive fsdp ranks of one sharded pipeline (torchtitan's layout; with
            # HSDP replicas, within each replica).
            raise InputError(
                f"ep_over='data' with ep_size={self.ep_size} and fsdp_size={self.fsdp_size}: its experts span "
                f"{self.ep_data} fsdp ranks, which must divide fsdp_size; change ep_size or fsdp_size"
            )
        if self.num_stages != self.pp_size * self.virtual_stages:
            raise InputError(
                f"num_stages={self.num_stages} must be pp_size x virtual_stages = "
                f"{self.pp_size} x {self.virtual_stages}"
            )
        check_layout(self.schedule, pp_size=self.pp_size, virtual_stages=self.virtual_stages)

    @property
    def ep_data(self) -> int:
        """Data-parallel replicas one expert-parallel group spans (1: experts within each stage)."""
        return ep_data_ranks(self.ep_size, self.tp_size, self.ep_over)

    @classmethod
    def resolve(
        cls,
        config,
        world_size: int | None = None,
        *,
        auto_class: str | type | None = None,
        schedule: str | None = None,
        virtual_stages: int | None = None,
        num_stages: int | None = None,
        n_microbatches: int | None = None,
        dtype: Any = None,
        split: str | Sequence[str] | Mapping[str, Any] = "auto",
        split_method: str = "auto",
        parallel: ParallelRequest | None = None,
        schedule_note: str | None = None,
        adapt_microbatches: bool = False,
    ) -> "PipelineOptions":
        """Defaults and checks for the options of ``config``'s model, before anything is built.

        Args:
            config: the transformers config.
            world_size: processes in the job; ``None`` when planning or converting without a job (then
                ``num_stages`` is taken as given, one pipeline, no data-parallel replicas but the
                ``ep_size / tp_size`` an ``ep_over="data"`` group spans).
            auto_class: see :func:`model_class_for`.
            schedule: a schedule name. Default: "1f1b", or "interleaved-1f1b" with virtual stages > 1,
                unless that cannot train ``n_microbatches``: then one that can, by the schedules'
                rules (:func:`~hf_pipeline.planning.schedules.choose_schedule`; ``schedule_note`` says
                which and why). A schedule the user names is kept, and refused at training if it cannot.
            virtual_stages: stages per rank (default: what the schedule needs, 1 or 2).
            num_stages: stages per pipeline (default: ``world_size x virtual_stages``).
            n_microbatches: default: the number of stages.
            dtype: see :func:`parse_dtype`.
            split: as ``from_pretrained``'s ``split`` (see :func:`split_starts`).
            split_method: "auto" (the recipe when ``config.model_type`` has one with a head for the
                model class, else the tracer),
                "recipe" or "trace".
            parallel: tensor-parallel ranks per stage, pipeline ranks, replicas and plan asked for
                (:func:`~hf_pipeline.planning.tp_plan.parallel_request`); default none.
            schedule_note, adapt_microbatches: set by the default's automatic choice, which picks the
                schedule and count before resolving (``planning/auto_choice.py``: ``choose_default``).

        Raises:
            InputError, ScheduleError: naming the option and what to change.
        """
        if split_method not in SPLIT_METHODS:
            raise InputError(f"split_method must be one of {list(SPLIT_METHODS)}, got {split_method!r}")
        model_class = model_class_for(config, auto_class)
        refuse_non_text(config, model_class)
        # "auto" traces what no recipe can split: a family without a recipe, or a model class whose head
        # the family's recipe lacks (GPT2ForMultipleChoice...); "recipe" lets planning raise naming the heads.
        recipe = list_recipes().get(config.model_type)
        traced = split_method == "trace" or (
            split_method == "auto"
            and (recipe is None or recipe.match_head(model_class.__name__, _base_class_name(config)) is None)
        )
        _positive_if_given(virtual_stages=virtual_stages, num_stages=num_stages)
        spec = get_schedule(default_schedule(virtual_stages) if schedule is None else schedule)
        parallel = (parallel or ParallelRequest()).stage_ranks
        counts = _stage_counts(spec, world_size, virtual_stages, num_stages, parallel, traced)
        virtual_stages, num_stages, pp_size = counts
        if n_microbatches is None:
            n_microbatches = num_stages
        note = ""
        if schedule is None:  # nothing asked for: a default that trains these microbatches, never a refusal
            _positive("n_microbatches", n_microbatches)
            spec, note = choose_schedule(pp_size=pp_size, virtual_stages=virtual_stages, n_microbatches=n_microbatches)
        note = note if schedule_note is None else schedule_note
        shards, experts = _stage_plans(config, parallel, traced=traced, schedule=spec.name, model_class=model_class)
        return cls(  # checks the placement and n_microbatches (__post_init__)
            model_class=model_class, schedule=spec, virtual_stages=virtual_stages, num_stages=num_stages,
            pp_size=pp_size,
            dp_size=_data_ranks(world_size, pp_size, parallel),
            n_microbatches=n_microbatches, dtype=parse_dtype(dtype, config), split=split_starts(split),
            traced=traced, schedule_note=note, adapt_microbatches=adapt_microbatches, tp_size=parallel.tp_size,
            tp_plan=shards, fsdp_size=parallel.fsdp_size,
            ep_size=parallel.ep_size, ep_plan=experts, ep_implementation=parallel.ep_implementation,
            ep_over=parallel.ep_over,
        )
