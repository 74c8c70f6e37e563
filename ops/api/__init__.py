"""The HTTP API of ``stepstream dev`` and of a Kafka worker: the JSON face of a
``Transport``, its session websocket and its web UI.

- ``routes``: the API's routes, status codes and error bodies (``make_app``)
- ``session``: the ``/v1/session`` websocket, many calls of one client at once
- ``security``: who may call (bearer token, allowed hosts, origins, TLS)
- ``serving``: the listening socket, the runner and a clean stop on signals
- ``ui``: the web UI's page, files and the JSON they read

The wire form it shares with its clients is ``producers.http.wire``.
"""
