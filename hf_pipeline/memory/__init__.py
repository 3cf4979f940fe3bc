"""Memory planning: what each rank will hold, predicted from the config without reading weights.

Lives here: :mod:`.planner` (``plan_report``: the loader's own stages built on the meta device and
run once on fake tensors, per stage and per pipeline rank), :mod:`.report` (its answer, the
``MemoryReport`` stage and rank tables), :mod:`.saved_tensors` (what a forward keeps for backward,
with and without activation checkpointing), :mod:`.mesh_shares` (a tensor-parallel rank's parameter
slices and fsdp's units), :mod:`.mesh_report` (every rank of a pp x tp x fsdp x dp mesh) and
:mod:`.auto_choice_costs` (the load-time ``schedule="auto"`` choice of
:mod:`hf_pipeline.planning.auto_choice`, costed on the loader's stage plan and this room's peaks) and
:mod:`.recompute_budget` (``activation_checkpointing_enable(memory_budget_bytes=...)``: the fewest
recomputed layers whose predicted peak fits).

May import: the base modules and the rooms below it, up to :mod:`hf_pipeline.loading` (the stages
it measures) and :mod:`hf_pipeline.recompute` (the activation recomputation it plans for). The tools,
the model facade and the command line sit above it.
"""
