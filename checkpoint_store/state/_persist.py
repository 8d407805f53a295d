"""The persist process: writes staged tensor bytes from shared memory to files.

``report(state=...)`` copies tensors into a shared-memory staging area
(:mod:`checkpoint_store.state._staging`) and returns; this process, started
on first use and kept for the life of its stager, moves the bytes from the
staging area into the checkpoint's safetensors files, so serialisation, the
page-cache copy and the CRC32C of every tensor run outside the training
process's GIL, as torch DCP's async save does in its persist process.

The process is started with :class:`subprocess.Popen` (fork + exec of a new
interpreter, what the ``spawn`` start method does, never a fork of the
threaded training process) and never imports pyarrow, numpy or torch (their
libraries would count in its memory, bounded by budget + 64 MiB;
tests/state/test_persist_imports.py). It gets:

* a socket (one end of a ``socketpair``) carrying
  :class:`multiprocessing.connection.Connection` messages;
* the file descriptor of the staging area, a file on ``/dev/shm`` that the
  parent unlinked before starting it: no name is left behind when either
  process is killed, and the memory goes back once both have exited.

Messages (parent to process) travel in batches: each message on the socket
is a list of the messages below (a stage sends its ``open``, every
``write`` and its ``close`` as one list, once the copy is done: one write to
the socket and one wake-up of this process per save, not one per piece),
handled in order, each answered in order:

* ``("open", sid, directory, layout)``: start writing state ``sid`` (a
  :class:`~checkpoint_store.state.StateWriter` of the format package on
  ``layout``, a :class:`~checkpoint_store.state.StateLayout`);
* ``("write", sid, key, shm_offset, nbytes, offset)``: write those staged
  bytes as bytes ``[offset, offset + nbytes)`` of tensor ``key`` (their
  CRC32C taken on the way); answered ``("freed", shm_offset, nbytes)`` once
  they are out of the staging area;
* ``("close", sid, fsync)``: write ``state.json`` and close; answered
  ``("closed", sid, tensor_index, files)``, ``files`` every file's path,
  size and CRC32C (combined from the tensors', nothing read back);
* ``("abort", sid)``: the stage was cut short (an exception, a signal in
  the training process): remove that state's files, not answered. Its
  ``open`` and ``write`` messages in the same batch are not carried out
  (their staging bytes are still freed), so a stage interrupted before its
  first batch left touches no file.

A state's files go into the directory the training process made for it
(``open`` never makes a directory): a report that failed removes its
directory at once, and the files of a state still on its way to this process
then fail to open instead of bringing the directory back, unclaimed and
uncommitted, for the next run to find.

An error answers ``("error", sid, text, facts)``: ``text`` the traceback,
``facts`` what :func:`error_facts` keeps of the exception (class, errno,
message), from which the training process raises the typed error the
directory path raises for the same failure (:func:`error_from_facts`: a full
disk is a ``StorageFullError`` on both paths). The process then drops that
state's later messages (still freeing their staging bytes), removes its
files and stays up. It exits when the socket closes (its parent ended or
was killed).
"""

from __future__ import annotations

import mmap
import os
import sys
import traceback
from collections.abc import Container
from typing import Any

__all__ = ["PersistProcess", "error_facts", "error_from_facts", "main"]


