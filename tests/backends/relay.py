"""A counting TCP relay on 127.0.0.1 in front of a real local server (moto,
Azurite, the GCS emulator): the tests count what a client really sends
(request lines, bytes) and can hold an answer back, without a mock of the
store."""

from __future__ import annotations

import socket
import threading
import time

_METHODS = (b"GET", b"PUT", b"POST", b"HEAD", b"DELETE", b"PATCH")


class CountingRelay:
    """TCP relay on 127.0.0.1 to ``target_port`` (clients connect to ``url``).

    Records every HTTP request line in ``requests`` and counts the bytes
    clients send (``sent``: request lines, headers and bodies) and receive
    (``received``: status lines, headers and bodies). Holds the
    answer to the first CompleteMultipartUpload (``POST ...?uploadId=``) of
    each upload ``hold_s`` seconds (a request sent again is answered at
    once: a test then fails on the count, not after a long wait); those
    request lines are also in ``completes``."""

    def __init__(self, target_port: int, hold_s: float = 0.0):
        self.target_port = target_port
        self.hold_s = hold_s
        self.completes: list[bytes] = []
        self.requests: list[bytes] = []
        self.sent = 0
        self.received = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        """Start counting afresh (requests, completes and bytes sent)."""
        with self._lock:
            self.sent = 0
            self.received = 0
            self.requests = []
            self.completes = []

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            waiting = threading.Event()  # a Complete request awaits its answer
            threading.Thread(target=self._up, args=(client, upstream, waiting),
                             daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, waiting),
                             daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket,
            waiting: threading.Event) -> None:
        # Clients send a request only after the previous answer (no HTTP
        # pipelining), so each request line starts a chunk.
        for data in _chunks(client):
            line = data.split(b"\r\n", 1)[0]
            with self._lock:
                self.sent += len(data)
                if line.split(b" ", 1)[0] in _METHODS:
                    self.requests.append(line)
                if line.startswith(b"POST ") and b"uploadId=" in line:
                    if line not in self.completes:
                        waiting.set()
                    self.completes.append(line)
            upstream.sendall(data)
        _close(upstream)

    def _down(self, upstream: socket.socket, client: socket.socket,
              waiting: threading.Event) -> None:
        for data in _chunks(upstream):
            if waiting.is_set():
                time.sleep(self.hold_s)
                waiting.clear()
            with self._lock:
                self.received += len(data)
            try:
                client.sendall(data)
            except OSError:  # the client gave up on this connection
                break
        _close(client)

    def close(self) -> None:
        self._server.close()


def _chunks(sock: socket.socket):
    while True:
        try:
            data = sock.recv(1 << 16)
        except OSError:
            return
        if not data:
            return
        yield data


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
