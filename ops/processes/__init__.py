"""``stepstream dev --processes N``: the embedded engine's partitions spread over N
processes, so one machine's engine uses N cores.

Layout: ``DATA/processes.json`` says how many processes and partitions the directory was
made for; ``DATA/process-G/`` is process G's own data directory (its RocksDB, its lock,
its fencing epoch). Process G owns the partitions ``p`` with ``p % N == G``.

The ``stepstream dev`` process is process 0: it runs its partitions, the public API (web
UI, ``/metrics``, ``/readyz``) and the sources, and starts processes 1..N-1 as children.
Each child serves the API of its own partitions on a loopback socket the parent opened
and handed it (so its address outlives a restart of the child), behind a token only the
processes know. The public API sends each call about an instance to the process that
owns it, over that process's API session, and merges listings and overviews. Commands
one process's instances send to another's (a child's start, a message, a parent's
notice) are forwarded through the log, exactly once (``consumers/embedded/forwarding``).
A child that dies, or does not answer its health probe for ``--hang-timeout``, is
started again; a child whose parent is gone stops.

- ``layout``: which process owns which partitions, and the file that says so
- ``routing``: the public API over every process (``ProcessesTransport``)
- ``forwarding``: commands between processes, over their internal APIs
- ``observability``: ``/metrics`` and ``/readyz`` over every process
- ``children``: starting processes 1..N-1 and keeping them running
- ``serving``: what process 0 and each of the others run

What the CLI runs it with is exported here.
"""

from stepstream.ops.processes.children import HANG_TIMEOUT_S, SPEC_ENV, Spec
from stepstream.ops.processes.layout import ProcessLayout
from stepstream.ops.processes.routing import add_processes_route
from stepstream.ops.processes.serving import serve_child, serve_parent

__all__ = [
    "HANG_TIMEOUT_S",
    "SPEC_ENV",
    "ProcessLayout",
    "Spec",
    "add_processes_route",
    "serve_child",
    "serve_parent",
]