def _file_crcs(writer: Any, index: dict[str, Any], directory: str) -> list[dict[str, Any]]:
    """Every file's size and CRC32C, from the shard headers and the tensors'
    CRC32C (a shard is its header, then its tensors with no gaps), plus
    ``state.json`` read back (small): no tensor byte is read again."""
    import google_crc32c

    from checkpoint_store._transfer.crc32c import crc32c_combine
    from checkpoint_store.state._files import STATE_FILE

    by_file: dict[str, list[tuple[int, int, int]]] = {}
    for e in index.values():
        if "alias_of" in e:
            continue
        b, end = e["offsets"]
        by_file.setdefault(e["file"], []).append((b, end, int(e["crc32c"], 16)))
    out = []
    for shard in writer._shards:
        crc, at = google_crc32c.value(shard.header), len(shard.header)
        for b, end, tcrc in sorted(by_file.get(shard.name, [])):
            if b != at:
                raise ValueError(f"{shard.name}: a gap at byte {at}")
            crc, at = crc32c_combine(crc, tcrc, end - b), end
        out.append({"path": shard.name, "size": shard.size, "crc32c": f"{crc:08x}"})
    with open(os.path.join(directory, STATE_FILE), "rb") as f:
        raw = f.read()
    out.append({"path": STATE_FILE, "size": len(raw),
                "crc32c": f"{google_crc32c.value(raw):08x}"})
    return out


def _serve(conn: Any, area: mmap.mmap, parent: int) -> None:
    view = memoryview(area)
    writers: dict[int, Any] = {}
    failed: set[int] = set()
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        # States this batch aborts: their open and writes are skipped.
        aborted = {m[1] for m in batch if m[0] == "abort"}
        for msg in batch:
            if os.getppid() != parent:
                # The training process died (we were re-parented): what is left
                # in the socket belongs to a save nobody will commit. Stop
                # touching the checkpoint directory that the next run's
                # cleanup removes.
                return
            _handle(conn, view, msg, writers, failed, aborted)


def _handle(conn: Any, view: memoryview, msg: tuple[Any, ...], writers: dict[int, Any],
            failed: set[int], aborted: Container[int] = ()) -> None:
    """One message of a batch (module docstring); errors answered, not raised
    (but a closed socket: ``BrokenPipeError`` / ``ConnectionResetError``)."""
    from checkpoint_store.state._files import StateWriter

    op, sid = msg[0], msg[1]
    try:
        if op == "write":
            _, _, key, off, n, at = msg
            if sid not in failed:
                writers[sid].write(key, view[off:off + n], offset=at)
            conn.send(("freed", off, n))
        elif op == "open":
            _, _, directory, layout = msg
            if sid in aborted:
                failed.add(sid)  # its writes only free their bytes
            else:
                writers[sid] = StateWriter(directory, layout, create=False)
        elif op == "abort":
            failed.discard(sid)
            writer = writers.pop(sid, None)
            if writer is not None:
                writer.abort()
        elif op == "close":
            if sid in failed:
                failed.discard(sid)
                return
            writer = writers.pop(sid)
            index = writer.close(fsync=bool(msg[2]))
            conn.send(("closed", sid, index, _file_crcs(writer, index, writer.directory)))
        elif op == "ping":
            conn.send(("pong", sid))
        else:
            raise ValueError(f"unknown message {op!r}")
    except OSError as exc:
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            raise
        _failed(conn, msg, sid, failed, writers)
    except Exception:
        _failed(conn, msg, sid, failed, writers)


def error_facts(exc: BaseException) -> dict[str, Any]:
    """What crosses the process boundary of an exception: plain data (the
    exception itself may not pickle, nor its class import in the parent).

    Returns:
        ``{"type": class name, "module": its module, "message": str(exc),
        "errno", "strerror", "filename"}`` (the last three None unless it is
        an ``OSError`` with an errno).
    """
    facts: dict[str, Any] = {"type": type(exc).__name__, "module": type(exc).__module__,
                             "message": str(exc), "errno": None, "strerror": None,
                             "filename": None}
    if isinstance(exc, OSError) and isinstance(exc.errno, int):
        facts.update(errno=exc.errno, strerror=exc.strerror,
                     filename=None if exc.filename is None else str(exc.filename))
    return facts


