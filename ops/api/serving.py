"""What every serving command shares: a listening socket that says what to do when it
cannot be had, a clean stop on SIGTERM or SIGINT, and a server log that anyone who can
reach the port cannot flood."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any, cast

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from stepstream.engine.errors import StepstreamError


def listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StepstreamError(f"cannot listen on {host}:{port}: {exc}; check --host") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise StepstreamError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; pass another --port "
            "or stop what is using it"
        ) from None
    return sock


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT, handled from the moment this is entered (so a
    signal right after "listening on" is printed stops the server cleanly)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


# A peer's malformed requests are logged once per this many seconds at most.
PROTOCOL_ERROR_EVERY_S = 60.0
_PEERS_KEPT = 4096


class ProtocolErrorLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log for one API. A request that is not HTTP it can parse (a
    broken client, a scanner: anyone who can reach the port, before any token is
    checked) is the client's fault, not the server's: one WARNING line without a
    traceback, at most once a minute per peer address, saying how many were not
    logged. Other errors are logged as aiohttp logs them."""

    def __init__(self, every_s: float = PROTOCOL_ERROR_EVERY_S) -> None:
        super().__init__(server_logger)
        self._every = every_s
        self._peers: dict[str, tuple[float, int]] = {}  # peer -> (last logged, not logged)

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if not isinstance(error, HttpProcessingError) or level < logging.WARNING:
            super().log(level, msg, *args, **kwargs)
            return
        peer = str(args[0]) if args else "?"
        now = time.monotonic()
        last, skipped = self._peers.get(peer, (-self._every, 0))
        if now - last < self._every:
            self._peers[peer] = (last, skipped + 1)
            return
        if len(self._peers) >= _PEERS_KEPT:
            self._peers = {p: v for p, v in self._peers.items() if now - v[0] < self._every}
        self._peers[peer] = (now, 0)
        self.logger.warning(  # not through ``process``, which would drop ``extra``
            "malformed HTTP request from %s: %s%s",
            peer,
            " ".join(str(error).split()),
            f" ({skipped} more from this peer not logged)" if skipped else "",
            extra={"peer": peer},
        )


class FieldAccessLogger(AbstractAccessLogger):
    """One INFO line a request, its context in fields as every other line's is
    (``peer``, ``method``, ``path``, ``status``, ``bytes``, ``seconds``): a JSON log
    pipeline selects on them rather than parsing the message."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        self.logger.info(
            "%s %s %d",
            request.method,
            request.path,
            response.status,
            extra={
                "peer": request.remote,
                "method": request.method,
                "path": request.path,
                "status": response.status,
                "bytes": response.body_length,
                "seconds": round(time, 6),
            },
        )


def api_runner(app: web.Application, *, access_log: bool = True) -> web.AppRunner:
    """The runner of an API clients use: a request whose client went away stops waiting
    (a result wait), the access log (unless ``access_log`` is False: a worker's probes
    and scrapes would fill it) says how long each request took, and malformed requests
    are logged sparingly (``ProtocolErrorLog``)."""
    logging_of: dict[str, Any] = (
        {"access_log_class": FieldAccessLogger} if access_log else {"access_log": None}
    )
    return web.AppRunner(
        app,
        handler_cancellation=True,
        logger=cast(logging.Logger, ProtocolErrorLog()),
        **logging_of,
    )


async def cut_off(runner: web.BaseRunner) -> None:
    """Stop serving at once, for an engine that failed (a full disk): no new connection,
    and the requests open now (a command being applied, a result awaited) end within
    0.5 s instead of the 60 s a graceful shutdown gives them. A client reconnecting its
    session in between would be one more to wait for, so the sites stop first."""
    for site in list(runner.sites):
        await site.stop()
    if runner.server is not None:
        await runner.server.shutdown(0.5)


def address(sock: socket.socket) -> str:
    """``host:port`` a socket listens on, an IPv6 host in brackets."""
    host, port = sock.getsockname()[:2]
    return f"{f'[{host}]' if ':' in host else host}:{port}"


def reachable(url: str) -> str:
    """``url`` with a wildcard host (listening on every interface: ``0.0.0.0``,
    ``[::]``) replaced by this machine's name, so that a URL printed for people to open
    is one a browser can open."""
    for wildcard in ("//0.0.0.0:", "//[::]:"):
        if wildcard in url:
            return url.replace(wildcard, f"//{socket.gethostname()}:", 1)
    return url
