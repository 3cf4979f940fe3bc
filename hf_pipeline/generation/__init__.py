"""Pipelined generation: the ``generate`` surface, its request checks, the decode ring, sampling.

Lives here: :mod:`.generate` (``model.generate``, its stats), :mod:`.config` (the model's
``GenerationConfig``, merged as transformers merges it), :mod:`.request` (a call made into the
request every rank builds alike) with :mod:`.refusals` (what a call may not ask for, as a table),
:mod:`.ring` (the decode loop) with its parts :mod:`.timetable`, :mod:`.mailbox`, :mod:`.chooser`
(greedy and sampling) or :mod:`.beam` (beam search), :mod:`.streaming` and :mod:`.kv_cache`,
:mod:`.outputs` (the ids or transformers' output classes, the same on every rank), and the small
pure helpers :mod:`.microbatches` (row ranges) and :mod:`.sampling` (positions, seeded per-row sampling).
The serving engine's long-lived ring, where rows join free slots between steps, is a room of its
own above this one (:mod:`hf_pipeline.continuous_batching`), reusing the caches, mailbox and sampling here.

May import: the base modules and the rooms below it (``distributed`` up to ``loading``).
"""