def error_from_facts(facts: dict[str, Any] | None, text: str, directory: str) -> BaseException:
    """The exception the training process raises for a failure the persist
    process reported (:func:`error_facts`, and its traceback ``text``):
    the type the same failure has on the directory path.

    * an ``OSError`` with an errno: rebuilt (``OSError(errno, ...)`` picks
      ``PermissionError``, ...), then typed as every storage write types it
      (:func:`checkpoint_store._util.retry.typed_permanent`):
      :class:`~checkpoint_store.errors.StorageFullError` for ``ENOSPC`` /
      ``EDQUOT``, :class:`~checkpoint_store.errors.PermanentBackendError`
      for another (a read-only or unwritable directory), ``FileNotFoundError``
      as it is;
    * one of :mod:`checkpoint_store.errors` or a builtin exception: that
      class, with the message;
    * anything else, or no facts (an older process): a
      :class:`~checkpoint_store.errors.PersistProcessError` with the text.

    The persist process's traceback is added as a note either way.
    """
    import builtins

    from checkpoint_store import errors
    from checkpoint_store._util.retry import typed_permanent

    what = f"the persist process could not write {directory}"
    exc: BaseException | None = None
    if facts is not None:
        name, message = str(facts.get("type")), str(facts.get("message"))
        if isinstance(facts.get("errno"), int):
            os_error = OSError(facts["errno"], facts.get("strerror") or message,
                               facts.get("filename"))
            exc = typed_permanent(os_error, f"write the state into {directory}")
        else:
            home = {"checkpoint_store.errors": errors, "builtins": builtins}.get(
                str(facts.get("module")))
            cls = getattr(home, name, None) if home is not None else None
            if isinstance(cls, type) and issubclass(cls, Exception) and \
                    cls is not errors.PersistProcessError:
                try:
                    exc = cls(f"{what}: {message}")
                except TypeError:  # a constructor with required fields
                    exc = None
    if exc is None:
        return errors.PersistProcessError(f"{what}: {text}")
    if hasattr(exc, "add_note"):
        exc.add_note(f"raised in the persist process:\n{text}")
    return exc


def _failed(conn: Any, msg: tuple[Any, ...], sid: int, failed: set[int],
            writers: dict[int, Any]) -> None:
    failed.add(sid)
    writer = writers.pop(sid, None)
    if writer is not None:
        writer.abort()
    if msg[0] == "write":
        conn.send(("freed", msg[3], msg[4]))
    exc = sys.exc_info()[1]
    facts = error_facts(exc) if exc is not None else None
    conn.send(("error", sid, traceback.format_exc(limit=4), facts))


_spawner: Any = None


