"""Opening an ``http://HOST:PORT`` or ``https://`` client, and registering both schemes
with ``Client.connect``. Options: ``token`` (the API's bearer token, default
``$STEPSTREAM_API_TOKEN``), ``tls_ca`` (a CA file to trust for https://, default
``$STEPSTREAM_TLS_CA``) and ``timeout`` (seconds per request)."""

from __future__ import annotations

from typing import Any

import aiohttp
from yarl import URL

from stepstream.engine.errors import StepstreamError
from stepstream.producers.client import Transport, register_transport
from stepstream.producers.http.routing import RoutedHttpTransport
from stepstream.producers.http.security import client_headers, client_security, client_ssl
from stepstream.producers.http.transport import (
    DEFAULT_REQUEST_TIMEOUT_S,
    POOL_CONNECTIONS,
    HttpTransport,
)


async def open_http_transport(url: str, options: dict[str, Any]) -> Transport:
    """The transport of ``Client.connect(url, **options)``: to the server at ``url``, and
    to each of its engine processes once it says where they are."""
    request_timeout = float(options.pop("timeout", DEFAULT_REQUEST_TIMEOUT_S))
    token, tls_ca = client_security(options)
    if options:
        raise StepstreamError(
            f"unknown options for {url}: {', '.join(sorted(options))} "
            "(known: timeout, token, tls_ca)"
        )
    parsed = URL(url)
    if not parsed.host:
        raise StepstreamError(f"cannot connect to {url!r}: no host; use http://HOST:PORT")
    headers = client_headers(token)
    connector = aiohttp.TCPConnector(limit=POOL_CONNECTIONS, ssl=client_ssl(tls_ca))
    session = aiohttp.ClientSession(headers=headers, connector=connector)
    return RoutedHttpTransport(HttpTransport(url, session, request_timeout=request_timeout))


register_transport("http", open_http_transport)
register_transport("https", open_http_transport)
