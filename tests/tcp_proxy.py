"""A TCP proxy for fault tests: it sits between clients and a server (a Kafka broker that
advertises the proxy's address, so every connection goes through it) and can add delay,
stall or drop traffic for a while, and cut every connection.

It runs an event loop on its own thread, so a test drives it with plain calls whatever
its own loop is doing. It listens on 127.0.0.1 only.

- ``delay(seconds)``: every chunk, both ways, arrives that much later (order kept).
- ``blackhole()``: nothing is forwarded any more, as when a network partition starts;
  bytes in flight wait (TCP would retransmit them) and new connections are accepted but
  not connected onwards. With ``drop=True`` what is sent meanwhile is thrown away
  instead, and ``heal()`` then cuts the connections that lost bytes (their streams are
  broken, as when TCP gives up).
- ``heal()``: traffic flows again, without delay.
- ``cut()``: closes every connection at once (a reset), like a restarted load balancer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
_CHUNK = 64 * 1024


@dataclass(eq=False)
class _Link:
    """One client connection and its upstream connection."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    lost_bytes: bool = False


class TcpProxy:
    """``TcpProxy(target_port)``; ``start()`` binds and returns the port; ``stop()``."""

    def __init__(self, target_port: int | None = None, target_host: str = "127.0.0.1") -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.connections_accepted = 0
        self._delay = 0.0
        self._drop = False
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy")
        self._thread.daemon = True

    # ---- control (any thread) -----------------------------------------------------------

    def start(self) -> int:
        self._thread.start()
        self._call(self._start())
        return self.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def delay(self, seconds: float) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_delay", seconds)

    def blackhole(self, *, drop: bool = False) -> None:
        self._call(self._blackhole(drop))

    def heal(self) -> None:
        self._call(self._heal())

    def cut(self) -> int:
        """Close every connection now; returns how many there were."""
        return self._call(self._cut())

    @property
    def open_connections(self) -> int:
        return len(self._links)

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    # ---- the proxy's loop ---------------------------------------------------------------

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _blackhole(self, drop: bool) -> None:
        assert self._flowing is not None
        self._drop = drop
        self._flowing.clear()

    async def _heal(self) -> None:
        assert self._flowing is not None
        broken = [link for link in self._links if link.lost_bytes]
        self._drop = False
        self._delay = 0.0
        for link in broken:
            self._close(link)
        self._flowing.set()

    async def _cut(self) -> int:
        links = list(self._links)
        for link in links:
            self._close(link)
        return len(links)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        self.connections_accepted += 1
        link = _Link(writer)
        self._links.add(link)
        try:
            await self._flowing.wait()  # a partition: the connection goes nowhere
            if self.target_port is None:
                raise ConnectionRefusedError("no target")
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except (OSError, asyncio.CancelledError):
            self._close(link)
            return
        if link not in self._links:  # cut while connecting
            _reset(up_writer)
            return
        link.upstream = up_writer
        link.tasks = [
            asyncio.create_task(self._pump(link, reader, up_writer)),
            asyncio.create_task(self._pump(link, up_reader, writer)),
        ]

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Copy one direction. Delayed chunks go through a queue so that a delay adds
        latency without cutting throughput; a stall stops reading (back-pressure)."""
        assert self._flowing is not None
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.create_task(self._send(link, queue, writer))
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                if not self._flowing.is_set():
                    if self._drop:
                        link.lost_bytes = True
                        continue
                    await self._flowing.wait()
                await queue.put((time.monotonic() + self._delay, data))
            queue.put_nowait(None)  # the peer closed: deliver what is queued, then close
            await sender
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            sender.cancel()
            self._close(link)

    async def _send(
        self,
        link: _Link,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        writer: asyncio.StreamWriter,
    ) -> None:
        assert self._flowing is not None
        while (item := await queue.get()) is not None:
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._flowing.is_set():
                if self._drop:
                    link.lost_bytes = True
                    continue
                await self._flowing.wait()
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                return

    def _close(self, link: _Link) -> None:
        if link not in self._links:
            return
        self._links.discard(link)
        for task in link.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        _reset(link.client)
        if link.upstream is not None:
            _reset(link.upstream)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), not a graceful FIN: what a cut connection looks like."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport = writer.transport
    transport.abort()
