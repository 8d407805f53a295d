"""A fault-injecting TCP relay: put it between a client and a real server.

Where :mod:`checkpoint_store.testing.faults` fails calls inside the process,
the relay fails the network itself, as a flaky link or a load balancer does:
the client library's own timeouts, retries and connection pool all take
part. It listens on 127.0.0.1 only and forwards to ``upstream``::

    from checkpoint_store.testing.relay import FaultRelay

    with FaultRelay(s3_server.endpoint_url, seed=1, fault_rate=0.2) as relay:
        options = {**s3_server.storage_options(), "endpoint_url": relay.endpoint_url}
        ...                       # about 20 % of connections fail
        relay.stall()             # from now on the server never answers
    print(relay.counts)           # {"connections": 120, "reset": 6, ...}

Faults are drawn per request (each request of a keep-alive connection has
its own draw), from a generator seeded with ``(seed, connection number,
request number)``; connections are numbered in the order they arrive:

* ``"reset"``: the request is cut off half-way and both ends get a TCP
  reset; the server never sees it whole.
* ``"drop"``: the connection closes before the request is forwarded.
* ``"stall"``: the request is forwarded, then nothing more moves for
  ``stall_s`` seconds; then the connection closes. The server may have acted.
* ``"lose_answer"``: the request is forwarded and answered, the answer is
  thrown away and the connection closed: the server acted, the client
  cannot know.

``rule(connection_number, request_number, head)`` picks a fault for one
request instead (``head``: the first bytes the client sent for it, the
request line included), for a test that aims at one call; return None to
fall back to the drawn fault. Every loop is bounded: sockets poll with short
timeouts, a stall ends after ``stall_s``, and the relay stops itself after
``lifetime_s`` seconds or ``max_connections`` connections (later ones are
refused), as well as on :meth:`stop` and at the end of a ``with`` block.
"""

from __future__ import annotations

import random
import select
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from typing import Literal

__all__ = ["FAULTS", "Fault", "FaultRelay"]

Fault = Literal["reset", "drop", "stall", "lose_answer"]
FAULTS: tuple[Fault, ...] = ("reset", "drop", "stall", "lose_answer")
Rule = Callable[[int, int, bytes], "Fault | None"]

_HOST = "127.0.0.1"
_POLL_S = 0.05
_CHUNK = 256 * 1024
_CONTINUE = b"HTTP/1.1 100 "


