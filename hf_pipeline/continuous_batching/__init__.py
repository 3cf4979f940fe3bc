"""Continuous batching: the serving engine's long-lived decode ring, in which rows join free slots between
steps as others finish, and what feeds and bounds it.

Lives here: :mod:`.continuous_ring` (:class:`ContinuousRing`, the ring every rank runs, and
:func:`continuous_refusal`, which models it cannot serve: when each stage runs what, and the messages
between stages), :mod:`.ring_stage` (:class:`RingStage`, one stage's groups: their caches, forwards and,
on the last stage, each row's token), :mod:`.encoder_decoder_stage` (:class:`EncoderDecoderStage`, the same
for an encoder-decoder: the encoder once per joining row, its output and cross-attention cache per row on
the decoder stages), :mod:`.group_cache` (a group's KV cache: rows
merged right aligned and cut, full and sliding-window layers each keeping their own columns),
:mod:`.prefill_plan` (:class:`PrefillPlanner`: chunked prefill, which part of each joining row's
prompt an op runs, and how much of it comes from the prefix cache), :mod:`.prefix_cache` (shared prompt
heads' keys and values kept per stage, in blocks, LRU, with the coordinator's mirrored index),
:mod:`.wire` (what travels down the ring with each op: :class:`OpHeader`, the typed header that packs
itself into its int64 tensor and parses itself back, and :class:`NewRow`, the joining rows as JSON),
:mod:`.feeder` (:class:`Feeder`, what the ring asks of stage 0's queue, and :class:`RingFeeder`, the
serving queue as the rows that join the slot pool), :mod:`.kv_budget` (the pool's rows from a
KV-cache budget per rank) and :mod:`.ring_times` (:class:`RingTimes`, where a rank's time in the ring
went: its stages' decode and prefill forwards, waiting for messages).

May import: the base modules and the rooms below it (``distributed`` up to ``generation``, whose
caches, mailbox, generation config and sampling the ring reuses); never ``serving``, which wires the
ring to its queue (``serving/engine.py``) and hands the feeder its engine and writer classes.
"""
