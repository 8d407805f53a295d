"""The filesystem a transfer writes through (``backends.clients.writer_of``): a pyarrow
S3FileSystem made without ``allow_delayed_open`` gets a twin with it, the same
in every other option; every other filesystem is used as given."""

from __future__ import annotations

import gc
import threading

import pyarrow.fs as pafs

from checkpoint_store.backends import clients


def _options(fs: pafs.S3FileSystem) -> dict:
    return dict(fs.__reduce__()[1][0])


def _s3(**kw) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(endpoint_override="127.0.0.1:9", scheme="http", access_key="k",
                             secret_key="s", region="us-east-1", **kw)


def test_other_filesystems_are_used_as_given() -> None:
    local = pafs.LocalFileSystem()
    assert clients.writer_of(local) is local
    delayed = _s3(allow_delayed_open=True)
    assert clients.writer_of(delayed) is delayed


def test_a_twin_differs_only_in_delayed_open_and_is_kept_while_the_original_lives() -> None:
    user = _s3(request_timeout=7.0, default_metadata={"owner": "me"})
    twin = clients.writer_of(user)
    assert twin is not user and clients.writer_of(user) is twin
    want = {**_options(user), "allow_delayed_open": True}
    assert _options(twin) == want
    key = ("writer", id(user))
    assert key in clients._TWINS
    del user, twin
    gc.collect()
    assert key not in clients._TWINS


def test_a_user_filesystem_collected_while_the_twins_are_locked_does_not_deadlock() -> None:
    # The cycle collector can run on any allocation, also inside writer_of's
    # locked section (the weakref and tuple it makes there); a filesystem held
    # only by a garbage cycle (a StorageContext of a finished trial, say) then
    # has its weakref callback run on that same thread, under the lock.
    user = _s3()
    clients.writer_of(user)
    holder: dict = {"fs": user}
    holder["self"] = holder  # collectable only by the cycle collector
    key = ("writer", id(user))
    del user, holder
    done = threading.Event()

    def collect_under_the_lock() -> None:
        with clients._TWINS_LOCK:
            gc.collect()
        done.set()

    gc.disable()  # no collection before the one under the lock
    try:
        threading.Thread(target=collect_under_the_lock, daemon=True).start()
        assert done.wait(10), "the weakref callback waited for a lock its own thread held"
    finally:
        gc.enable()
    assert key not in clients._TWINS