class FaultRelay:
    """A relay on ``127.0.0.1`` to ``upstream`` that fails a seeded share of requests.

    Args:
        upstream: ``http://host:port`` (or ``host:port``) of the real server.
        seed: seeds the draws; the same seed fails the same connections.
        fault_rate: share of requests (0 to 1) that get a fault.
        faults: the kinds drawn from, equally likely.
        stall_s: how long a stalled connection stays silent (seconds).
        rule: picks a fault for one request (see the module docstring).
        lifetime_s: the relay stops itself after this many seconds.
        max_connections: connections beyond this many are refused.

    Attributes:
        endpoint_url: ``http://127.0.0.1:PORT``, to give the client instead
            of the server's.
        counts: connections accepted and faults injected, by kind.
    """

    def __init__(self, upstream: str, *, seed: int = 0, fault_rate: float = 0.0,
                 faults: tuple[Fault, ...] = FAULTS, stall_s: float = 2.0,
                 rule: Rule | None = None, lifetime_s: float = 600.0,
                 max_connections: int = 100_000):
        netloc = urllib.parse.urlsplit(upstream).netloc if "://" in upstream else upstream
        host, _, port = netloc.rpartition(":")
        self.upstream = (host or _HOST, int(port))
        self.fault_rate = fault_rate
        self.faults = faults
        self.stall_s = stall_s
        self.rule = rule
        self.lifetime_s = lifetime_s
        self.max_connections = max_connections
        self.counts: Counter[str] = Counter()
        self.seed = seed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stalled = threading.Event()
        self._listener = socket.create_server((_HOST, 0))
        self._listener.settimeout(_POLL_S)
        self.endpoint_url = f"http://{_HOST}:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._acceptor: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> FaultRelay:
        """Start accepting connections (returns self)."""
        self._deadline = time.monotonic() + self.lifetime_s
        self._acceptor = threading.Thread(target=self._accept_loop, name="fault-relay",
                                          daemon=True)
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Stop: close the listener and every relayed connection; waits for the threads."""
        self._stop.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        for t in list(self._threads):
            t.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> FaultRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stall(self) -> None:
        """From now on the server "stops answering": connections are accepted,
        nothing is forwarded either way, until the relay stops."""
        self._stalled.set()

    def resume(self) -> None:
        """Undo :meth:`stall` for connections opened from now on."""
        self._stalled.clear()

    # -- the loops --------------------------------------------------------------------

    def _running(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self._deadline

    def _accept_loop(self) -> None:
        while self._running():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                number = self.counts["connections"]
                self.counts["connections"] += 1
            if number >= self.max_connections:
                client.close()
                continue
            t = threading.Thread(target=self._serve, args=(client, number),
                                 name=f"fault-relay-{number}", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()
        self._stop.set()

    def _serve(self, client: socket.socket, number: int) -> None:
        upstream: socket.socket | None = None
        try:
            if self._stalled.is_set():
                self._hold(client, None, until_stop=True)
                return
            upstream = socket.create_connection(self.upstream, timeout=5)
            _Pipe(self, client, upstream, number).run()
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    s.close()

    def _hold(self, client: socket.socket, upstream: socket.socket | None, *,
              until_stop: bool = False) -> None:
        """Keep the connection open and silent: ``stall_s`` seconds, or until
        the relay stops (``until_stop``); bytes the client sends are read and
        thrown away."""
        end = time.monotonic() + (self.lifetime_s if until_stop else self.stall_s)
        socks = [client] + ([upstream] if upstream is not None else [])
        while self._running() and time.monotonic() < end:
            readable, _, _ = select.select(socks, [], [], _POLL_S)
            for s in readable:
                if not s.recv(_CHUNK):
                    return

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


class _Pipe:
    """One relayed connection: bytes both ways, and the fault when it is due."""

    def __init__(self, relay: FaultRelay, client: socket.socket, upstream: socket.socket,
                 number: int):
        self.relay, self.client, self.upstream = relay, client, upstream
        self.number = number
        self.requests = 0
        self.answered = True  # the server spoke since the client's last bytes
        self.pending: Fault | None = None  # the fault of the request in flight

    def run(self) -> None:
        relay = self.relay
        while relay._running():
            if relay._stalled.is_set():
                relay._hold(self.client, self.upstream, until_stop=True)
                return
            readable, _, _ = select.select([self.client, self.upstream], [], [], _POLL_S)
            for s in readable:
                data = s.recv(_CHUNK)
                if not data:
                    return
                if not (self._from_client(data) if s is self.client
                        else self._from_upstream(data)):
                    return

    def _from_client(self, data: bytes) -> bool:
        if self.answered:  # a new request starts
            self.answered = False
            self.requests += 1
            self.pending = self._fault_for(data)
        fault, self.pending = self.pending, None
        if fault == "drop":
            return False
        if fault == "reset":
            self.upstream.sendall(data[: len(data) // 2])
            _reset(self.client)
            _reset(self.upstream)
            return False
        self.upstream.sendall(data)
        if fault == "stall":
            self.relay._hold(self.client, self.upstream)
            return False
        if fault == "lose_answer":
            self.pending = "lose_answer"  # applied to the server's answer
        return True

    def _from_upstream(self, data: bytes) -> bool:
        # An interim "100 Continue" passes: the request's body is still to
        # come. A client that stopped waiting for it (curl sends the body
        # after 1 s) gets it right before the final answer, and one read may
        # hold both: only the interim part is let through here.
        while data.startswith(_CONTINUE):
            end = data.find(b"\r\n\r\n")
            if end < 0:  # the rest of its head comes in the next read
                self.client.sendall(data)
                return True
            self.client.sendall(data[: end + 4])
            data = data[end + 4:]
        if not data:
            return True
        self.answered = True
        if self.pending == "lose_answer":
            return False
        self.client.sendall(data)
        return True

    def _fault_for(self, head: bytes) -> Fault | None:
        relay = self.relay
        with relay._lock:
            relay.counts["requests"] += 1
        fault = relay.rule(self.number, self.requests, head) if relay.rule is not None else None
        if fault is None:
            rng = random.Random(f"{relay.seed}-{self.number}-{self.requests}")
            if rng.random() < relay.fault_rate:
                fault = rng.choice(relay.faults)
        if fault is not None:
            relay._count(fault)
        return fault


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (linger 0), as a dying middlebox does."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
