"""Pipelined generation: the ``generate`` surface, its request checks, the decode ring, sampling.

Lives here: :mod:`.generate` (``model.generate``, its stats), :mod:`.config` (the model's
``GenerationConfig``, merged as transformers merges it), :mod:`.request` (a call made into the
request every rank builds alike) with :mod:`.refusals` (what a call may not ask for, as a table),
:mod:`.ring` (the decode loop) with its parts :mod:`.timetable`, :mod:`.mailbox`, :mod:`.chooser`
(greedy and sampling) or :mod:`.beam` (beam search), :mod:`.streaming` and :mod:`.kv_cache`,
:mod:`.outputs` (the ids or transformers' output classes, the same on every rank), :mod:`.continuous`
(the serving engine's long-lived ring: rows join free slots between steps as others leave), and the small
pure helpers :mod:`.microbatches` (row ranges) and :mod:`.sampling` (positions, seeded per-row sampling).

May import: the base modules and the rooms below it (``distributed`` up to ``loading``).
"""
