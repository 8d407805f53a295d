"""BackendTests: the conformance suite every storage backend must pass.

A plugin author subclasses :class:`BackendTests` in their own test suite and
supplies one fixture, ``storage_location``: a fresh, empty place on their store
as a :class:`~checkpoint_store.testing.StorageLocation` (a URI and storage
options). The URI is resolved through the registry, so the suite also proves
that the plugin's entry point is found. Optionally they supply
``raw_objects``: a zero-argument callable listing what the store really holds
(``{path inside the filesystem: size in bytes}``), read behind the backend's
back, which enables the checks on zero-byte and directory-marker objects.

The model is zarr's ``zarr.testing.store.StoreTests``::

    import pytest
    from checkpoint_store.testing import BackendTests, StorageLocation

    class TestMyStore(BackendTests):
        @pytest.fixture
        def storage_location(self, my_server):
            bucket = my_server.new_bucket()
            return StorageLocation(f"myfs://{bucket}/run", {"endpoint": my_server.url})

        @pytest.fixture
        def raw_objects(self, my_server, storage_location):
            return lambda: my_server.list_everything()

What is checked: write/read/overwrite/list/delete through the filesystem;
byte-identical directory round-trips (nested directories, empty and
multi-MiB files, names with spaces, ``%``, ``#`` and non-ASCII letters);
only committed checkpoints are visible; deletes are idempotent; missing
paths raise not-found errors; URI joining and trailing slashes; secrets
absent from ``repr``; that each declared capability holds; incremental
reports (files copied from the previous checkpoint) stay self-contained; and
that nothing
is written outside its place: a source key ``sub/../../../escape.bin`` (where
the store keeps such a key literally) is refused by ``report()`` and
``to_directory()`` before the first byte, and a download into the checkpoint
itself is refused (checkpoints on the local disk).

Paths and names: every spelling of one storage path (``bucket/runs``,
``bucket/runs/``, ``/bucket/runs``) given with the backend's filesystem
instance names one place whose listings match it
(:meth:`~checkpoint_store.backends.Backend.normalize_path`); names holding
``[``, ``*`` or ``?`` are literal on every listing, delete, copy and move,
so trial ``t[x]`` never touches trial ``tx``; a character the backend
declares it cannot store
(:attr:`~checkpoint_store.backends.Capabilities.unsupported_name_characters`)
is refused with ``InvalidConfigError`` in experiment, trial and checkpoint
file names before anything is written, and the other checks leave such names
out; and concurrent readers of one checkpoint each get the right bytes.

The checks come in topics, one module each, all stand on the fixtures of
:mod:`~checkpoint_store.testing.conformance._base`: the filesystem and its
capabilities (:mod:`.filesystem`), checkpoints and sessions
(:mod:`.checkpoints`), paths and names (:mod:`.names`), nothing written
outside its place (:mod:`.containment`), and what other tools leave on
the store (:mod:`.placeholders`: directory placeholders and objects named
like a directory beside its prefix never make a checkpoint look damaged;
enabled by the ``raw_placeholder`` and ``raw_object`` fixtures).
:class:`BackendTests` inherits them all; subclass it, not a topic, so
that a check added later reaches your backend too.
"""

from __future__ import annotations

from checkpoint_store.testing.conformance._base import (
    SAMPLE_TREE,
    BackendFixtures,
    make_tree,
    read_tree,
)
from checkpoint_store.testing.conformance.checkpoints import CheckpointTests
from checkpoint_store.testing.conformance.containment import ContainmentTests
from checkpoint_store.testing.conformance.filesystem import FilesystemTests
from checkpoint_store.testing.conformance.names import NameTests
from checkpoint_store.testing.conformance.placeholders import PlaceholderTests

__all__ = ["SAMPLE_TREE", "BackendFixtures", "BackendTests", "make_tree", "read_tree"]


# pytest collects inherited tests base first (reverse MRO): listed last runs first.
class BackendTests(PlaceholderTests, ContainmentTests, NameTests, CheckpointTests,
                   FilesystemTests):
    """Base class of the backend conformance suite (see the module docstring).

    Fixtures a subclass provides:
        storage_location: a fresh, empty :class:`StorageLocation` per test (required).
        raw_objects: ``() -> {path: size}`` listing the store behind the
            backend's back, or None (the default) to skip those checks.
        raw_placeholder: ``(directory path) -> None`` marking a directory as
            other tools do on the store (default: an empty directory where
            the store has real ones, else None: skipped).
        raw_object: ``(path, data) -> None`` writing an object behind the
            backend's back, None (the default) to skip those checks.
    """
