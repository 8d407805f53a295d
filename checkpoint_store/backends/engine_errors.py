"""The storage engines' own exception types, as the ``OSError`` each stands for.

A storage call goes through an engine: pyarrow's C++ filesystems, or an
fsspec client (s3fs and botocore, adlfs and the Azure SDK, gcsfs and
google-auth). Most engine errors already are ``OSError`` subclasses; some
are not: pyarrow's ``ArrowInvalid`` (a ``ValueError``) and
``ArrowNotImplementedError``, every ``azure.core`` exception
(``ServiceRequestError`` when the endpoint cannot be reached), botocore's
``NoCredentialsError``, google-auth's ``RefreshError``, gcsfs's
``HttpError``, aiohttp's ``ServerDisconnectedError``. :func:`as_os_error`
turns each into the ``OSError`` subclass it means (``FileNotFoundError``,
``PermissionError``, ``ConnectionError``, ``TimeoutError``, or a plain
``OSError`` with an errno), so that the retry policy
(:mod:`checkpoint_store._util.retry`) tells transient from permanent and
hands the caller a typed error, never the engine's raw one.

pyarrow's S3 and Azure clients raise a plain ``OSError`` for an object
deleted after it was opened (a gc or a retention pass deleting it between a
listing and the read): ``NO_SUCH_KEY`` or ``RESOURCE_NOT_FOUND`` "during
GetObject", ``[BlobNotFound]``, which :func:`as_os_error` makes
``FileNotFoundError`` as the other engines raise it. For a small object
pyarrow's S3 client cannot fit the 404's error body in the buffer sized by
the object's old length and reports "Failed to flush response stream"
instead, which says nothing of the cause: the retry policy treats it as
transient, and the next try's open (a HEAD) tells.

Nothing here imports an engine: a module that is not loaded cannot have
raised.
"""

from __future__ import annotations

import errno
import sys

__all__ = ["as_os_error", "azure_os_error"]

#: pyarrow's S3 and Azure clients reading an object that is no longer there.
_GONE = ("AWS Error NO_SUCH_KEY during GetObject",
         "AWS Error RESOURCE_NOT_FOUND during GetObject",
         "Azure Error: [BlobNotFound]")

#: HTTP statuses worth trying again (timeout, throttling, server side).
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def as_os_error(exc: BaseException, where: str) -> BaseException:
    """``exc`` as the ``OSError`` it stands for where an engine raised its own
    type; any other exception (an ``OSError`` already, ours, a bug's) unchanged.

    Args:
        exc: what a storage call raised.
        where: the call, for the message (``"list s3://b/run"``).
    """
    if type(exc) is OSError and any(m in str(exc) for m in _GONE):
        return FileNotFoundError(errno.ENOENT, f"{where}: the object is gone ({exc})")
    if isinstance(exc, OSError) or not isinstance(exc, Exception):
        return exc
    module = type(exc).__module__ or ""
    root = module.partition(".")[0]
    if root == "pyarrow":
        return _arrow_os_error(exc, where)
    if root == "azure":
        return _azure_if_sdk(exc, where)
    if root == "botocore":
        return _boto_os_error(exc, where)
    if root in ("google", "gcsfs"):
        return _google_os_error(exc, where)
    if root == "aiohttp":
        return ConnectionError(f"{where}: {type(exc).__name__}: {exc}")
    return exc


def _arrow_os_error(exc: Exception, where: str) -> BaseException:
    pa = sys.modules.get("pyarrow")
    if pa is None:  # pragma: no cover - a pyarrow exception without pyarrow
        return exc
    if isinstance(exc, pa.ArrowNotImplementedError):
        return OSError(errno.ENOTSUP, f"{where}: the filesystem does not support this "
                       f"operation ({exc})")
    if isinstance(exc, pa.ArrowInvalid):
        return OSError(errno.EINVAL, f"{where}: the storage engine refused the request "
                       f"({exc})")
    if isinstance(exc, pa.ArrowException):
        return OSError(f"{where}: {type(exc).__name__}: {exc}")
    return exc


def _azure_if_sdk(exc: Exception, where: str) -> BaseException:
    core = sys.modules.get("azure.core.exceptions")
    if core is None or not isinstance(exc, core.AzureError):
        return exc
    return azure_os_error(exc, where)


def azure_os_error(exc: Exception, where: str) -> OSError:
    """The OSError for an Azure SDK error (``azure.core.exceptions``), typed so
    the retry policy (:mod:`checkpoint_store._util.retry`) tells transient
    from permanent: ``ResourceNotFoundError`` is ``FileNotFoundError``, an
    authentication error or HTTP 403 ``PermissionError``, a request that
    could not be sent or answered (``ServiceRequestError``,
    ``ServiceResponseError``) or a retryable status ``ConnectionError``."""
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ResourceNotFoundError,
        ServiceRequestError,
        ServiceResponseError,
    )

    status = getattr(exc, "status_code", None)
    code = getattr(exc, "error_code", None)
    first = (getattr(exc, "message", None) or str(exc)).strip().splitlines()
    text = f"{where}: {type(exc).__name__}: {first[0] if first else ''}"
    if status is not None:
        text += f" (HTTP {status}{', ' + code if code else ''})"
    if isinstance(exc, ResourceNotFoundError):
        return FileNotFoundError(errno.ENOENT, text)
    if isinstance(exc, ClientAuthenticationError) or status == 403:
        return PermissionError(errno.EACCES, text)
    if isinstance(exc, (ServiceRequestError, ServiceResponseError)) or (
            isinstance(exc, HttpResponseError) and status in _RETRY_STATUSES):
        return ConnectionError(text)
    return OSError(text)


def _boto_os_error(exc: Exception, where: str) -> BaseException:
    text = f"{where}: {type(exc).__name__}: {exc}"
    name = type(exc).__name__
    if "Credential" in name or "Token" in name:  # NoCredentialsError, TokenRetrievalError ...
        return PermissionError(errno.EACCES, text)
    if "Timeout" in name:
        return TimeoutError(text)
    if "Connection" in name or "Proxy" in name:  # EndpointConnectionError ...
        return ConnectionError(text)
    status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") \
        if isinstance(getattr(exc, "response", None), dict) else None
    return _status_error(status, text)


def _google_os_error(exc: Exception, where: str) -> BaseException:
    text = f"{where}: {type(exc).__name__}: {exc}"
    name = type(exc).__name__
    if name == "TransportError":  # google.auth: the token endpoint cannot be reached
        return ConnectionError(text)
    if name in ("RefreshError", "DefaultCredentialsError", "GoogleAuthError",
                "UserAccessTokenError", "OAuthError"):
        return PermissionError(errno.EACCES, text)
    status = getattr(exc, "code", None)
    return _status_error(status, text)


def _status_error(status: object, text: str) -> BaseException:
    """The OS error an HTTP ``status`` of a cloud client stands for (any other: OSError)."""
    if status in (401, 403):
        return PermissionError(errno.EACCES, text)
    if status == 404:
        return FileNotFoundError(errno.ENOENT, text)
    if status in _RETRY_STATUSES:
        return ConnectionError(text)
    return OSError(text)
