"""What a client of a stepstream HTTP API presents and trusts: the bearer token it sends
(``token=``, ``$STEPSTREAM_API_TOKEN``), the CA it trusts for https:// (``tls_ca=``,
``$STEPSTREAM_TLS_CA``), and what a refused token or an untrusted certificate means.
The ``kafka://`` client uses the same for the workers' APIs."""

from __future__ import annotations

import os
import ssl
from typing import Any

import aiohttp

from stepstream.engine.errors import AccessDenied, ConnectionFailed, StepstreamError

TOKEN_ENV = "STEPSTREAM_API_TOKEN"
TLS_CA_ENV = "STEPSTREAM_TLS_CA"


def refused(url: str, status: int) -> AccessDenied:
    """What a 401 or 403 on the websocket upgrade means (its body is not readable there)."""
    if status == 401:
        return AccessDenied(
            f"{url} needs a bearer token (the API's), or refused the one sent (HTTP 401); "
            f"pass token= to Client.connect, --token or {TOKEN_ENV}"
        )
    return AccessDenied(
        f"{url} refused the request (HTTP 403): the Host or Origin header is not one it "
        "answers to; connect by an address it serves, or allow it with --allowed-host"
    )


def untrusted(url: str, exc: aiohttp.ClientConnectorCertificateError) -> ConnectionFailed:
    return _for_good(
        ConnectionFailed(
            f"the TLS certificate of {url} is not trusted ({exc.certificate_error}); pass the "
            f"CA that signed it as tls_ca= to Client.connect, --tls-ca or {TLS_CA_ENV}"
        )
    )


def tls_failed(url: str, exc: aiohttp.ClientConnectorSSLError) -> ConnectionFailed:
    return _for_good(
        ConnectionFailed(
            f"TLS with stepstream at {url} failed ({exc.os_error}); is it serving https "
            "(--tls-cert), and http:// vs https:// right?"
        )
    )


def _for_good(exc: ConnectionFailed) -> ConnectionFailed:
    """A connection that the same settings will never make: not ``retriable``."""
    exc.retriable = False
    return exc


def client_headers(token: str | None) -> dict[str, str]:
    """Headers of every request (and websocket upgrade) to a stepstream API."""
    headers = {"Accept": "application/json"}
    if token:
        if not _printable(token):
            raise StepstreamError(
                f"the API token holds spaces or characters outside printable ASCII; check "
                f"token= / --token / {TOKEN_ENV}"
            )
        headers["Authorization"] = f"Bearer {token}"
    return headers


def client_ssl(tls_ca: str | None) -> ssl.SSLContext | bool:
    """The TLS setting for https:// APIs: the system's trust, or also ``tls_ca``."""
    if not tls_ca:
        return True
    try:
        return ssl.create_default_context(cafile=tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise StepstreamError(
            f"cannot load the CA file {tls_ca!r} ({exc}); pass a PEM file as tls_ca= / "
            f"--tls-ca / {TLS_CA_ENV}"
        ) from None


def client_security(options: dict[str, Any]) -> tuple[str | None, str | None]:
    """Take ``token`` and ``tls_ca`` out of ``options`` (defaults from the environment)."""
    token = options.pop("token", None) or os.environ.get(TOKEN_ENV) or None
    tls_ca = options.pop("tls_ca", None) or os.environ.get(TLS_CA_ENV) or None
    return token, tls_ca


def _printable(token: str) -> bool:
    return token.isascii() and token.isprintable() and " " not in token
