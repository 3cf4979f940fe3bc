"""Pipelined generation: the ``generate`` surface, its request checks, the decode ring, sampling.

Lives here: :mod:`.generate` (``model.generate``: transformers' ``GenerationConfig`` resolved,
refusals, the request built the same on every rank), :mod:`.ring` (the decode ring: timetable,
mailbox, per-stage KV caches, microbatches in flight) and :mod:`.sampling` (small pure helpers:
microbatch bounds, positions, seeded per-row sampling).

May import: the base modules and the rooms below it (``distributed`` up to ``loading``).
"""
