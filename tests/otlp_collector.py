"""An OTLP/HTTP trace receiver for tests: what a process configured by the standard
``OTEL_*`` variables really exported."""

from __future__ import annotations

from typing import Any


class OtlpCollector:
    """An OTLP/HTTP trace receiver: keeps the spans of every export request."""

    def __init__(self, status: int = 200) -> None:
        import http.server
        import threading

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        spans = self.spans = []  # type: list[Any]
        scopes = self.scopes = []  # type: list[Any]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        spans.extend(scope.spans)
                        scopes.append(scope.scope)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self.server.shutdown()
        self.server.server_close()
