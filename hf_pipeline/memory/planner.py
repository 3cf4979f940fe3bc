"""Memory planner: what each pipeline rank will hold, predicted from the config without reading weights.

For a checkpoint directory (only ``config.json`` is read), a config file or a config object, and a
split (``stages``, ``virtual_stages``, ``schedule``), :func:`plan_report` gives per stage: the
modules, parameters and weight bytes (from the meta-device model, as the loader will allocate
them), the activation bytes one microbatch keeps alive for backward, the tensor sent to the next
stage, and the KV-cache bytes per token; and per rank the predicted peak for training and for
generation.

How the numbers are obtained:
  * weights: parameter shapes x dtype, the same stage modules the loader materialises.
  * activations per microbatch: the stage modules are run once in training mode on *fake* tensors
    (``torch._subclasses.FakeTensorMode``: shapes and dtypes only, nothing allocated) and every
    tensor autograd saves for backward is summed, de-duplicated by storage, parameters excluded.
    That is exactly what the real forward keeps (the same HF code runs), for every family and
    dtype (bf16 RMSNorm upcasts included). The last stage adds the cross entropy over its outputs
    (the log-probabilities it saves in fp32). Assumes unpadded batches (``is_causal`` attention).
  * a mixture of experts: a rank holds ``E / ep_size`` experts of each MoE layer (the loader's cut), and
    its experts modules run a shape-static stand-in on a fixed number of token-expert pairs
    (:mod:`.routed_experts`; ``moe_routing="worst"``, an upper bound, or ``"balanced"``), since the
    routing's shapes depend on the data. With experts over data-parallel ranks (``ep_over="data"``) those pairs
    are of the tokens of the ep group's ``ep_size / tp_size`` replicas (each with its own rows, as ``batch`` is
    one replica's), while the rest of the stage runs the rank's own rows.
  * KV cache per token: from the config, 2 (K and V) x KV heads x head dim x itemsize per
    decoder layer (+ the cross-attention cache per encoder token of encoder-decoders).
  * KV cache of a request: per decoder layer, the tokens the cache transformers' generate builds
    (``DynamicCache(config=...)``) keeps for that layer's kind: all of them for full attention, at
    most ``sliding_window`` for a sliding-window layer (:func:`kv_cache_tokens`).
  * in-flight microbatches: the rank's own action list from torch's schedule
    (:func:`hf_pipeline.planning.actions.schedule_actions`): activations are live from F until B (or W).
  * training peak = weights + gradients (same dtype) + peak live activations + P2P receive buffers
    (torch allocates one activation and one gradient buffer per microbatch). Optimizer states are
    not included (Adam adds 2 x fp32 parameters); neither is transient per-op workspace.
  * generation peak = weights + the KV cache for ``batch`` sequences of ``seq`` tokens while decoding.
    Right after a prompt longer than a sliding window is prefilled, a sliding layer still holds the
    whole prompt's keys and values, until its first decoding step; that moment is not included.

Example:
    >>> report = plan_report("path/to/llama", stages=4, dtype="bf16", batch=8, seq=2048)
    >>> print(report)                 # the stage table and the per-rank peaks
    >>> report.to_json()              # the same, for machines

The report's types (:class:`~hf_pipeline.memory.report.MemoryReport` and its rows) live in
:mod:`.report`; what autograd saves is counted by :mod:`.saved_tensors`.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import transformers
from torch import nn

from ..errors import InputError
from ..loading.checkpoint_files import resolve_checkpoint
from ..loading.stages import StageModule, build_stage, recipe_front_end
from ..planning.actions import peak_in_flight, schedule_actions
from ..planning.ep_plan import num_experts
from ..planning.kv_cache_sizes import config_attr, kv_cache_bytes, kv_cache_bytes_per_token, kv_cache_tokens
from ..planning.moe_costs import experts_per_token
from ..planning.options import PipelineOptions, load_config
from ..planning.plan import StagePlan
from ..planning.resolve import ResolvedRecipe
from ..planning.schedules import check_training
from ..planning.tp_plan import ParallelRequest
from ..recompute.layers import CheckpointingSettings, apply_checkpointing
from .mesh_shares import ep_local_shapes, fsdp_unit_bytes, local_shapes
from .report import MemoryReport, RankMemory, StageMemory
from .routed_experts import static_experts
from .saved_tensors import CheckpointProbe, measure_saved_bytes

__all__ = ["plan_report"]

# ----------------------------------------------------------------------------- measurements
def _loss_saved_bytes(out: torch.Tensor, params=()) -> int:
    # The cross entropy a head's loss computes: transformers' losses upcast to fp32 and keep the
    # log-probabilities (same shape as the logits) for backward.
    logits = out.float().reshape(-1, out.shape[-1])
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    nbytes, _ = measure_saved_bytes(lambda: nn.functional.cross_entropy(logits, target), params)
    return nbytes


@contextlib.contextmanager
def _eager_decisions() -> Iterator[None]:
    # Under fake tensors transformers takes its tracing branch: it cannot read the position ids, so
    # it assumes packed sequences and builds a full float mask instead of using is_causal attention.
    # The planner's position ids are a plain arange (no packing), which the eager run detects; say so.
    import transformers.masking_utils as masking

    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _fake_stage(stage: StageModule, mode, dtype: torch.dtype, shapes: dict[str, tuple] | None = None) -> None:
    """Give a meta stage fake CPU parameters (ties kept; of ``shapes`` where given: a tensor-parallel
    rank's slices) and fake copies of its buffers."""
    made: dict[int, nn.Parameter] = {}
    for name, p in list(stage.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        owner = stage.get_submodule(owner_name)
        if id(p) not in made:
            shape = (shapes or {}).get(name, p.shape)
            with mode:
                made[id(p)] = nn.Parameter(torch.empty(shape, dtype=dtype if p.is_floating_point() else p.dtype),
                                           requires_grad=p.requires_grad)
        setattr(owner, attr, made[id(p)])  # nn.Module registers a Parameter (or replaces it)
    for name, b in list(stage.named_buffers()):
        owner_name, _, attr = name.rpartition(".")
        owner = stage.get_submodule(owner_name)
        setattr(owner, attr, mode.from_tensor(b if not b.is_meta else torch.zeros(b.shape, dtype=b.dtype)))


def _dummy_inputs(config, microbatch: int, seq: int) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": torch.zeros((microbatch, seq), dtype=torch.long)}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.zeros((microbatch, seq), dtype=torch.long)
    return inputs


@dataclass(frozen=True, kw_only=True)
class _StageRun:
    activation_bytes: int  # saved for backward by one microbatch (loss included on the last stage)
    loss_bytes: int
    send_bytes: int  # tensors sent to the next stage per microbatch
    recv_bytes: int  # tensors received from the previous stage per microbatch
    checkpointed_bytes: int  # kept for backward by one microbatch with activation checkpointing (loss included)
    recompute_bytes: int  # with checkpointing: how far a microbatch's backward (its recomputes) goes above that
    tp_saved: tuple[int, int]  # (parameters, bytes) of the stage's that a tensor-parallel rank does not hold
    expert_bytes: int  # of the rank's parameters, its experts' (fsdp leaves them whole with ep_over="data")
    units: list[int]  # parameter bytes of each unit fsdp would gather whole (blocks, then the rest)


def _run_stages_fake(skeleton: nn.Module, resolved: ResolvedRecipe, plan: StagePlan, *, microbatch: int, seq: int,
                     has_loss: bool, every_n_layers: int = 1, options: PipelineOptions,
                     moe_routing: str = "worst") -> list[_StageRun]:
    """Run every stage once in training mode on fake tensors, with the parameter shapes one rank of a stage
    holds under ``options`` (tensor-parallel slices, its experts) and a mixture of experts' routing priced
    by ``moe_routing`` (:mod:`.routed_experts`); measure what each saves and sends."""
    from ..compat import FakeTensorMode

    stages = [build_stage(skeleton, resolved, spec) for spec in plan.stages]  # deepcopy outside the fake mode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    results: list[_StageRun] = []
    with _eager_decisions(), static_experts(stages, skeleton.config, routing=moe_routing, group=options.ep_data):
        shapes = [local_shapes(stage, options) for stage in stages]
        itemsize = torch.empty((), dtype=plan.dtype).element_size()
        cut = [ep_local_shapes(stage, options.ep_plan, options.ep_size) for stage in stages]
        experts = [itemsize * sum(math.prod(v) for v in c.values()) for c in cut]
        # with experts over data FSDP leaves the experts out (ignored_params): its units are the rest
        units = [fsdp_unit_bytes(stage, shape, itemsize, skip=c if options.ep_data > 1 else ())
                 for stage, shape, c in zip(stages, shapes, cut)]
        saved = [(n := sum(stage.get_parameter(k).numel() - math.prod(v) for k, v in shape.items()), n * itemsize)
                 for stage, shape in zip(stages, shapes)]
        for stage, shape in zip(stages, shapes):
            _fake_stage(stage, mode, plan.dtype, shape)
            stage.train()
        with mode:
            inputs = stages[0].glue.prepare_inputs(skeleton, _dummy_inputs(skeleton.config, microbatch, seq))
            received: tuple[torch.Tensor, ...] = ()
            for stage, unit in zip(stages, units):
                params = list(stage.parameters())
                # Bound now (defaults): the call runs inside measure_saved_bytes, before the loop moves on.
                def run(stage=stage, received=received):
                    return stage(*received, **inputs)

                nbytes, out = measure_saved_bytes(run, params)
                # Again with the layers activation_checkpointing_enable(every_n_layers=...) checkpoints.
                probe = CheckpointProbe(params)
                settings = CheckpointingSettings(every_n_layers=every_n_layers)
                apply_checkpointing([stage], skeleton, settings, torch.device("cpu"), function=probe)
                kept, _ = probe.measure(run)
                apply_checkpointing([stage], skeleton, None, torch.device("cpu"))
                outs = out if isinstance(out, tuple) else (out,)
                loss = 0
                if stage.spec.is_last and has_loss and outs[0].is_floating_point():
                    loss = _loss_saved_bytes(outs[0], params)
                send = 0 if stage.spec.is_last else sum(t.numel() * t.element_size() for t in outs)
                recv = sum(t.numel() * t.element_size() for t in received)
                results.append(_StageRun(activation_bytes=nbytes + loss, loss_bytes=loss, send_bytes=send,
                                         recv_bytes=recv, checkpointed_bytes=kept + loss,
                                         recompute_bytes=probe.backward_extra_bytes, units=unit,
                                         tp_saved=saved[stages.index(stage)],
                                         expert_bytes=experts[stages.index(stage)]))
                # as torch's PipelineStage does: the next stage gets detached leaves that require grad
                received = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outs)
    return results


def plan_report(
    path_or_config: Any,
    *,
    stages: int = 2,
    virtual_stages: int | None = None,
    schedule: str | None = None,
    dtype: Any = None,
    batch: int = 1,
    seq: int | None = None,
    n_microbatches: int | None = None,
    auto_class: str | type = "AutoModelForCausalLM",
    split: str | Sequence[str] = "auto",
    checkpoint_every_n_layers: int = 1,
    tp_size: int = 1,
    ep_size: int = 1,
    ep_over: str = "stage",
    moe_routing: str = "worst",
    schedule_note: str | None = None,
) -> MemoryReport:
    """Predict per-stage and per-rank memory without reading any weights.

    Args:
        path_or_config: a checkpoint directory (only config.json is read), a config.json file, a
            config dict (with ``model_type``) or a transformers config.
        stages: total number of pipeline stages (as ``num_stages`` of ``from_pretrained``).
        virtual_stages: stages per rank (default: 1, or 2 for schedules that need several).
        schedule: schedule name (default "1f1b", or "interleaved-1f1b" with virtual stages).
        dtype: weights dtype ("bf16", "fp32", ...; default the config's).
        batch: global batch (sequences) per step; for generation, sequences decoded together.
        seq: tokens per sequence (default min(max positions, 2048)); for generation, prompt + new tokens.
        n_microbatches: microbatches per step (default: the number of stages, as the loader).
        auto_class: transformers Auto class the model is loaded as.
        split: as ``from_pretrained``'s ``split``.
        checkpoint_every_n_layers: the activation checkpointing (``every_n_layers`` of
            ``activation_checkpointing_enable``) the report's "with checkpointing" figures assume.
        tp_size: tensor-parallel ranks per stage: the figures are one such rank's (its parameter slices,
            heads; see :mod:`.mesh_report`, whose ``mesh_report`` adds fsdp and replicas).
        ep_size: expert-parallel ranks per stage (``tp_size``'s, or alone): one such rank's ``E / ep_size`` experts.
        ep_over: ``"stage"`` or ``"data"`` (over ep_size / tp_size replicas, ``batch`` one's rows; :mod:`.mesh_report`).
        moe_routing: the token-expert pairs a rank's experts are priced at (:mod:`hf_pipeline.planning.moe_costs`):
            ``"worst"`` (an upper bound) or ``"balanced"``.
        schedule_note: how the schedule was chosen, when it was before (the default's choice, ``hf-pipeline plan``).

    Returns:
        :class:`MemoryReport`.
    """
    if isinstance(path_or_config, (str, os.PathLike)) and not pathlib.Path(path_or_config).expanduser().exists():
        path_or_config = resolve_checkpoint(path_or_config)  # a hub id: its cached snapshot, never the network
    config = load_config(path_or_config)
    options = PipelineOptions.resolve(
        config, auto_class=auto_class, schedule=schedule, virtual_stages=virtual_stages, num_stages=stages,
        n_microbatches=n_microbatches, dtype=dtype, split=split, split_method="recipe",
        parallel=ParallelRequest(tp_size=tp_size, ep_size=ep_size, ep_over=ep_over), schedule_note=schedule_note,
    )
    spec, pp_size, virtual_stages, m = options.schedule, options.pp_size, options.virtual_stages, options.n_microbatches
    seq = _checked_shape(options, config, batch=batch, seq=seq)
    # The loader's own front end: the planner predicts the stages from_pretrained builds.
    maker = recipe_front_end(config, options)
    skeleton, resolved, plan = maker.skeleton, maker.resolved, maker.plan
    # Microbatches: torch splits the (padded) batch into m equal chunks; a batch smaller than m
    # still runs one sequence per microbatch at most.
    microbatch = max(1, math.ceil(batch / m))
    has_loss = resolved.head.loss is not None
    runs = _run_stages_fake(skeleton, resolved, plan, microbatch=microbatch, seq=seq, has_loss=has_loss,
                            every_n_layers=CheckpointingSettings(every_n_layers=checkpoint_every_n_layers).every_n_layers,
                            options=options, moe_routing=moe_routing)
    generative = bool(getattr(skeleton, "can_generate", lambda: False)())
    stage_rows = _stage_rows(config, resolved, plan, runs, generative=generative, dtype=options.dtype, batch=batch,
                             seq=seq, tp_size=options.tp_size if options.tp_plan else 1)  # ep alone: heads whole
    orders = schedule_actions(spec, pp_size=pp_size, n_microbatches=m, virtual_stages=virtual_stages, training=True)
    rank_rows = [_rank_row(rank, stage_rows, orders[rank], n_microbatches=m) for rank in range(pp_size)]
    is_config = isinstance(path_or_config, (transformers.PretrainedConfig, dict))
    return MemoryReport(
        model=config.model_type if is_config else str(path_or_config),
        model_class=plan.model_class, dtype=str(options.dtype).removeprefix("torch."), num_stages=plan.num_stages,
        pp_size=pp_size, virtual_stages=virtual_stages, schedule=spec.name, batch=batch, seq=seq, n_microbatches=m,
        microbatch_size=microbatch, stages=tuple(stage_rows), ranks=tuple(rank_rows), total_params=plan.total_params,
        total_weight_bytes=plan.total_bytes, checkpoint_every_n_layers=checkpoint_every_n_layers,
        notes=_report_notes(config, options, generative=generative, seq=seq, moe_routing=moe_routing),
    )


def _report_notes(config, options: PipelineOptions, *, generative: bool, seq: int, moe_routing: str) -> tuple[str, ...]:
    """The report's notes: how the schedule was chosen, what the figures include, how experts were priced."""
    return (*filter(None, [options.schedule_note]), *_notes(config, generative=generative, seq=seq),
            *_moe_notes(config, routing=moe_routing, ep_size=options.ep_size, group=options.ep_data))


def _checked_shape(options: PipelineOptions, config, *, batch: int, seq: int | None) -> int:
    """The sequence length planned for (default min(max positions, 2048)), once the options train (the planner
    plans training) and ``batch`` is positive."""
    check_training(options.schedule, pp_size=options.pp_size, virtual_stages=options.virtual_stages,
                   n_microbatches=options.n_microbatches)
    if batch < 1:
        raise InputError(f"batch must be >= 1, got {batch}")
    if seq is None:
        seq = int(min(config_attr(config, "max_position_embeddings", "n_positions", default=2048) or 2048, 2048))
    return seq


def _stage_rows(
    config, resolved, plan, runs, *, generative: bool, dtype: torch.dtype, batch: int, seq: int, tp_size: int = 1
) -> list[StageMemory]:
    """One :class:`StageMemory` per stage: its plan entry, its fake run's activations and its KV cache."""
    decoder = resolved.stacks[-1].blocks
    rows = []
    for s, run in zip(plan.stages, runs):
        # The stack that decodes, and so keeps a KV cache, is the last one in execution order (the only
        # stack of a decoder-only model; an encoder-decoder's decoder); earlier stacks run once per request.
        layers = [decoder.index(b) for b in s.attention_blocks if b in decoder] if generative else []
        rows.append(StageMemory(  # a tensor-parallel rank's share: its parameter slices, KV heads / tp
            index=s.index, rank=s.rank, modules=s.modules, params=s.params - run.tp_saved[0],
            weight_bytes=s.nbytes - run.tp_saved[1], largest_unit_bytes=max(run.units), expert_bytes=run.expert_bytes,
            activation_bytes=run.activation_bytes, send_bytes=run.send_bytes, recv_bytes=run.recv_bytes,
            checkpointed_activation_bytes=run.checkpointed_bytes, recompute_bytes=run.recompute_bytes,
            kv_bytes_per_token=kv_cache_bytes_per_token(config, decoder_layers=len(layers), dtype=dtype) // tp_size,
            kv_cache_bytes=kv_cache_bytes(config, layers=layers, dtype=dtype, batch=batch, seq=seq) // tp_size,
        ))
    return rows


def _rank_row(rank: int, stage_rows: list[StageMemory], order: list[str], *, n_microbatches: int) -> RankMemory:
    """Rank ``rank``'s totals: its stages' weights and gradients, its live activations under ``order``."""
    mine = [st for st in stage_rows if st.rank == rank]
    weights = sum(st.weight_bytes for st in mine)
    act, in_flight = peak_in_flight(order, {st.index: st.activation_bytes for st in mine})
    # With checkpointing: what the microbatches in flight keep, plus how far one's backward (a recompute) goes above.
    kept, _ = peak_in_flight(order, {st.index: st.checkpointed_activation_bytes for st in mine})
    kept += max((st.recompute_bytes for st in mine), default=0)
    # PipelineStage keeps one receive buffer per microbatch: activations in, gradients back.
    p2p = sum(n_microbatches * (st.recv_bytes + st.send_bytes) for st in mine)
    kv_cache = sum(st.kv_cache_bytes for st in mine)
    return RankMemory(
        rank=rank, stages=tuple(st.index for st in mine), weight_bytes=weights, grad_bytes=weights,
        in_flight=in_flight, activation_bytes=act, p2p_buffer_bytes=p2p,
        train_peak_bytes=2 * weights + act + p2p, checkpointed_activation_bytes=kept,
        checkpointed_train_peak_bytes=2 * weights + kept + p2p, kv_cache_bytes=kv_cache,
        generate_peak_bytes=weights + kv_cache,
    )


def _moe_notes(config, *, routing: str, ep_size: int, group: int = 1) -> list[str]:
    """How a mixture of experts was priced (nothing for a dense model); ``group``: the replicas an ep group spans."""
    experts, top_k = num_experts(config), experts_per_token(config)
    if experts is None or top_k is None:
        return []
    held = f"{experts // ep_size} of {experts} experts per MoE layer (ep_size={ep_size})" if ep_size > 1 else (
        f"all {experts} experts per MoE layer")
    pairs = (f"tokens x min(top_k, experts held) = tokens x {min(top_k, experts // ep_size)} token-expert pairs, "
             "an upper bound (every token's top_k experts on this rank)" if routing == "worst" else
             f"tokens x top_k / ep_size = tokens x {top_k / ep_size:g} token-expert pairs (evenly routed; a "
             "skewed batch goes above)")
    if group > 1:
        pairs += (f", of the tokens of the {group} data-parallel ranks of its ep group (ep_over='data'): "
                  f"{group} x its own")
    return [f"mixture of experts: a rank holds {held}; activations priced at {pairs}; the split weighs an experts "
            f"module by the {top_k} of {experts} experts a token runs through, not by its parameters"]


def _notes(config, *, generative: bool, seq: int) -> list[str]:
    """What the figures include and leave out, for this model."""
    notes = [
        "training peak = weights + gradients + live activations + P2P buffers; optimizer states are extra "
        "(Adam: 2 x fp32 copies of the rank's parameters)",
        "activations: what autograd saves for backward, measured by running the stage on fake tensors "
        "(unpadded batches); the last stage includes the fp32 log-probabilities of the cross entropy",
    ]
    notes.append(
        "with checkpointing (ckpt): a checkpointed block keeps only its inputs; during its backward its "
        "recomputed activations come on top, one block at a time (measured on the same fake run)"
    )
    if not generative:
        notes.append("the model cannot generate: no KV cache")
        return notes
    if getattr(config, "is_encoder_decoder", False):
        notes.append("KV cache per token includes the cross-attention cache, with the encoder as long as the decoder")
    tokens = kv_cache_tokens(config, seq=seq)
    capped = [i for i, n in enumerate(tokens) if n < seq]
    if capped:
        notes.append(
            f"KV cache: {len(capped)} of {len(tokens)} decoder layers slide and hold "
            f"{max(tokens[i] for i in capped)} of the {seq} tokens while decoding; right after a prefill longer "
            "than the window they hold the whole prompt until their next step"
        )
    return notes
