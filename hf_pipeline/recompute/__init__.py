"""Activation recomputation: transformers' ``activation_checkpointing_enable`` on a pipeline's stages.

Lives here: :mod:`.layers` (``ActivationCheckpointingMixin``, the model's ``activation_checkpointing_enable``
/ ``_disable`` and transformers' deprecated ``gradient_checkpointing_*`` aliases; ``CheckpointingSettings``
checked once; ``apply_checkpointing`` on a rank's stages, non-reentrant, ``every_n_layers`` counted over
the whole model's layers as transformers counts them).

The choice to a memory budget (``memory_budget_bytes=``) asks the memory planner for its predictions, and
the planner applies this room's settings to measure; so that choice sits above the planner
(:mod:`hf_pipeline.memory.recompute_budget`), not here.

May import: the base modules (``errors``, ``compat``) and the rooms below it (``distributed`` up to
``training``); today it needs only the base modules, so the memory planner can import it.
"""
