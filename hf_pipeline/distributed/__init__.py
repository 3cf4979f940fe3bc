"""Ranks and their agreement: the rank context, the process group, parallel dims, faults.

Lives here: :mod:`.context` (``init_distributed``, ``RankContext``, ``ParallelDims``, error
agreement across ranks, input fingerprints) and :mod:`.faults` (failures in the middle of a
pipelined call: every rank gets an error naming the culprit, none hangs).

May import: the base modules (``errors``, ``compat``, ``log``) only. Everything above talks to the
process group through this room.
"""
