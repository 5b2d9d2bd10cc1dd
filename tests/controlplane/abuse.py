"""Helpers of the hostile-client tests: half-open calls, health checks, a TCP proxy."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane._gen.cachettl.v1 import ttl_pb2

DECIDE = "/cachettl.v1.TtlService/DecideTtl"
WATCH = "/cachettl.v1.ModelService/WatchSnapshots"


class HalfOpen:
    """Calls that send their headers and then never send a message (until ``close``)."""

    def __init__(self, channel: grpc.Channel, method: str = DECIDE) -> None:
        self._release = threading.Event()
        self._call = channel.stream_unary(method)
        self.futures: list[Any] = []

    def _never(self) -> Iterator[bytes]:
        self._release.wait()
        yield from ()

    def open(self, n: int, metadata: Sequence[tuple[str, str]] = (), timeout: float = 30) -> None:
        for _ in range(n):
            future = self._call.future(self._never(), metadata=metadata, timeout=timeout)
            self.futures.append(future)

    def codes(self, wait_s: float) -> list[grpc.StatusCode | None]:
        """Each call's status code, None for those still open after ``wait_s`` in all."""
        deadline = time.monotonic() + wait_s
        out: list[grpc.StatusCode | None] = []
        for future in self.futures:
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
                out.append(future.code())
            except grpc.FutureTimeoutError:
                out.append(None)
        return out

    def close(self) -> None:
        self._release.set()
        for future in self.futures:
            future.cancel()


def healthy(channel: grpc.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def decide_request() -> ttl_pb2.DecideTtlRequest:
    return ttl_pb2.DecideTtlRequest(tool_name="bash", tool_args="ls", context_tokens=4000)


class TcpProxy:
    """Forwards a local port to ``target``; ``stop`` drops the listener and every
    connection, as a database host going away would."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._stopped:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
