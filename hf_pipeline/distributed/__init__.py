"""Ranks and their agreement: the rank context, the process group, parallel dims, faults.

Lives here, lowest first:

- :mod:`.shutdown`: a clean interpreter exit (the group destroyed, its worker threads idle).
- :mod:`.sockets`: a listening socket bound by the package itself (the HTTP server's, the launcher's
  rendezvous store's), so a taken port is an error naming the option.
- :mod:`.context`: ``init_distributed``, ``RankContext``, ``destroy_distributed``: the process
  group, device and collective timeout from the launcher's environment.
- :mod:`.dims`: ``ParallelDims``, how the ranks form ``dp_size`` replicas (or FSDP ranks) of a pipeline
  of ``tp_size``-rank stages: the (dp or fsdp, pp, tp) mesh, built once here.
- :mod:`.shards`: tensor-parallel shards (``DTensor``) seen as plain tensors: local or gathered.
- :mod:`.groups`: the process groups a model owns (``own_group``, ``renew_groups``): made at load,
  made afresh after a failure stopped them; WORLD is never used by a model's calls.
- :mod:`.exchange`: ``all_gather_json``, data-only exchanges between ranks (JSON, never pickle).
- :mod:`.agreement`: error agreement across ranks (``collective_errors``, ``raise_on_any_rank``,
  ``lost_peer_error``) and input fingerprints (``check_same_on_all_ranks``).
- :mod:`.fault_records`: the JSON failure records ranks leave in the rendezvous store.
- :mod:`.faults`: failures in the middle of a pipelined call (``spread_failures``): every rank gets
  an error naming the culprit, none hangs, and with every rank alive the next call works.

May import: the base modules (``errors``, ``compat``, ``log``) only. Everything above talks to the
process group through this room.
"""
