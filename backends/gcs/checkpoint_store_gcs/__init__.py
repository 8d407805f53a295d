"""Google Cloud Storage for checkpoint-store, through gcsfs.

Registered for ``gs://`` and ``gcs://`` through the ``checkpoint_store.backends``
entry-point group. The filesystem is ``gcsfs.GCSFileSystem`` wrapped with
``pyarrow.fs.PyFileSystem(FSSpecHandler(...))``.

Storage options:

================= ============================================= ===========================
option            meaning                                       environment
================= ============================================= ===========================
``endpoint_url``  ``http(s)://host:port`` of an emulator or     ``STORAGE_EMULATOR_HOST``
                  GCS-compatible store
``token``         ``"anon"``, ``"google_default"``, a service-  ``GOOGLE_APPLICATION_``
                  account JSON path, or its dict                ``CREDENTIALS``
``project``       project id (bucket creation, billing)         ``GOOGLE_CLOUD_PROJECT``
================= ============================================= ===========================

Anything else goes to ``gcsfs.GCSFileSystem`` unchanged. With a custom
endpoint, gcsfs's core class is used even where ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``
selected its hierarchical-namespace variant: emulators cannot answer that
variant's bucket probe, and each bucket call would wait 60 s.
Tokens are never printed: ``repr(backend)`` names the engine only.
A string given for an option of :data:`OPTION_TYPES` (the command line's
``-o KEY=VALUE`` gives strings) is converted to that option's type. With
``version_aware`` on, gcsfs reads ``#`` in a name as an object generation:
names holding ``#`` or ``?generation=`` are then refused.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from checkpoint_store.backends.base import Backend, Capabilities, bool_option, typed_options
from checkpoint_store.backends.handlers import wrap_fsspec
from checkpoint_store.errors import BackendUnavailableError, InvalidConfigError

__all__ = ["GCS_CAPABILITIES", "OPTION_TYPES", "gcs_backend"]

GCS_CAPABILITIES = Capabilities(
    atomic_rename=False,
    needs_fsync=False,
    server_side_copy=True,
    strong_listing=True,  # GCS lists strongly consistent after writes
    directories=False,
    chunk_size=32 * 1024 * 1024,
    concurrency=8,
)


#: Every storage option the GCS backend knows, with its type: ours (see the
#: module docstring), then those of ``gcsfs.GCSFileSystem`` a user sets most.
OPTION_TYPES: dict[str, type] = {
    "endpoint_url": str, "token": str, "project": str,
    "access": str, "consistency": str, "requester_pays": bool, "version_aware": bool,
    "block_size": int, "cache_timeout": float, "timeout": float, "check_connection": bool,
    "default_location": str,
}


def _build(options: Mapping[str, Any]) -> pafs.FileSystem:
    kwargs: dict[str, Any] = {
        # A listing must show what another process just wrote (retention, resume).
        "use_listings_cache": False,
        "skip_instance_cache": True,
        "block_size": GCS_CAPABILITIES.chunk_size,
    }
    kwargs.update(options)
    endpoint = kwargs.get("endpoint_url")
    if endpoint is None and os.environ.get("STORAGE_EMULATOR_HOST"):
        endpoint = os.environ["STORAGE_EMULATOR_HOST"]
        if "://" not in endpoint:
            endpoint = "http://" + endpoint
        kwargs["endpoint_url"] = endpoint
    if endpoint is not None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise InvalidConfigError(f"GCS endpoint_url {endpoint!r} is not http(s)://host[:port]")
        kwargs.setdefault("token", "anon")
    if "project" not in kwargs and os.environ.get("GOOGLE_CLOUD_PROJECT"):
        kwargs["project"] = os.environ["GOOGLE_CLOUD_PROJECT"]
    try:
        import gcsfs
        from gcsfs.core import GCSFileSystem as CoreGCSFileSystem
    except ImportError:
        raise BackendUnavailableError(
            "gs:// needs gcsfs: pip install checkpoint-store-gcs"
        ) from None
    # gcsfs.GCSFileSystem may be the hierarchical-namespace variant (chosen when
    # gcsfs is imported); its bucket probe stalls 60 s on emulators, so a custom
    # endpoint always gets the core class.
    cls = CoreGCSFileSystem if endpoint is not None else gcsfs.GCSFileSystem
    try:
        fs = cls(**kwargs)
    except TypeError as exc:
        raise InvalidConfigError(
            f"gcsfs.GCSFileSystem rejected the storage options ({type(exc).__name__}); "
            "check the option names"
        ) from None
    except ValueError:
        raise InvalidConfigError(
            "GCS credentials were rejected; check the token option (\"anon\", "
            "\"google_default\", or a service-account JSON path)"
        ) from None
    return wrap_fsspec(fs)


def gcs_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Factory for ``gs://bucket/key`` and ``gcs://bucket/key`` URIs.

    Args:
        uri: the URI being resolved; only its scheme is used here.
        storage_options: see the module docstring.

    Returns:
        A :class:`~checkpoint_store.backends.Backend` with
        :data:`GCS_CAPABILITIES` (marker-last commit).

    Raises:
        InvalidConfigError: malformed endpoint or options gcsfs rejects.
        BackendUnavailableError: gcsfs is not installed.
    """
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "gs"
    options = typed_options(storage_options, OPTION_TYPES, "GCS")
    caps = GCS_CAPABILITIES
    if bool_option("version_aware", options.get("version_aware", False)):
        # gcsfs then splits "#<generation>" and "?generation=" off every path.
        caps = dataclasses.replace(caps, unsupported_name_characters="#",
                                   unsupported_name_hint="gcsfs reads it as an object "
                                   "generation with version_aware on",
                                   unsupported_name_parts=("?generation=",))

    # A partial, not a closure: Checkpoints pickle with their backend.
    build = functools.partial(_build, options)
    return Backend(
        build(), scheme=scheme, capabilities=caps, name="GCS (gcsfs)", rebuild=build
    )
