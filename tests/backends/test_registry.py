"""The backend registry: entry points, precedence, clobber, errors, laziness."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from checkpoint_store import (
    BackendUnavailableError,
    InvalidConfigError,
    StorageContext,
    UnknownSchemeError,
    available_backends,
    register_backend,
    registry,
)
from checkpoint_store.backends import Backend, Capabilities
from checkpoint_store.registry import resolve, unregister_backend

CLOUD_MODULES = (
    "boto3", "botocore", "aiobotocore", "s3fs", "adlfs", "azure", "gcsfs", "google.cloud",
    "google.auth", "checkpoint_store_s3", "checkpoint_store_azure", "checkpoint_store_gcs",
    "checkpoint_store_toy",
)


@pytest.fixture
def clean_registry(monkeypatch):
    """Code registrations and the entry-point cache are restored after the test."""
    monkeypatch.setattr(registry, "_code_registered", {})
    monkeypatch.setattr(registry, "_entry_points", None)
    yield
    registry._entry_points = None


def _fake_eps(monkeypatch, *eps: tuple[str, str, str]) -> None:
    """Replace installed entry points by ``(scheme, value, distribution)`` triples."""
    fake = [SimpleNamespace(name=n, value=v, dist=SimpleNamespace(name=d)) for n, v, d in eps]
    monkeypatch.setattr(registry, "entry_points", lambda group: list(fake))
    monkeypatch.setattr(registry, "_entry_points", None)


def _memory_backend(uri, options):
    return Backend(registry.wrap_filesystem(MemoryFileSystem()), scheme="cstest",
                   capabilities=Capabilities(directories=True), name="cstest")


BUILTIN_EPS = (
    ("file", "checkpoint_store.backends.local:local_backend", "checkpoint-store"),
    ("local", "checkpoint_store.backends.local:local_backend", "checkpoint-store"),
    ("memory", "checkpoint_store.backends.memory:memory_backend", "checkpoint-store"),
)


def test_import_loads_no_cloud_sdk_and_lists_plugins_from_metadata():
    code = textwrap.dedent(
        f"""
        import json, sys
        import checkpoint_store
        import checkpoint_store.testing.plugin   # loaded by every pytest run (pytest11)
        from checkpoint_store.registry import resolve
        listed = checkpoint_store.available_backends()
        resolve("relative/dir")          # a local path resolves without any plugin
        resolve("memory://bucket/x")
        bad = sorted(m for m in sys.modules
                     if any(m == c or m.startswith(c + ".") for c in {CLOUD_MODULES!r}))
        print(json.dumps({{"bad": bad, "listed": listed}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bad"] == []
    listed = result["listed"]
    assert {k: listed[k] for k in ("file", "local", "memory")} == {
        "file": "checkpoint-store", "local": "checkpoint-store", "memory": "checkpoint-store"}
    assert {k: listed[k] for k in ("s3", "s3a")} == {"s3": "checkpoint-store-s3",
                                                    "s3a": "checkpoint-store-s3"}
    assert {k: listed[k] for k in ("az", "abfs", "abfss")} == dict.fromkeys(
        ("az", "abfs", "abfss"), "checkpoint-store-azure")
    assert {k: listed[k] for k in ("gs", "gcs")} == dict.fromkeys(("gs", "gcs"),
                                                                  "checkpoint-store-gcs")
    assert listed["toy"] == "checkpoint-store-toy"


def test_toy_plugin_is_found_through_its_entry_point_alone(tmp_path, clean_registry):
    assert "toy" not in registry._BUILTINS and "toy" not in registry.KNOWN_PLUGINS
    backend, path = resolve("toy://bucket/run", storage_options={"root": str(tmp_path)})
    # The toy's fsspec DirFileSystem has no root marker: paths without a leading '/'.
    assert backend.name == "toy" and path == "bucket/run"
    assert type(backend).__module__ == "checkpoint_store.backends.base"
    assert registry._load_entry_points()["toy"] == (
        "checkpoint_store_toy:toy_backend", "checkpoint-store-toy")


def test_register_needs_clobber_to_replace(clean_registry):
    register_backend("cstest", _memory_backend)
    with pytest.raises(InvalidConfigError, match="already registered in code.*clobber=True"):
        register_backend("cstest", _memory_backend)
    register_backend("cstest", _memory_backend, clobber=True)
    assert available_backends()["cstest"] == "code"
    # Plugins and built-ins are protected the same way.
    with pytest.raises(InvalidConfigError, match="checkpoint-store-s3"):
        register_backend("s3", _memory_backend)
    with pytest.raises(InvalidConfigError, match="by checkpoint-store;"):
        register_backend("memory", _memory_backend)


def test_code_registration_wins_over_plugins_and_builtins(clean_registry):
    register_backend("s3", _memory_backend, clobber=True)
    register_backend("memory", _memory_backend, clobber=True)
    assert resolve("s3://bucket/x")[0].name == "cstest"
    assert resolve("memory://bucket/x")[0].name == "cstest"
    assert available_backends()["s3"] == "code"
    unregister_backend("s3")
    assert resolve("s3://bucket/x", storage_options={"region": "us-east-1"})[0].name == (
        "S3 (pyarrow)")


def test_plugin_entry_points_win_over_builtins(monkeypatch, clean_registry):
    _fake_eps(
        monkeypatch, *BUILTIN_EPS,
        ("memory", "checkpoint_store_toy:toy_backend", "checkpoint-store-toy"),
    )
    assert available_backends()["memory"] == "checkpoint-store-toy"
    assert resolve("memory://b/x", storage_options={"root": "/tmp/cs-toy-prec"})[0].name == "toy"


def test_two_plugins_for_one_scheme_warn_and_first_by_name_wins(monkeypatch, clean_registry):
    _fake_eps(
        monkeypatch, *BUILTIN_EPS,
        ("dup", "checkpoint_store.backends.memory:memory_backend", "zeta-plugin"),
        ("dup", "checkpoint_store_toy:toy_backend", "alpha-plugin"),
    )
    with pytest.warns(UserWarning, match="both alpha-plugin and zeta-plugin"):
        assert available_backends()["dup"] == "alpha-plugin"


@pytest.mark.parametrize("scheme", ["S3", "3fs", "my fs", "", "a/b", "s3://", None])
def test_malformed_schemes_are_refused(scheme, clean_registry):
    with pytest.raises(InvalidConfigError, match="invalid scheme"):
        register_backend(scheme, _memory_backend)


def test_dotted_path_is_imported_on_first_use(tmp_path, clean_registry):
    register_backend("lazytoy", "checkpoint_store_toy:toy_backend")
    register_backend("broken", "no_such_module_cs:factory")
    assert resolve("lazytoy://b/x", storage_options={"root": str(tmp_path)})[0].name == "toy"
    with pytest.raises(BackendUnavailableError, match="no_such_module_cs"):
        resolve("broken://b/x")
    with pytest.raises(InvalidConfigError, match="not 'package.module:function'"):
        register_backend("worse", "not a path")
    with pytest.raises(TypeError, match="callable"):
        register_backend("worse", 42)


def test_factory_returning_a_non_backend_is_a_type_error_naming_the_plugin(
    monkeypatch, clean_registry
):
    _fake_eps(monkeypatch, *BUILTIN_EPS,
              ("bad", "checkpoint_store_toy:not_a_backend", "checkpoint-store-toy"))
    with pytest.raises(TypeError) as exc:
        resolve("bad://bucket/x")
    msg = str(exc.value)
    assert "checkpoint_store_toy:not_a_backend" in msg
    assert "checkpoint-store-toy" in msg
    assert "LocalFileSystem" in msg
    register_backend("badcode", lambda uri, opts: "oops")
    with pytest.raises(TypeError, match="'badcode'.*returned str"):
        resolve("badcode://bucket/x")


@pytest.mark.parametrize(
    "uri, dist",
    [("s3://b/x", "checkpoint-store-s3"), ("s3a://b/x", "checkpoint-store-s3"),
     ("az://c/x", "checkpoint-store-azure"), ("abfss://c/x", "checkpoint-store-azure"),
     ("gs://b/x", "checkpoint-store-gcs"), ("gcs://b/x", "checkpoint-store-gcs")],
)
def test_missing_cloud_plugin_says_what_to_install(uri, dist, monkeypatch, clean_registry):
    _fake_eps(monkeypatch, *BUILTIN_EPS)  # as if only the core were installed
    with pytest.raises(BackendUnavailableError, match=f"pip install {dist}$"):
        resolve(uri)


def test_plugin_that_fails_to_import_says_to_reinstall(monkeypatch, clean_registry):
    _fake_eps(monkeypatch, *BUILTIN_EPS,
              ("s3", "checkpoint_store_s3_gone:s3_backend", "checkpoint-store-s3"))
    with pytest.raises(BackendUnavailableError,
                       match="pip install --force-reinstall checkpoint-store-s3"):
        resolve("s3://b/x")


class _FallbackFS(MemoryFileSystem):
    protocol = "csfallback"
    store: dict = {}
    pseudo_dirs = [""]


def test_scheme_only_fsspec_knows_falls_back_with_a_warning(clean_registry):
    fsspec.register_implementation("csfallback", _FallbackFS, clobber=True)
    try:
        with pytest.warns(UserWarning, match="untested"):
            ctx = StorageContext("csfallback://bucket/run", "exp", "trial")
        assert ctx.backend.name == "fsspec:csfallback"
        ctx.write_params({"a": 1})
        assert _FallbackFS.store  # the bytes went into the fsspec filesystem
        assert ctx.uri(ctx.trial_path) == "csfallback://bucket/run/exp/trial"
    finally:
        sys.modules["fsspec.registry"]._registry.pop("csfallback", None)


def test_fallback_to_a_store_with_real_directories(tmp_path, clean_registry):
    """An fsspec protocol with real directories (like sftp) gets them created."""
    from fsspec.implementations.local import LocalFileSystem

    class StrictDirs(LocalFileSystem):
        protocol = "csdirfs"

        def __init__(self, **kwargs):
            super().__init__(auto_mkdir=False, **kwargs)

    fsspec.register_implementation("csdirfs", StrictDirs, clobber=True)
    try:
        with pytest.warns(UserWarning, match="untested"):
            ctx = StorageContext(f"csdirfs://{tmp_path}/store", "exp", "trial")
        assert ctx.backend.capabilities.directories
        src = tmp_path / "src" / "sub"
        src.mkdir(parents=True)
        (src / "w.bin").write_bytes(b"w" * 100)
        from checkpoint_store import Checkpoint

        ckpt = ctx.persist_checkpoint(Checkpoint.from_directory(tmp_path / "src"), 0, {})
        assert ckpt.is_committed
        assert (tmp_path / "store/exp/trial/checkpoint_000000/sub/w.bin").read_bytes() == (
            b"w" * 100)
    finally:
        sys.modules["fsspec.registry"]._registry.pop("csdirfs", None)


def test_unknown_scheme_lists_the_registered_ones(clean_registry):
    with pytest.raises(UnknownSchemeError) as exc:
        resolve("nosuchscheme://bucket/x")
    msg = str(exc.value)
    for scheme in ("file", "memory", "s3", "az", "gs", "toy"):
        assert scheme in msg
    assert "register_backend" in msg


@pytest.mark.parametrize("location", ["s3:/bucket/x", "s3:bucket/x", "nosuch:thing"])
def test_a_string_with_a_scheme_is_never_a_local_path(location, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidConfigError, match="malformed URI"):
        StorageContext(location, "exp", "trial").write_params({"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_scheme_is_case_insensitive(clean_registry):
    assert resolve("MEMORY://bucket/x")[0].scheme == "memory"


def test_fallback_warning_is_not_raised_for_registered_schemes(clean_registry):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve("memory://bucket/x")
