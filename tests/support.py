"""What tests in several folders share: the control plane's gRPC server, in-process.

:class:`ServerThread` runs a real :class:`controlplane.rpc.server.ControlPlaneServer` (the
aio server) on its own thread and event loop, so synchronous tests and clients call it
over a real port; :func:`running` is the context manager most tests want.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from controlplane.rpc.server import ControlPlaneServer, ServerOptions
from controlplane.service import ControlPlane
from controlplane.state import ModelState, differences

__all__ = ["ServerThread", "running", "same_models"]

T = TypeVar("T")


class ServerThread:
    """A real aio server (port 0 unless ``options.listen`` names one) running in its own
    thread and event loop; ``target`` is its ``host:port``."""

    def __init__(self, plane: ControlPlane, options: ServerOptions) -> None:
        self.server = ControlPlaneServer(plane, options)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self.run(self.server.start())
        self.target = f"127.0.0.1:{self.port}"

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the server's loop and wait (30 s at most) for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def stop(self) -> None:
        """Stop the server (1 s grace), then its loop and thread."""
        self.run(self.server.stop(grace_s=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@contextmanager
def running(plane: ControlPlane, **options: Any) -> Iterator[ServerThread]:
    """A server for ``plane`` on 127.0.0.1, port 0, with ``options`` (``ServerOptions``
    fields), stopped on exit."""
    thread = ServerThread(plane, ServerOptions(listen="127.0.0.1:0", **options))
    try:
        yield thread
    finally:
        thread.stop()


def same_models(a: ModelState, b: ModelState) -> None:
    """Assert two servers' models are equal (:func:`controlplane.state.differences`)."""
    assert differences(a, b) == []
