"""What the serving processes tell an operator: metrics, traces and logs.

- ``metrics``: Prometheus families of a serving process, ``/metrics`` and ``/readyz``
- ``gc_pauses``: the garbage collector's pauses, for the metrics and the bench
- ``tracing``: spans of workflow runs and step attempts (OpenTelemetry, ``OTEL_*``)
- ``span_export``: the process of its own that builds and exports those spans
- ``otlp_wire``: OTLP over HTTP requests written without SDK spans (the usual case)
- ``span_direct``: SDK spans, for every other exporter
- ``logs``: ``key=value`` or JSON log lines
"""
