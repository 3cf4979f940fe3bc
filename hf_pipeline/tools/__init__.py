"""What users run as tools around a pipelined model: profiling, measured tuning, converting, the default model.

Lives here: :mod:`.profile` (recording per-action timings) and :mod:`.timeline` (what a recording
shows), :mod:`.schedule_tuning` (``model.tune``: schedules timed by running them) and
:mod:`.split_advice` (``model.measure_split``: a split balanced on measured stage times),
:mod:`.convert` (per-stage re-sharding) and :mod:`.default_model` (the bundled checkpoints). Memory planning lives in
:mod:`hf_pipeline.memory`; the load-time ``schedule="auto"`` rules in :mod:`hf_pipeline.planning.auto_choice`.

May import: the base modules and every room below it (``distributed`` up to ``memory``); the
model facade (``model.py``) and the command line (``cli``) sit above it.
"""
