"""Deciding before anything is loaded: options, schedules, the stage plan and the split.

Lives here: :mod:`.options` (the one place defaults and checks of a pipelined model's options
live), :mod:`.schedules` (torch's schedules as validated data, their action lists and the step
simulator) and :mod:`.plan` (resolving a recipe on the meta model, costing blocks, the
partitioner, the stage plan, the parameter layout).

May import: the base modules, :mod:`hf_pipeline.distributed` and :mod:`hf_pipeline.families`.
Nothing here reads weights or communicates.
"""
