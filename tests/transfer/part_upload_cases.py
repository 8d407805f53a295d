"""Set-up shared by the parallel part-upload tests of both object stores
(tests/transfer/test_part_uploads.py for S3 multipart uploads,
tests/transfer/test_azure_block_uploads.py for Azure staged blocks): the
same tree, the same injected part failures, the same source rewritten
between two parts."""

from __future__ import annotations

import errno
import os
import threading

from checkpoint_store._transfer import tasks as _tasks

MiB = 1024 * 1024
#: With this budget the parts are the smallest we cut (5 MiB): several per file.
BUDGET = 32 * MiB
SIZES = {"model.bin": 23 * MiB + 7, "optim.bin": 17 * MiB + 3, "meta.json": 100}
#: A permanent error (retrying will not fix it) for fail_parts_after.
DENIED = PermissionError(errno.EACCES, "injected failure half-way")


def make_tree(root, sizes: dict[str, int]) -> dict[str, bytes]:
    """Random files of ``sizes`` (bytes) under ``root``; returns their bytes by name."""
    out = {}
    for rel, size in sizes.items():
        out[rel] = os.urandom(size)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(out[rel])
    return out


def fail_parts_after(monkeypatch, parts_in: int, exc: OSError) -> list[int]:
    """Parts after the first ``parts_in`` raise ``exc`` (once each when it is
    transient, a ConnectionError: the retry then sends them); returns the
    call count, updated as parts are sent."""
    real = _tasks.TransferTasks._upload_part
    calls = [0]
    failed: set[tuple[str, int]] = set()
    lock = threading.Lock()

    def flaky(self, rel, offset, length):
        with lock:
            calls[0] += 1
            n = calls[0]
            fail = n > parts_in and (not isinstance(exc, ConnectionError)
                                     or (rel, offset) not in failed)
            failed.add((rel, offset))
        if fail:
            raise exc
        return real(self, rel, offset, length)

    monkeypatch.setattr(_tasks.TransferTasks, "_upload_part", flaky)
    return calls


def rewrite_between_parts(src, monkeypatch, rel: str = "model.bin") -> threading.Event:
    """Append to ``src/rel`` just before its second part is read; the event
    is set once it was. Each part is read on its own, so such a file would
    be stored as a mix of both versions under a checksum of neither: the
    upload must fail instead."""
    real = _tasks.TransferTasks._upload_part
    done = threading.Event()

    def write_first(self, name, offset, length):
        if name == rel and offset and not done.is_set():
            done.set()
            with open(src / rel, "ab") as f:
                f.write(b"late")
        return real(self, name, offset, length)

    monkeypatch.setattr(_tasks.TransferTasks, "_upload_part", write_first)
    return done


def record_part_events(monkeypatch, kind: type) -> list[tuple[str, str]]:
    """Patch ``kind`` (S3Multipart or AzureBlocks) to record, in order,
    ``("part", file name)`` for each part sent and ``("complete", file
    name)`` for each completion; the requests still go."""
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_put, real_complete = kind.put_part, kind.complete

    def name(upload) -> str:
        return upload.describe().split(" ")[0].rsplit("/", 1)[-1]

    def put_part(upload, number, data):
        real_put(upload, number, data)
        with lock:
            events.append(("part", name(upload)))

    def complete(upload, parts):
        real_complete(upload, parts)
        with lock:
            events.append(("complete", name(upload)))

    monkeypatch.setattr(kind, "put_part", put_part)
    monkeypatch.setattr(kind, "complete", complete)
    return events


def assert_each_upload_completes_after_its_last_part(events: list[tuple[str, str]]) -> None:
    """With one worker (parts in file order): each file's upload completes
    right after its own last part, before the next file's first part."""
    files = [n for kind, n in events if kind == "part"]
    order = list(dict.fromkeys(files))
    assert len(order) == 2, events
    want = [("part", order[0])] * files.count(order[0]) + [("complete", order[0])]
    want += [("part", order[1])] * files.count(order[1]) + [("complete", order[1])]
    assert events == want
