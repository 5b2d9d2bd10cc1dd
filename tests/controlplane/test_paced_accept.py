"""A door's paced listener on a real asyncio server: past its accept budget the door stops
accepting for a second (connections wait in the backlog and are served after), each pause
is counted and logged once, and a listener closed during a pause leaves no traceback and
releases its descriptor."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import pytest

from controlplane.doors import AcceptErrors, PacedListener


class _Hello(asyncio.Protocol):
    accepted = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _Hello.accepted += 1
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(b"hi")
        transport.close()


async def _connect(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await reader.read(2)
    finally:
        writer.close()


def test_past_the_budget_accepting_pauses_and_the_backlog_is_served_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> tuple[list[bytes], float, int, int]:
        loop = asyncio.get_running_loop()
        errors = AcceptErrors(logging.getLogger("test.doors"), "door", interval_s=60.0)
        errors.install(loop)
        listener = PacedListener.wrap(socket.create_server(("127.0.0.1", 0)), per_s=10.0)
        server = await loop.create_server(_Hello, sock=listener, backlog=128)
        port = listener.getsockname()[1]
        _Hello.accepted = 0
        start = time.monotonic()
        answers = await asyncio.gather(*(_connect(port) for _ in range(25)))
        took = time.monotonic() - start
        server.close()
        await server.wait_closed()
        errors.uninstall()
        return answers, took, listener.paused, errors.pauses

    with caplog.at_level(logging.WARNING, logger="test.doors"):
        answers, took, paused, pauses = asyncio.run(main())
    assert answers == [b"hi"] * 25  # nobody refused: the rest waited in the backlog
    assert _Hello.accepted == 25
    assert paused >= 1
    assert pauses == paused  # every pause reached the handler, once
    assert took >= 1.0  # 25 connections at 10 a second cannot all be in at once
    warnings = [r for r in caplog.records if "accepting paused" in r.getMessage()]
    assert len(warnings) == 1  # once per interval, however many pauses


def test_a_listener_closed_during_a_pause_leaves_no_traceback_and_frees_its_descriptor() -> None:
    def main() -> tuple[int, list[dict[str, object]]]:
        loop = asyncio.new_event_loop()
        seen: list[dict[str, object]] = []
        loop.set_exception_handler(lambda _loop, context: seen.append(context))
        listener = PacedListener.wrap(socket.create_server(("127.0.0.1", 0)), per_s=1.0)
        fd = listener.fileno()

        async def run() -> None:
            server = await loop.create_server(_Hello, sock=listener)
            port = listener.getsockname()[1]
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
            await asyncio.sleep(0.2)  # one accepted, then the pause
            assert listener.paused == 1
            server.close()  # during the pause
            await asyncio.sleep(1.5)  # asyncio resumes on the descriptor, which is released
            for c in clients:
                c.close()

        loop.run_until_complete(run())
        loop.close()
        return fd, seen

    fd, seen = main()
    assert [c.get("message") for c in seen] == ["socket.accept() out of system resource"]
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)  # closed (the number may be reused later; nothing opened it since)
