"""The ``http://HOST:PORT`` and ``https://`` client: talks to the stepstream HTTP API (a
``stepstream dev`` process, the API service, a Kafka worker).

- ``wire``: the wire form the API and its clients share (errors, session frames, paths)
- ``security``: the bearer token a client sends and the CA it trusts
- ``session``: ``ApiSession``, the client side of the ``/v1/session`` websocket
- ``transport``: ``HttpTransport``, the ``Transport`` over one API
- ``routing``: ``RoutedHttpTransport``, each instance's calls to the engine process
  that owns it, against ``stepstream dev --processes N``
- ``connect``: opening one from a URL; ``Client.connect`` imports it the first time it
  is given an ``http://`` or ``https://`` URL, and it registers both schemes

Nothing is imported here: a process that needs only ``wire`` (the API's server side, the
CLI's option parsing) does not pay for aiohttp's client.
"""