def _from_spawner_thread(start: Any) -> Any:
    """Run ``start()`` (a ``Popen``) on one thread that lives as long as the
    process: the persist process asks the kernel to kill it when the thread
    that started it ends (``PR_SET_PDEATHSIG``), so a thread that reported
    and ended must not be that thread."""
    import queue
    import threading

    global _spawner
    if _spawner is None:
        requests: queue.Queue[Any] = queue.Queue()

        def serve() -> None:
            while True:
                fn, box, done = requests.get()
                try:
                    box.append((True, fn()))
                except BaseException as exc:  # handed back to the caller
                    box.append((False, exc))
                done.set()

        threading.Thread(target=serve, name="checkpoint-store-spawner", daemon=True).start()
        _spawner = requests
    box: list[Any] = []
    done = threading.Event()
    _spawner.put((start, box, done))
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _die_with_parent() -> None:
    """Linux: be killed (SIGKILL) when the training process dies, so no write
    of a save nobody will commit races the next run's cleanup."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class PersistProcess:
    """The training process's handle on one persist process.

    Args:
        area_fd: file descriptor of the staging area (passed to the process).
        size: its size in bytes.
        on_message: called on a reader thread with every answer (a tuple).
        on_exit: called on that thread, once, when the process has exited
            (killed, or its socket closed), with its exit code.

    A process that does not answer within ``start_timeout_s`` is killed
    (``on_exit`` then fails what was sent to it).
    """

    def __init__(self, area_fd: int, size: int, on_message: Any, on_exit: Any,
                 start_timeout_s: float = 120.0):
        import socket
        import subprocess
        import threading
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The process imports this very package, wherever it was imported from.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(
            [root, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
        try:
            self.proc = _from_spawner_thread(lambda: subprocess.Popen(
                [sys.executable, "-m", "checkpoint_store.state._persist",
                 str(theirs.fileno()), str(area_fd), str(size), str(os.getpid())],
                pass_fds=(theirs.fileno(), area_fd), stdin=subprocess.DEVNULL,
                env=env, close_fds=True,
                # Its own session and process group: a Ctrl-C in the terminal
                # and a SIGTERM or SIGINT to the job's process group (torchrun,
                # SLURM, a container's stop) leave it writing, so the saves
                # report() acknowledged are committed while the training
                # process ends; it still dies with that process (PDEATHSIG).
                start_new_session=True,
            ))
        finally:
            theirs.close()
        self._sock = ours
        self.conn = Connection(os.dup(ours.fileno()))
        self._send_lock = threading.Lock()
        self.pid = self.proc.pid  # exec'd directly: the interpreter is this pid
        self._start_timeout_s = start_timeout_s
        self._on_message, self._on_exit = on_message, on_exit
        # Not waited for here: messages sent meanwhile wait in the socket, so
        # a first save that fits in staging never waits for the interpreter
        # to start. The reader thread waits for its "ready".
        self._reader = threading.Thread(target=self._read, name="checkpoint-store-persist",
                                        daemon=True)
        self._reader.start()

    def send(self, msgs: list[tuple[Any, ...]]) -> None:
        """Send a batch of messages (module docstring), in one write.

        Raises:
            PersistProcessError: the process is gone.
        """
        from checkpoint_store.errors import PersistProcessError

        try:
            with self._send_lock:
                self.conn.send(msgs)
        except (OSError, ValueError) as exc:
            raise PersistProcessError(
                f"the persist process (pid {self.pid}) is gone: {exc}") from exc

    def _read(self) -> None:
        import logging

        try:
            ready = self.conn.poll(self._start_timeout_s) and self.conn.recv()
        except (EOFError, OSError):
            ready = None
        if not ready:
            logging.getLogger(__name__).error(
                "the persist process (pid %d) did not start within %s s", self.pid,
                self._start_timeout_s)
            self.proc.kill()
        while ready:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            self._on_message(msg)
        code = self.proc.wait()
        self._on_exit(code)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 30.0) -> None:
        """Close the socket (the process exits once it has written everything
        already sent) and wait for it; killed after ``timeout`` seconds."""
        import socket
        import subprocess

        try:
            # A shutdown, not a close: the reader thread is blocked in recv() on
            # this socket, and a close would not wake it nor end the process.
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout)
        for close in (self.conn.close, self._sock.close):
            try:
                close()
            except OSError:
                pass


def main(argv: list[str]) -> int:
    """``python -m checkpoint_store.state._persist <socket fd> <area fd> <area bytes>
    <parent pid>``."""
    from multiprocessing.connection import Connection

    from checkpoint_store._util.background import yield_to_training

    sock_fd, area_fd, size, parent = (int(a) for a in argv[:4])
    _die_with_parent()
    if os.getppid() != parent:
        # The training process died while this interpreter started: what
        # waits in the socket is a save nobody will commit (writing it could
        # recreate a directory the next run's cleanup removed).
        return 0
    # Background work: where cores are short, the training loop goes first,
    # and a batch of messages that wakes this process while the training
    # thread still runs does not preempt it (nice, SCHED_BATCH).
    yield_to_training("CHECKPOINT_STORE_PERSIST_NICE", whole_process=True)
    conn = Connection(sock_fd)
    area = mmap.mmap(area_fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(area_fd)
    try:
        conn.send(("ready", os.getpid()))
        _serve(conn, area, parent)
    except OSError:  # the parent closed the socket (or died) while we answered
        pass
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
