"""Child of test_background_deletes: reports with num_to_keep=1 until the background
delete of the first evicted checkpoint is half done, then waits to be killed.

``python _kill_mid_delete_child.py STORAGE_PATH READY_FILE SRC_DIR [URI_OPTIONS_JSON]``

The storage is the real one (a local directory, or an S3 URI with its options)
behind a forwarding filesystem that, once half of a checkpoint's data files
are deleted, touches READY_FILE and stops (the kill lands mid-delete).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pyarrow.fs as pafs

from checkpoint_store import Checkpoint, CheckpointConfig, StorageContext
from checkpoint_store.backends.base import Backend
from checkpoint_store.backends.forwarding import ForwardingHandler
from checkpoint_store.registry import resolve
from checkpoint_store.session import Session


class HalfDeleteThenStop(ForwardingHandler):
    """Deletes go through until ``limit`` data files of checkpoints are gone, then the
    deleting thread stops for good (the process is killed while it waits)."""

    def __init__(self, inner: pafs.FileSystem, ready: str, limit: int):
        super().__init__(inner)
        self.ready, self.limit, self.done = ready, limit, 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def _stop_if_due(self) -> None:
        with self.lock:
            self.done += 1
            due = self.done >= self.limit
        if due:
            self.stopped.set()
            while True:
                time.sleep(60)

    def delete_dir(self, path: str) -> None:
        if "checkpoint_" not in path:
            return self.inner.delete_dir(path)
        # One data file at a time, so that the stop lands inside this directory.
        infos = self.inner.get_file_info(pafs.FileSelector(path, recursive=True))
        for fi in sorted(infos, key=lambda f: f.path):
            if fi.type == pafs.FileType.File and not fi.base_name.startswith(".cs_"):
                self.inner.delete_file(fi.path)
                self._stop_if_due()
        self.inner.delete_dir(path)

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)
        name = path.rsplit("/", 1)[-1]
        if "checkpoint_" in path and not name.startswith(".cs_") and not name.endswith(".json"):
            self._stop_if_due()


def main() -> None:
    storage_path, ready, src = sys.argv[1:4]
    opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    backend, root = resolve(storage_path, storage_options=opts)
    n_files = sum(len(files) for _, _, files in os.walk(src))
    handler = HalfDeleteThenStop(backend.filesystem, ready, n_files // 2)
    fs = pafs.PyFileSystem(handler)
    # The store's own commit protocol (rename on local disks, marker last on S3).
    gated = Backend(fs, scheme=backend.scheme, capabilities=backend.capabilities,
                    name=backend.name)
    s = Session(StorageContext.from_backend(gated, root, "exp", "t"),
                CheckpointConfig(num_to_keep=1))
    for i in range(3):
        s.report({"step": i}, checkpoint=Checkpoint.from_directory(src))
    # All three reported, and the first eviction's delete stuck half-way: ready.
    handler.stopped.wait()
    with open(ready, "w") as f:
        f.write(str(handler.done))
    while True:  # the first eviction's delete is stuck half-way: wait for the kill
        time.sleep(60)


if __name__ == "__main__":
    main()
