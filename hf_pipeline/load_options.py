"""Every keyword ``from_pretrained(..., pipeline=True)`` takes, defined once: :class:`LoadOptions`.

One field per option: its type, its default, what it does, the concern it belongs to, where it
acts and, where it has one, its command-line flag. Everything that names the options reads them
from here, so adding one is one field plus the code where it acts:

- ``auto.py``: the keywords ``from_pretrained`` accepts (:meth:`LoadOptions.from_kwargs`, with
  transformers' alias ``torch_dtype``, its arguments that change nothing here, and ``device_map``
  refused);
- :func:`hf_pipeline.model.load_pipelined` builds one :class:`LoadOptions` and hands it whole to
  :func:`hf_pipeline.loading.loader.load_pipeline`, which passes each concern where it acts
  (:meth:`LoadOptions.acting_in`): ``"resolve"`` to
  :meth:`~hf_pipeline.planning.options.PipelineOptions.resolve`, ``"mesh"`` to
  :func:`~hf_pipeline.planning.tp_plan.parallel_request`, ``"choose"`` to the automatic schedule
  choice, ``"read"`` to reading the checkpoint and its config, ``"place"`` to the rank's device and the
  progress bar, ``"output"`` to the model's calls;
- the command line: the ``model`` option group of ``generate``, ``serve`` and ``train`` is made from
  the fields with a flag (:func:`cli_fields`), and read back by ``cli.arguments.load_kwargs``;
- README's options table is :func:`options_table` (``tests/test_load_options.py`` holds README to it).

Values are checked where they act (the resolver, the mesh request, the reader), each naming the
option, so a value is refused the same way from the library, the CLI, the planner and the converter.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .errors import InputError, InputTypeError

__all__ = [
    "ACTS", "ALIASES", "CONCERNS", "NO_OPS", "LoadOptions", "cli_fields", "option_names", "options_table",
]

# Where an option acts (each read from the one LoadOptions by LoadOptions.acting_in(place)): the code that reads it.
ACTS = {
    "resolve": "`planning/options.py`: `PipelineOptions.resolve`",
    "choose": "`memory/auto_choice_costs.py`: `chooser`",
    "mesh": "`planning/tp_plan.py`: `parallel_request`",
    "read": "`loading/loader.py`: `load_pipeline`",
    "place": "`loading/loader.py`: `load_pipeline`",
    "output": "`model.py`: `PipelinedModel.forward`",
}
# The concerns, in the order README's table and the docs list them.
CONCERNS = ("pipeline", "mesh", "checkpoint", "placement")
# transformers' names for an option (alias -> option); the option wins when both are given, as in transformers.
ALIASES = {"torch_dtype": "dtype"}
# transformers' from_pretrained arguments that change nothing here, and why.
NO_OPS = {
    "low_cpu_mem_usage": "each rank always reads only its own tensors, straight into place",
    "local_files_only": "nothing is ever downloaded: a hub id must already be in the local cache",
}
_DEVICE_MAP = (
    "device_map={!r} is not supported with pipeline=True: the pipeline places the stages itself (one or more per rank, "
    "on cuda:LOCAL_RANK, else the CPU); choose the placement with num_stages / virtual_stages / split, force a device "
    "with device='cpu', or load with pipeline=False to use device_map"
)


def _option(default: Any, doc: str, *, concern: str, acts: str, cli: str | None = None, cli_type: str = "text",
            agree: bool = False) -> Any:
    """A field of :class:`LoadOptions`.

    Args:
        default: the value when the option is not given.
        doc: what it does, as README's options table says it.
        concern: one of :data:`CONCERNS`.
        acts: one of :data:`ACTS`: where the option is read.
        cli: the help of its command-line flag (``--name-with-dashes``); None: no flag.
        cli_type: how the CLI reads the flag's text: ``"positive"`` (an int >= 1), ``"device"`` or ``"text"``;
            ``"flag"``: a flag with no value, which sets the option to True.
        agree: compared across ranks as given (the rest are compared once resolved, or by content).
    """
    if concern not in CONCERNS or acts not in ACTS:
        raise InputError(f"an option's concern must be one of {CONCERNS} and acts one of {list(ACTS)}")
    meta = dict(doc=doc, concern=concern, acts=acts, cli=cli, cli_type=cli_type, agree=agree)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """What ``from_pretrained(path, pipeline=True, **options)`` was asked for, before anything is resolved.

    Each field's metadata holds its ``doc``, ``concern``, ``acts`` (where it is read), ``cli`` (its flag's
    help) and ``agree``; see :func:`_option`. The resolved, checked form is
    :class:`~hf_pipeline.planning.options.PipelineOptions`.
    """

    # ---------------------------------------------------------------- pipeline: split and schedule
    n_microbatches: int | str | None = _option(
        None, "microbatches per pipelined call; `\"auto\"`: chosen with `schedule`, see `tune_batch`. Named neither: "
        "chosen with the schedule (see `schedule`) as the most a call runs: a training step runs the count up to it "
        "that splits its rows with the shortest simulated step for its rows and length, a forward the most up to its "
        "rows; `schedule` named alone: the number of stages", concern="pipeline", acts="resolve",
        cli="microbatches per pipelined call (default: chosen with the schedule, or the number of stages when "
        "--schedule is given)", cli_type="positive")
    num_stages: int | None = _option(
        None, "total stages (default: world size x `virtual_stages`); fewer ranks per pipeline than the world size "
        "gives data-parallel replicas (pp x dp)", concern="pipeline", acts="resolve",
        cli="total pipeline stages (default: processes x --virtual-stages); fewer give data-parallel replicas (1: "
        "every process a whole model)", cli_type="positive")
    virtual_stages: int | None = _option(
        None, "stages per rank (interleaved schedules use 2+)", concern="pipeline", acts="resolve",
        cli="stages per process", cli_type="positive")
    schedule: str | None = _option(
        None, "`gpipe`, `1f1b`, `interleaved-1f1b`, `looped-bfs`, `interleaved-zero-bubble`, `zbv-zero-bubble`, "
        "`dualpipev`, or `\"auto\"` (the simulated fastest; see `tune_batch`). Named neither schedule nor "
        "`n_microbatches`: the simulated fastest schedule and count among the schedules of the default placement, "
        "keeping no more activations live than `1f1b` with one microbatch per stage (tp / ep / fsdp meshes too, a "
        "stage costed by one of its ranks); where that choice cannot plan (traced stages, encoder-decoders, one "
        "stage) `1f1b` "
        "(`interleaved-1f1b` with 2+ stages per rank). With `n_microbatches` named alone: that default, or, when it "
        "cannot train them, the schedule of the same layout with the smallest bubble that can. "
        "`model.options.schedule_note` and `hf-pipeline plan` say which and why. A schedule you name is refused with "
        "the reason instead",
        concern="pipeline", acts="resolve",
        cli="pipeline schedule (default: the simulated fastest of the default placement, else 1f1b; interleaved-1f1b "
        "with --virtual-stages > 1)")
    split: str | Sequence[str] | Mapping[str, Any] = _option(
        "auto", "`\"auto\"` (balanced by per-token compute, counting embedding and LM head; with several stages per "
        "rank, the split whose simulated training step of the chosen schedule and `n_microbatches` is shortest; may "
        "cut a block between its attention and MLP halves, see below), `\"uniform\"` (whole blocks), what starts "
        "stages 1..S-1: block names (`[\"model.layers.4\"]`) or a block's second half "
        "(`[\"model.layers.4.post_attention_layernorm\"]`), or torch's (and PiPPy's) `split_spec` form "
        "`{\"model.layers.4\": SplitPoint.BEGINNING}` (`BEGINNING` of a block starts a stage there, `END` starts "
        "one at the next block; same checks as names)", concern="pipeline", acts="resolve")
    split_method: str = _option(
        "auto", "`\"auto\"`: the recipe when the architecture has one, else the torch.export tracer; `\"recipe\"`; "
        "`\"trace\"` (forward and training, no generation)", concern="pipeline", acts="resolve", agree=True)
    tune_batch: tuple[int, int] | None = _option(
        None, "with `schedule=\"auto\"` / `n_microbatches=\"auto\"`, or neither named: the `(batch, seq)` of the "
        "training steps the choice plans for (default `(8 x world size, 512)`; kept as `model.auto_choice`)",
        concern="pipeline", acts="choose")
    max_memory: int | str | None = _option(
        None, "with `schedule=\"auto\"` / `n_microbatches=\"auto\"`, or neither named: a per-rank budget (bytes or "
        "`\"20GiB\"`) for the candidates' predicted training peak on the mesh (weights, gradients, AdamW state, "
        "activations of the rank's routed tokens)", concern="pipeline", acts="choose")
    # ---------------------------------------------------------------- mesh: parallelism inside each stage
    tp_size: int | None = _option(
        None, "tensor-parallel ranks per stage (families with a tensor-parallel plan; default 1)", concern="mesh",
        acts="mesh", cli="tensor-parallel processes per stage (LLaMA, Mistral, Qwen2; default 1)",
        cli_type="positive")
    fsdp_size: int | None = _option(
        None, "data-parallel ranks sharding each stage's parameters with FSDP2 (default 1)", concern="mesh",
        acts="mesh", cli="data-parallel processes sharding each stage's parameters with FSDP (default 1)",
        cli_type="positive")
    ep_size: int | None = _option(
        None, "expert-parallel ranks per stage for a mixture of experts (its `base_model_ep_plan`): the stage's "
        "tensor-parallel ranks (equal to `tp_size`), or alone: that many ranks per stage splitting only the experts",
        concern="mesh", acts="mesh",
        cli="expert-parallel processes per stage, mixtures of experts (default 1)", cli_type="positive")
    ep_over: str | None = _option(
        None, "which ranks `ep_size` spans: `\"stage\"` (default: each stage's own batch-sharing ranks) or "
        "`\"data\"`: `tp_size` ranks times `ep_size / tp_size` data-parallel replicas, the routed tokens exchanged "
        "all-to-all (transformers' `ep_size > tp_size`, implied by a `DistributedConfig` asking for it; plain "
        "replicas or fsdp ranks; `generate` (beam search too) and serving step them in lock step)", concern="mesh",
        acts="mesh",
        cli="which processes --ep-size spans: stage (default) or data (data-parallel replicas)",
        cli_type="text")
    distributed_config: Any = _option(
        None, "transformers' `DistributedConfig(tp_size, tp_plan, ep_size, ep_plan, ep_implementation, fsdp_size, "
        "dp_replicate_size, pp_size)`, instead of `tp_size` / `fsdp_size` / `ep_size`", concern="mesh", acts="mesh")
    device_mesh: Any = _option(
        None, "a `DeviceMesh` with dims named from `dp`, `fsdp`, `pp`, `tp`, instead of `tp_size` / `fsdp_size` / "
        "`ep_size`", concern="mesh", acts="mesh")
    # ---------------------------------------------------------------- checkpoint: what is read, as transformers
    dtype: Any = _option(
        None, "weights dtype (default: the config's, as transformers; `torch_dtype` is its alias, and `dtype` wins "
        "when both are given)", concern="checkpoint", acts="resolve",
        cli="float32, bfloat16, float16 or auto (the checkpoint's)", cli_type="text")
    attn_implementation: str | None = _option(
        None, "`\"eager\"`, `\"sdpa\"`, ...: the attention every stage runs, set on the config and checked by "
        "transformers as in its own `from_pretrained`", concern="checkpoint", acts="read", agree=True)
    revision: str | None = _option(
        None, "as transformers': which snapshot of a hub id (in the local cache)", concern="checkpoint", acts="read")
    cache_dir: str | os.PathLike | None = _option(
        None, "as transformers': the local cache a hub id is looked up in", concern="checkpoint", acts="read")
    subfolder: str = _option(
        "", "as transformers': the folder inside the directory or snapshot that holds the checkpoint",
        concern="checkpoint", acts="read")
    config: Any = _option(
        None, "a transformers config to build the stages from instead of the checkpoint's `config.json`",
        concern="checkpoint", acts="read")
    trust_remote_code: bool = _option(
        False, "`True` is refused for a checkpoint that ships its own modelling code (`auto_map` in config.json): "
        "stages are built from transformers' classes only; elsewhere it changes nothing", concern="checkpoint",
        acts="read", agree=True)
    # ---------------------------------------------------------------- placement: devices, outputs, progress
    device: Any = _option(
        None, "force a device (`\"cpu\"`); default `cuda:LOCAL_RANK` when CUDA is available, else the CPU",
        concern="placement", acts="place", cli="force a device type, e.g. cpu", cli_type="device")
    compile: bool | dict | None = _option(
        None, "`True`: each stage's blocks compiled with `torch.compile`, one block at a time (regional, as "
        "torchtitan); a dict: its `torch.compile` arguments (`backend`, `mode`, `dynamic`, `fullgraph`, `options`)",
        concern="placement", acts="place", cli="compile each stage's blocks with torch.compile", cli_type="flag",
        agree=True)
    gather_output: bool = _option(
        True, "`True`: every rank gets the full output; `False`: only the last stage's rank", concern="placement",
        acts="output", agree=True)
    progress: bool | None = _option(
        None, "a progress bar while reading weights (default: on the main process)", concern="placement",
        acts="place")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "LoadOptions":
        """The options from what a transformers user passes to ``from_pretrained``.

        Aliases become their names (:data:`ALIASES`; the option wins when both are given, as in transformers),
        :data:`NO_OPS` are dropped, ``device_map`` is refused.

        Raises:
            InputTypeError: a keyword ``pipeline=True`` does not take (a ``TypeError``), naming the ones it does.
            InputError: ``device_map``.
        """
        kwargs = dict(kwargs)
        for alias, name in ALIASES.items():
            value = kwargs.pop(alias, None)
            if kwargs.get(name) is None and value is not None:
                kwargs[name] = value
        for name in NO_OPS:
            kwargs.pop(name, None)
        device_map = kwargs.pop("device_map", None)
        if device_map is not None:
            raise InputError(_DEVICE_MAP.format(device_map))
        unknown = sorted(set(kwargs) - set(option_names()))
        if unknown:
            raise InputTypeError(
                f"unexpected argument(s) {unknown} with pipeline=True; supported: {list(option_names())}, "
                f"{', '.join(f'{a} (an alias of {n})' for a, n in ALIASES.items())}, and accepted without effect: "
                f"{list(NO_OPS)}"
            )
        return cls(**kwargs)

    def acting_in(self, place: str) -> dict[str, Any]:
        """The options read in ``place`` (one of :data:`ACTS`), as keyword arguments."""
        if place not in ACTS:
            raise InputError(f"no options act in {place!r}; the places are {list(ACTS)}")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["acts"] == place}

    def agreed_as_given(self) -> dict[str, Any]:
        """The options every rank must have given alike, compared as given (the rest are compared resolved)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["agree"]}


