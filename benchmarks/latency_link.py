"""A slow network link on 127.0.0.1: a TCP proxy adding latency and a bandwidth cap.

On loopback a single connection moves gigabytes per second with no round-trip
time, which hides what parallel requests buy on a real network. This proxy
forwards every connection to ``--target`` and, per direction, delays each
chunk by half the round-trip time and shares one bandwidth budget among all
connections (like one link to the store). It needs no root and touches
nothing but 127.0.0.1.

Run as ``python -m benchmarks.latency_link --target 127.0.0.1:PORT --rtt-ms 10
--mbit 1000``; it prints the port it listens on, then serves until killed.
:class:`Link` starts and stops one from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

CHUNK = 256 * 1024


class _Pipe:
    """One direction of the link: a delay and a bandwidth cap shared by all
    connections (the time the link is next free)."""

    def __init__(self, delay_s: float, bytes_per_s: float):
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0

    def departure(self, n: int) -> float:
        """When ``n`` bytes handed over now arrive at the other end."""
        now = time.monotonic()
        start = max(now, self.free_at)
        self.free_at = start + n / self.bytes_per_s
        return self.free_at + self.delay_s


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   pipe: _Pipe) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        try:
            writer.write_eof()
        except OSError:
            pass

    task = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            await queue.put((pipe.departure(len(data)), data))
            # Back-pressure: a sender cannot run more than ~1 s ahead of the link.
            while queue.qsize() > 64:
                await asyncio.sleep(0.001)
    except (ConnectionError, OSError):
        pass
    finally:
        await queue.put((0.0, b""))
        try:
            await task
        except (ConnectionError, OSError):
            pass


async def _serve(target_host: str, target_port: int, rtt_ms: float, mbit: float) -> None:
    up = _Pipe(rtt_ms / 2000, mbit * 1e6 / 8)
    down = _Pipe(rtt_ms / 2000, mbit * 1e6 / 8)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_forward(client_r, server_w, up), _forward(server_r, client_w, down))
        for w in (client_w, server_w):
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=512)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


class Link:
    """A proxy process in front of ``target`` (``http://127.0.0.1:PORT``).

    Attributes:
        url: ``http://127.0.0.1:<proxy port>``, to use instead of the target's.
    """

    def __init__(self, target_url: str, *, rtt_ms: float = 10.0, mbit: float = 1000.0):
        hostport = target_url.split("://", 1)[-1].rstrip("/")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.latency_link", "--target", hostport,
             "--rtt-ms", str(rtt_ms), "--mbit", str(mbit)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{port}"
        self.rtt_ms, self.mbit = rtt_ms, mbit

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to (127.0.0.1)")
    ap.add_argument("--rtt-ms", type=float, default=10.0)
    ap.add_argument("--mbit", type=float, default=1000.0)
    args = ap.parse_args()
    host, port = args.target.rsplit(":", 1)
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit("the link only forwards to 127.0.0.1")
    asyncio.run(_serve(host, int(port), args.rtt_ms, args.mbit))


if __name__ == "__main__":
    main()
