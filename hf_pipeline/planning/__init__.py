"""Deciding before anything is loaded: options, schedules, the stage plan and the split.

Lives here: :mod:`.options` (the one place defaults and checks of a pipelined model's options
live), :mod:`.schedules` (torch's schedules as validated data and their rules), :mod:`.actions`
(each rank's action list, the backward-fusing rewrite), :mod:`.simulate` (the step simulator),
:mod:`.auto_choice` (the rules of ``schedule="auto"``: candidates costed by the simulator, the pick,
switching a loaded model's schedule),
:mod:`.resolve` (a recipe resolved on the meta model, module costs), :mod:`.partition` (where to
cut a row of costs), :mod:`.plan` (the stage plan and ``make_plan``), :mod:`.layout` (where
every checkpoint key lives under a plan), :mod:`.tp_plan` (tensor-parallel requests and plans) and
:mod:`.mesh_rules` (which families and schedules go with tensor parallelism, as data), and
:mod:`.kv_cache_sizes` (KV-cache bytes per token and per stage, from the config alone).

May import: the base modules, :mod:`hf_pipeline.distributed` and :mod:`hf_pipeline.families`.
Nothing here reads weights or communicates.
"""
