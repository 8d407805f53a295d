"""The fault relay itself: a lost answer stays lost whatever the server's reads look like."""

from __future__ import annotations

import socket
import threading

from checkpoint_store.testing.relay import FaultRelay

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
REQUEST = (b"PUT /b/k HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
           b"Content-Length: 4\r\n\r\nbody")


def _upstream(answer: bytes) -> tuple[socket.socket, threading.Thread]:
    """A one-connection server: reads the whole request, then writes
    ``answer`` with one send (what a relay thread that was not scheduled
    between the server's two writes reads at once)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            got = b""
            while not got.endswith(b"body"):
                got += conn.recv(4096)
            conn.sendall(answer)
            conn.recv(1)  # until the relay closes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return listener, t


def _client_reads(relay: FaultRelay) -> bytes:
    """What the client gets until the relay closes (or 5 s of silence)."""
    port = int(relay.endpoint_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(REQUEST)  # the body without waiting for the 100 (curl after 1 s)
        got = b""
        try:
            while chunk := c.recv(4096):
                got += chunk
        except TimeoutError:
            pass
        return got


def test_a_lost_answer_is_lost_when_it_comes_with_the_interim_100():
    listener, t = _upstream(CONTINUE + OK)
    with listener, FaultRelay(f"http://127.0.0.1:{listener.getsockname()[1]}",
                              rule=lambda c, r, h: "lose_answer", lifetime_s=30) as relay:
        # The 100 reaches the client; the final answer does not: used to
        # forward both, so a "lost" PUT answer came through now and then.
        assert _client_reads(relay) == CONTINUE
    t.join(10)
    assert relay.counts["lose_answer"] == 1


def test_an_answer_after_an_interim_100_in_one_read_passes_whole():
    listener, t = _upstream(CONTINUE + OK)
    with listener, FaultRelay(f"http://127.0.0.1:{listener.getsockname()[1]}",
                              lifetime_s=30) as relay:
        port = int(relay.endpoint_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(REQUEST)
            got = b""
            while not got.endswith(OK):
                got += c.recv(4096)
        assert got == CONTINUE + OK
    t.join(10)
