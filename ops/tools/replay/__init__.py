"""Replay: today's workflow code against recorded histories, with no side effects.

Each history is folded into an ``InstanceState`` (``InstanceState.apply``, as a restore
does) and an ``InstanceRuntime`` with a fixed clock recovers it: the code runs from its
start, every ``ctx`` call gets what the history recorded, and the runtime checks that the
code reaches every recorded key with the same kind (``HistoryDiverged`` otherwise). What
the runtime decides past the recorded end (records, timers, step launches) is where the
instance would go on; it is dropped: no step body runs and nothing is written.

A finished history replays without its last record, and the code must end the same way
(a completed history must complete again, a failed one fail), without new steps first.

Histories come from an embedded data directory (opened read-only), from a client
(``Client.list`` + ``Client.history``), from a Kafka history topic (folded by the reader
rules of ``schemas/README.md``) or from export files (``ops.tools.history_export``).

- ``sources``: ``History`` and where histories come from
- ``runtime``: the runtime the code replays on, noting each ``ctx`` call
- ``replayer``: ``replay_history`` and ``replay_all``, and how a divergence is told
- ``results``: ``ReplayResult``, ``ReplaySummary``, ``ReplayDiverged``, their text
- ``command``: ``stepstream replay``
"""
