"""What every pipelined call shares at run time: stages and schedules per input shape, checks.

Lives here: :mod:`.cache` (torch's ``PipelineStage`` objects and schedules kept per input
signature, padding and gathering), :mod:`.weight_pass` (the zero-bubble schedules' deferred
weight gradients) and :mod:`.checks` (the argument checks every rank runs before a call
communicates; ``generate``'s prompt lists in :mod:`.prompt_checks`).

May import: the base modules, :mod:`hf_pipeline.distributed`, :mod:`hf_pipeline.families` and
:mod:`hf_pipeline.planning`.
"""
