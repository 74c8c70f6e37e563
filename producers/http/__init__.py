"""The ``http://HOST:PORT`` and ``https://`` client: talks to the stepstream HTTP API (a
``stepstream dev`` process, the API service, a Kafka worker). Importing this package
registers both schemes with ``Client.connect``.

- ``wire``: the wire form the API and its clients share (errors, session frames, paths)
- ``security``: the bearer token a client sends and the CA it trusts
- ``session``: ``ApiSession``, the client side of the ``/v1/session`` websocket
- ``transport``: ``HttpTransport``, the ``Transport`` over one API
- ``routing``: ``RoutedHttpTransport``, each instance's calls to the engine process
  that owns it, against ``stepstream dev --processes N``
- ``connect``: opening one from a URL (registers the schemes)
"""

from stepstream.producers.http.connect import open_http_transport

__all__ = ["open_http_transport"]
