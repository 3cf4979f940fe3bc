"""Tools around a pipelined model: the memory planner, the profiler, autotuning, convert, the default model.

Lives here: :mod:`.memory` (per-rank memory predicted from the config, with the KV-cache sizes
of :mod:`hf_pipeline.planning.kv_cache_sizes` and :mod:`.activation_memory` for what a forward keeps;
:mod:`.mesh_memory` for every rank of a pp x tp x fsdp x dp mesh, with :mod:`.mesh_shares` for a
tensor-parallel rank's parameter slices and fsdp's units),
:mod:`.checkpoint_budget` (activation recomputation to a memory budget: :mod:`hf_pipeline.recompute`'s
layers chosen by the memory planner's predictions), :mod:`.profile` (recording
per-action timings) and :mod:`.timeline` (what a recording shows), :mod:`.autotune`
(``schedule="auto"``) and :mod:`.split_advice` (measured splits), :mod:`.convert` (per-stage
re-sharding) and :mod:`.default_model` (the bundled checkpoints).

May import: the base modules and every room below it (``distributed`` up to ``adapters``); the
model facade (``model.py``) and the command line (``cli``) sit above it.
"""
