"""URI <-> path rules: joining, trailing slashes, odd characters (no server needed)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store import InvalidConfigError, StorageContext
from checkpoint_store.registry import resolve

# Options that build each filesystem without contacting anything.
OFFLINE = {
    "s3": {"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1",
           "access_key_id": "a", "secret_access_key": "b"},
    "s3a": {"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1",
            "access_key_id": "a", "secret_access_key": "b"},
    "az": {"account_name": "acct", "account_key": "a2V5"},
    "abfs": {"account_name": "acct", "account_key": "a2V5"},
    "abfss": {"account_key": "a2V5"},
    "gs": {"endpoint_url": "http://127.0.0.1:9", "token": "anon"},
    "gcs": {"endpoint_url": "http://127.0.0.1:9", "token": "anon"},
    "memory": None,
    "file": None,
}


def _opts(uri: str):
    return OFFLINE[uri.split("://", 1)[0]]


@pytest.mark.parametrize(
    "base, joined",
    [
        ("s3://bucket/a", "s3://bucket/a/x"),
        ("s3://bucket/a/", "s3://bucket/a/x"),
        ("s3://bucket", "s3://bucket/x"),
        ("s3a://bucket/a", "s3a://bucket/a/x"),
        ("memory://a", "memory://a/x"),
        ("memory://a/b/", "memory://a/b/x"),
        ("az://container/a", "az://container/a/x"),
        ("abfs://container/a/", "abfs://container/a/x"),
        ("abfss://container@acct.dfs.core.windows.net/a",
         "abfss://container@acct.dfs.core.windows.net/a/x"),
        ("gs://bucket/a", "gs://bucket/a/x"),
        ("gcs://bucket/a/", "gcs://bucket/a/x"),
        ("file:///tmp/cs-paths/a", "file:///tmp/cs-paths/a/x"),
        ("file:///tmp/cs-paths/a/", "file:///tmp/cs-paths/a/x"),
    ],
)
def test_join(base, joined):
    ctx = StorageContext(base, "x", "trial", storage_options=_opts(base))
    assert ctx.uri(ctx.experiment_path) == joined
    assert ctx.uri(ctx.trial_path) == joined + "/trial"


@pytest.mark.parametrize("scheme", ["s3", "az", "gs", "memory", "file"])
@pytest.mark.parametrize("key", ["a b/c d", "100%/%41%2F", "x#y/#", "ünïcödé/名前/ß",
                                 "mixed ü %# end"])
def test_odd_keys_round_trip(scheme, key):
    root = "/tmp/cs-paths" if scheme == "file" else "bucket"
    uri = f"{scheme}://{root.lstrip('/') if scheme != 'file' else root}/{key}"
    if scheme == "file":  # file:// paths are percent-decoded (RFC 8089): "%" is "%25"
        uri = f"file://{root}/{key.replace('%', '%25')}"
    backend, path = resolve(uri, storage_options=_opts(uri))
    assert path.endswith(key)
    assert backend.uri_for(path) == uri
    assert resolve(uri + "/", storage_options=_opts(uri))[1] == path


@pytest.mark.parametrize("uri", ["s3://", "s3:///", "gs://", "az://"])
def test_uri_without_bucket_is_refused(uri):
    with pytest.raises(InvalidConfigError, match="names no bucket"):
        resolve(uri, storage_options=_opts(uri))


def test_azure_account_in_uri_sets_the_account():
    backend, path = resolve("abfss://data@myacct.dfs.core.windows.net/runs",
                            storage_options={"account_key": "a2V5"})
    assert path == "data/runs"
    assert backend.filesystem.handler.fs.account_name == "myacct"


_segment = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\"),
    min_size=1, max_size=12,
).filter(lambda s: s not in (".", ".."))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["s3", "gs", "az", "memory"]), st.lists(_segment, min_size=1, max_size=4))
def test_any_key_round_trips_through_uri_and_path(scheme, segments):
    key = "/".join(segments)
    uri = f"{scheme}://bucket/{key}"
    if re.search(r"\?[A-Za-z_][\w.\-]*=", key):
        # A URL query ("?versionId=1"): refused, never read as part of a name.
        with pytest.raises(InvalidConfigError, match="URL query"):
            resolve(uri, storage_options=_opts(uri))
        return
    backend, path = resolve(uri, storage_options=_opts(uri))
    assert path.rstrip("/").endswith(key)
    assert backend.uri_for(path) == uri
    if set(key) & set(backend.capabilities.unsupported_name_characters):
        # A name the store cannot keep is refused before anything is written.
        with pytest.raises(InvalidConfigError, match="storage_path component"):
            StorageContext(uri + "/", "e", "t", storage_options=_opts(uri))
        return
    ctx = StorageContext(uri + "/", "e", "t", storage_options=_opts(uri))
    assert ctx.uri(ctx.trial_path) == f"{uri}/e/t"
