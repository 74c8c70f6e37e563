"""What every serving command shares: a listening socket that says what to do when it
cannot be had, and a clean stop on SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator

from aiohttp import web

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


def api_runner(app: web.Application) -> web.AppRunner:
    """The runner of an API clients use: a request whose client went away stops waiting
    (a result wait), and the access log says how long each request took."""
    return web.AppRunner(app, handler_cancellation=True, access_log_format='%a "%r" %s %b %Tfs')


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