def option_names() -> tuple[str, ...]:
    """Every option's name, in definition order."""
    return tuple(f.name for f in dataclasses.fields(LoadOptions))


def cli_fields() -> tuple[dataclasses.Field, ...]:
    """The options that have a command-line flag (``--name-with-dashes``) in the ``model`` group."""
    return tuple(f for f in dataclasses.fields(LoadOptions) if f.metadata["cli"] is not None)


def options_table() -> str:
    """README's options table (markdown), from the fields, the aliases, the no-ops and the refused ``device_map``."""
    rows = ["| option | default | meaning | read in |", "|---|---|---|---|"]
    for concern in CONCERNS:
        rows += [f"| `{f.name}` | `{f.default!r}` | {f.metadata['doc']} | {ACTS[f.metadata['acts']]} |"
                 for f in dataclasses.fields(LoadOptions) if f.metadata["concern"] == concern]
    rows += [f"| `{alias}` | | alias of `{name}` (`{name}` wins when both are given, as in transformers) | |"
             for alias, name in ALIASES.items()]
    rows.append(f"| {', '.join(f'`{n}`' for n in NO_OPS)} | | accepted, no effect: "
                + "; ".join(why for why in NO_OPS.values()) + " | |")
    rows.append("| `device_map` | | refused: the pipeline places its stages itself (choose with `num_stages`, "
                "`virtual_stages`, `split`; force a device with `device=`) | `auto.py` |")
    return "\n".join(rows)
