"""Retries for backend calls: exponential backoff with jitter, typed give-ups.

Every storage call made by the commit, listing, delete and download paths
goes through :func:`call` (or :func:`call_fs`, which also rebuilds a
filesystem whose credentials expired). Errors fall into three kinds:

* transient (connection reset, timeouts, HTTP 5xx, throttling, an
  in-process store's table changing under a listing that copies it
  (``RuntimeError: dictionary changed size during iteration`` from fsspec's
  memory filesystem while another thread writes), and
  :class:`~checkpoint_store.errors.TransientBackendError`): retried up to
  ``RetryPolicy.attempts`` times in all, sleeping ``base_delay * 2**k``
  (capped at ``max_delay``) with "equal jitter" between tries; when they run
  out, :class:`~checkpoint_store.errors.TransientBackendError` is raised from
  the last error;
* unreachable (the connection was refused, curl's "Could not connect",
  a host name that does not resolve): the address is wrong or nothing
  listens there, which waiting does not fix, so at most
  :data:`UNREACHABLE_ATTEMPTS` quick tries, then
  :class:`~checkpoint_store.errors.StorageUnreachableError` ("cannot connect
  to <endpoint>"), and the store's breaker (below) opens so the calls after
  it fail at once instead of each trying again;
* expired credentials: :func:`call_fs` (one call) and :func:`with_rebuild`
  (a whole operation, as ``StorageContext`` uses it) call the backend's
  ``rebuild`` factory once and try again with the new filesystem; otherwise
  :class:`~checkpoint_store.errors.CredentialsExpiredError`;
* everything else is permanent and surfaces at once. A missing path stays a
  ``FileNotFoundError`` (callers treat "absent" as an answer); access denied
  and other permanent storage errors become
  :class:`~checkpoint_store.errors.PermanentBackendError`.

An engine's own exception that is no ``OSError`` (pyarrow's ``ArrowInvalid``
and ``ArrowNotImplementedError``, the Azure SDK's ``ServiceRequestError``,
botocore's ``NoCredentialsError`` ...) is first read as the ``OSError`` it
stands for (:func:`~checkpoint_store.backends.engine_errors.as_os_error`),
so it too ends as one of the typed errors above, never raw.

A call is not retried once it has been failing for ``RetryPolicy.max_elapsed``
seconds (default 60): a store that stopped answering makes each try last as
long as the client's timeouts allow (the S3 plugin: three engine attempts
of up to 20 s each), so a fixed number of tries alone does not bound the
wait. Such a call also opens its store's breaker: for the next
``max_elapsed`` seconds, or until a call to it already in flight succeeds,
every new call to that store (the same ``Backend`` or filesystem object)
fails at once with
:class:`~checkpoint_store.errors.TransientBackendError`; other stores are
not affected. A
report whose store stalls thus fails within about two minutes, cleanup after
it included, and ending the session takes no longer.

The default policy comes from ``CHECKPOINT_STORE_RETRY_ATTEMPTS`` (default 3)
and ``CHECKPOINT_STORE_RETRY_MAX_DELAY`` (seconds, default 5) so a launcher
can tune it without code; :class:`~checkpoint_store.StorageContext` takes an
explicit ``retry=RetryPolicy(...)``.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

from checkpoint_store.backends.engine_errors import as_os_error
from checkpoint_store.errors import (
    CheckpointStoreError,
    CredentialsExpiredError,
    InvalidConfigError,
    PermanentBackendError,
    StorageFullError,
    StorageUnreachableError,
    TransientBackendError,
)

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow.fs as pafs

    from checkpoint_store.backends.base import Backend

logger = logging.getLogger(__name__)

T = TypeVar("T")

ENV_ATTEMPTS = "CHECKPOINT_STORE_RETRY_ATTEMPTS"
ENV_MAX_DELAY = "CHECKPOINT_STORE_RETRY_MAX_DELAY"

#: What a failed storage call calls for, as :func:`classify` answers:
#: ``"transient"`` try again after a backoff, ``"unreachable"`` nothing
#: listens at the address (try once more, then give up), ``"expired"`` rebuild the
#: filesystem with fresh credentials, ``"permanent"`` give up at once.
RetryKind = Literal["transient", "unreachable", "expired", "permanent"]

#: Tries in all of a call whose connection is refused (see the module docstring).
UNREACHABLE_ATTEMPTS = 2


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failing storage call is tried again.

    Args:
        attempts: tries per operation in all, including the first (>= 1;
            default 3).
        base_delay: seconds before the second try; doubled for each further
            try (>= 0).
        max_delay: upper bound in seconds of any single sleep (>= 0).
        max_elapsed: seconds after the first try of a call after which no
            retry starts (> 0; default 60); see the module docstring.

    Raises:
        InvalidConfigError: a value out of range.

    Sleeps use "equal jitter": half the backoff plus a uniform random part of
    the other half, so many writers hitting one throttled bucket spread out
    (the scheme AWS's architecture blog recommends).
    """

    attempts: int = 3
    base_delay: float = 0.05
    max_delay: float = 5.0
    max_elapsed: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or (
            self.attempts < 1
        ):
            raise InvalidConfigError(f"retry attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("base_delay", "max_delay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise InvalidConfigError(f"retry {name} must be a number >= 0 seconds, got {v!r}")
        v = self.max_elapsed
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise InvalidConfigError(f"retry max_elapsed must be a number > 0 seconds, got {v!r}")

    def delay(self, retry_number: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep before retry ``retry_number`` (0 for the first retry)."""
        cap = min(self.max_delay, self.base_delay * (2.0**retry_number))
        r = (rng or random).random()
        return cap / 2 + r * cap / 2

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The default policy, overridable by the two environment variables.

        Raises:
            InvalidConfigError: a variable is set but not a valid number.
        """
        attempts_raw = os.environ.get(ENV_ATTEMPTS, "")
        delay_raw = os.environ.get(ENV_MAX_DELAY, "")
        if not attempts_raw and not delay_raw:
            return _DEFAULT
        try:
            attempts = int(attempts_raw) if attempts_raw else _DEFAULT.attempts
            max_delay = float(delay_raw) if delay_raw else _DEFAULT.max_delay
        except ValueError:
            raise InvalidConfigError(
                f"{ENV_ATTEMPTS}={attempts_raw!r} / {ENV_MAX_DELAY}={delay_raw!r}: expected an "
                "integer number of attempts and a number of seconds"
            ) from None
        return cls(attempts=attempts, max_delay=max_delay)


_DEFAULT = RetryPolicy()

# Substrings seen in messages of pyarrow's S3/GCS/Azure errors, botocore,
# aiohttp and the Azure SDK for conditions worth retrying (pyarrow's Azure
# client: "Fail to get a new connection for: ... Could not connect to server").
_TRANSIENT_RE = re.compile(
    r"(timed? ?out|timeout|connection (reset|aborted|refused|closed)|broken pipe|"
    r"network_connection|temporar|try again|throttl|slow ?down|too many requests|"
    r"\b(429|500|502|503|504)\b|internal ?(error|failure)|service ?unavailable|"
    r"server ?busy|request ?timeout|unreachable|eof occurred|remote end closed|"
    r"(could ?not|cannot|can't|fail(ed)? to) (get a new )?connect|"
    # pyarrow's S3 client: an error body larger than the read's buffer (a
    # 404 of an object deleted since its open, a 503): asked again, it tells.
    r"failed to flush response stream)",
    re.IGNORECASE,
)
_EXPIRED_RE = re.compile(
    r"(expired ?token|token ?expired|request ?expired|credentials? (have|has)? ?expired|"
    r"expiredtokenexception|authenticationexpired|invalid_grant)",
    re.IGNORECASE,
)
#: A connection that could not be opened at all, as the clients say it:
#: refused (errno 111, aiohttp's "Connect call failed", botocore's
#: EndpointConnectionError), curl's codes 6 and 7 (pyarrow's S3, GCS and Azure
#: clients), a host name that does not resolve. A reset, a timeout or a
#: temporary DNS failure are not here: those are transient.
_UNREACHABLE_RE = re.compile(
    r"(connection refused|connect call failed|could not connect to the endpoint url|"
    r"curlcode: [67]\b|could not connect to server|failed to connect to|"
    r"cannot connect to host|could not resolve host|name or service not known|"
    r"nodename nor servname|no address associated with hostname)",
    re.IGNORECASE,
)
#: Where the clients name the address they could not reach.
_ENDPOINT_RES = (
    re.compile(r'endpoint URL: "(?P<e>[a-z][a-z0-9+.-]*://[^/"\s]+)', re.IGNORECASE),
    re.compile(r"Failed to connect to (?P<e>[^\s]+?)(?: port (?P<p>\d+))? after", re.IGNORECASE),
    re.compile(r"Cannot connect to host (?P<e>[^\s]+)", re.IGNORECASE),
    re.compile(r"Could not resolve host:? (?P<e>[^\s;,]+)", re.IGNORECASE),
    re.compile(r"host='(?P<e>[^']+)', port=(?P<p>\d+)", re.IGNORECASE),
    re.compile(r"connection for: (?P<e>[a-z][a-z0-9+.-]*://[^/\s]+)", re.IGNORECASE),
    re.compile(r"\('(?P<e>[0-9a-f.:]+)', (?P<p>\d+)\)", re.IGNORECASE),
)
_TRANSIENT_TYPE_NAMES = re.compile(r"(Timeout|Connection|Throttl|ServerDisconnected)")
#: A file replaced while it was read: fsspec's ``FileExpired`` (s3fs, gcsfs:
#: "The remote file ... and Etag ... no longer exists"), pyarrow's Azure
#: client reading past the end of a blob rewritten shorter ("InvalidRange").
#: Read again, the new version is read whole.
_REPLACED_WHILE_READ = re.compile(
    r"(^FileExpired:|and Etag \S+ no longer exists|\[InvalidRange\] 416)")
#: A store held in the process (fsspec's memory filesystem) lists by copying
#: its dict; a writer in another thread can change it mid-copy. Asked again,
#: the listing succeeds.
_CHANGED_DURING_ITERATION = re.compile(r"changed size during iteration")


def classify(exc: BaseException) -> RetryKind:
    """The :data:`RetryKind` of one exception (see the module docstring)."""
    if isinstance(exc, TransientBackendError):
        return "transient"
    if isinstance(exc, (CheckpointStoreError, FileNotFoundError, ValueError, TypeError)):
        return "permanent"
    if not isinstance(exc, Exception):
        return "permanent"  # KeyboardInterrupt, SystemExit, injected crashes
    text = f"{type(exc).__name__}: {exc}"
    if _EXPIRED_RE.search(text):
        return "expired"
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return "permanent"
    if isinstance(exc, ConnectionRefusedError) or _UNREACHABLE_RE.search(text):
        return "unreachable"
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return "transient"
    if isinstance(exc, RuntimeError) and _CHANGED_DURING_ITERATION.search(str(exc)):
        return "transient"
    if _TRANSIENT_TYPE_NAMES.search(type(exc).__name__) or _TRANSIENT_RE.search(str(exc)):
        return "transient"
    if _REPLACED_WHILE_READ.search(text):
        return "transient"
    return "permanent"


def unreachable_endpoint(exc: BaseException) -> str | None:
    """The address an "unreachable" error names (``host:port`` or a URL), or
    None when its client did not say."""
    text = str(exc)
    for pattern in _ENDPOINT_RES:
        m = pattern.search(text)
        if m:
            port = m.groupdict().get("p")
            host = m.group("e").rstrip(".,;:")
            return f"{host}:{port}" if port else host
    return None


def _unreachable(exc: BaseException, what: str, tries: int) -> StorageUnreachableError:
    endpoint = unreachable_endpoint(exc)
    where = endpoint or "the storage endpoint"
    return StorageUnreachableError(
        f"cannot connect to {where}: {what} failed ({tries} attempt(s)): {exc}. Nothing "
        "answers at that address: check it (endpoint_url, host, port, connection string; "
        "a typo is the usual cause) and that the server is running.",
        endpoint=endpoint,
    )


_rebuild_lock = threading.Lock()


class _Breakers:
    """One breaker per store (a :class:`Backend`, or the filesystem object a
    call names with ``store=``): opened by a call
    that kept failing for ``max_elapsed`` seconds (the store stopped
    answering), so that the calls after it to the same store (cleanup, the
    end of the session) fail at once instead of waiting as long each; closed
    by any call to that store that succeeds, or when its time is up. Calls to
    other stores (a local tier, another bucket) are not affected, and calls
    without a backend never trip one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, tuple[weakref.ref[object], float, BaseException | None]] = {}

    def is_open(self, backend: object | None) -> bool:
        return self.reason(backend) is not False

    def reason(self, backend: object | None) -> BaseException | None | bool:
        """False when ``backend``'s breaker is closed; else the error that
        opened it (None: a store that stopped answering)."""
        entry = self._open.get(id(backend)) if backend is not None else None
        if entry is not None and entry[0]() is backend and time.monotonic() < entry[1]:
            return entry[2]
        return False

    def open(self, backend: object | None, seconds: float,
             error: BaseException | None = None) -> None:
        if backend is None:
            return
        with self._lock:
            now = time.monotonic()
            # Forget stores gone or closed since (ids are reused once freed).
            self._open = {k: v for k, v in self._open.items() if v[0]() is not None and v[1] > now}
            self._open[id(backend)] = (weakref.ref(backend), now + seconds, error)

    def close(self, backend: object | None = None) -> None:
        """Close ``backend``'s breaker (None: every one)."""
        with self._lock:
            if backend is None:
                self._open.clear()
            elif id(backend) in self._open:
                del self._open[id(backend)]


_breaker = _Breakers()


#: How a full disk or a used-up quota reads where a client keeps only the
#: message (pyarrow's local filesystem, fsspec wrappers): ENOSPC, EDQUOT.
_FULL_RE = re.compile(r"\[Errno (28|122)\]|No space left on device|Disk quota exceeded")


def is_storage_full(exc: BaseException) -> bool:
    """True for ENOSPC / EDQUOT, by errno or by the message that carries it."""
    if getattr(exc, "errno", None) in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return True
    return bool(_FULL_RE.search(str(exc)))


#: A write into a bucket or container that does not exist, as pyarrow's S3
#: client and the Azure SDK say it (``b``/``c``: its name where they give it).
_NO_BUCKET_RE = re.compile(
    r"(in bucket '(?P<b>[^']+)': AWS Error NO_SUCH_BUCKET|NO_SUCH_BUCKET|NoSuchBucket|"
    r"ContainerNotFound|The specified container does not exist|"
    r"container '(?P<c>[^']+)' not found)")


def typed_permanent(exc: BaseException, what: str) -> BaseException:
    """``exc`` (an error retrying will not fix, of a call described by ``what``)
    as the typed error a caller can act on: :class:`StorageFullError` for a
    full disk, :class:`PermanentBackendError` for any other ``OSError``;
    ours, ``FileNotFoundError`` and non-OS errors unchanged."""
    if isinstance(exc, (CheckpointStoreError, FileNotFoundError)) or not isinstance(exc, OSError):
        return exc
    if is_storage_full(exc):
        return StorageFullError(
            f"{what} failed: the destination disk is full or its quota used up ({exc}). "
            "Free space there (or raise the quota) and try again; nothing was committed.",
            cause=exc,
        )
    no_bucket = _NO_BUCKET_RE.search(str(exc))
    if no_bucket:
        name = no_bucket.group("b") or no_bucket.group("c")
        word = "container" if "ontainer" in no_bucket.group(0) else "bucket"
        named = f"the {word} {name!r}" if name else f"its {word}"
        return PermanentBackendError(
            f"{what} failed: {named} does not exist ({exc}). Create it first, or fix its "
            "name in the path.", cause=exc)
    return PermanentBackendError(
        f"{what} failed with an error retrying will not fix: {exc}. Check the path, "
        "bucket and permissions (credentials, IAM policy, container access).",
        cause=exc,
    )


def call(
    fn: Callable[[], T], *, policy: RetryPolicy | None = None, what: str = "storage call",
    store: object | None = None,
) -> T:
    """Run ``fn()``, retrying transient errors per ``policy`` (default: from the environment).

    ``store`` (the filesystem ``fn`` calls) names the breaker the call obeys
    and may open (see the module docstring); without one, none.

    Raises:
        TransientBackendError: still failing after ``policy.attempts`` tries.
        PermanentBackendError: a permanent OSError (access denied ...), at once.
        FileNotFoundError: unchanged, at once (also an engine's "not found").
        Any other exception of ``fn`` that is no storage engine's: unchanged, at once.
    """
    return _run(lambda _fs: fn(), None, policy, what, store)


def call_fs(
    backend: Backend,
    fn: Callable[[pafs.FileSystem], T],
    *,
    policy: RetryPolicy | None = None,
    what: str = "storage call",
) -> T:
    """Like :func:`call`, passing ``backend.filesystem`` to ``fn`` on each try.

    An expired-credentials error rebuilds the filesystem once with
    ``backend.rebuild()`` (the backend then holds the new filesystem, so
    every holder of the backend sees it) and tries again. Without a rebuild
    factory, or if the rebuilt one fails the same way, a
    :class:`PermanentBackendError` asks for fresh credentials.
    """
    return _run(fn, backend, policy, what)


def with_rebuild(backend: Backend, fn: Callable[[], T], *, what: str = "storage call") -> T:
    """Run ``fn()`` (a whole operation made of many storage calls); if it fails
    with :class:`CredentialsExpiredError`, rebuild ``backend``'s filesystem
    once with ``backend.rebuild()`` and run ``fn()`` again.

    ``fn`` must read ``backend.filesystem`` afresh (not capture the old one)
    and be safe to run twice (the commit protocol is).

    Raises:
        CredentialsExpiredError: no rebuild factory, or still expired after it.
    """
    try:
        return fn()
    except CredentialsExpiredError:
        if backend.rebuild is None:
            raise
        _rebuild(backend, backend.rebuild, backend.filesystem, what)
    return fn()


def _rebuild(
    backend: Backend, rebuild: Callable[[], pafs.FileSystem], old: pafs.FileSystem | None,
    what: str,
) -> None:
    """Give ``backend`` a filesystem from ``rebuild`` (its factory: fresh
    credentials), unless another thread replaced ``old``, the one that failed,
    meanwhile."""
    logger.warning("%s: credentials expired; rebuilding the filesystem", what)
    with _rebuild_lock:
        if backend.filesystem is old:
            # Backend is frozen for users; the one field we swap is the
            # filesystem, so every holder of the backend sees fresh credentials.
            object.__setattr__(backend, "filesystem", rebuild())


def _run(
    fn: Callable[[pafs.FileSystem], T] | Callable[[None], T],
    backend: Backend | None,
    policy: RetryPolicy | None,
    what: str,
    store: object | None = None,
) -> T:
    policy = policy or RetryPolicy.from_env()
    rebuilt = False
    retry_number = 0
    started = time.monotonic()
    store = store if store is not None else backend
    opened_by = _breaker.reason(store)
    if isinstance(opened_by, StorageUnreachableError):
        raise StorageUnreachableError(
            f"cannot connect to {opened_by.endpoint or 'the storage endpoint'}: {what} not "
            "tried, a call to this store was refused a moment ago (calls to "
            f"this store fail at once for {policy.max_elapsed:.0f}s). Check the address "
            "(endpoint_url, host, port, connection string) and that the server is running.",
            endpoint=opened_by.endpoint,
        )
    if opened_by is not False:
        raise TransientBackendError(
            f"{what} not tried: the storage stopped answering (a call kept failing for "
            f"{policy.max_elapsed:.0f}s); calls fail at once until one succeeds or "
            f"{policy.max_elapsed:.0f}s pass"
        )
    while True:
        fs = backend.filesystem if backend is not None else None
        try:
            result = fn(fs)  # type: ignore[arg-type]
            _breaker.close(store)
            return result
        except BaseException as raw:
            # An engine's own exception type (pyarrow's ArrowInvalid, the Azure
            # SDK's ServiceRequestError ...) as the OSError it stands for.
            exc = as_os_error(raw, what)
            kind = classify(exc)
            if kind == "expired":
                if backend is not None and backend.rebuild is not None and not rebuilt:
                    rebuilt = True
                    _rebuild(backend, backend.rebuild, fs, what)
                    continue
                raise CredentialsExpiredError(
                    f"{what} failed: the storage credentials have expired ({exc}). Refresh "
                    "them (new session token, re-login) and try again.",
                    cause=raw,
                ) from raw
            if kind == "permanent":
                typed = typed_permanent(exc, what)
                if typed is raw:
                    raise
                if isinstance(typed, PermanentBackendError) and typed is not exc:
                    typed.cause = raw  # the engine's own exception, as documented
                raise typed from raw
            if kind == "unreachable" and retry_number + 1 >= min(UNREACHABLE_ATTEMPTS,
                                                                 policy.attempts):
                error = _unreachable(exc, what, retry_number + 1)
                _breaker.open(store, policy.max_elapsed, error)
                raise error from raw
            elapsed = time.monotonic() - started
            if elapsed >= policy.max_elapsed:
                _breaker.open(store, policy.max_elapsed)
                raise TransientBackendError(
                    f"{what} still failing after {elapsed:.0f}s ({retry_number + 1} "
                    f"attempt(s)): {exc}. The storage stopped answering; retry later, or "
                    "raise the backend's request_timeout if it is only slow."
                ) from raw
            if retry_number + 1 >= policy.attempts:
                raise TransientBackendError(
                    f"{what} still failing after {policy.attempts} attempts: {exc}. The "
                    "storage looks unavailable or throttled: check its address (endpoint, "
                    "connection string) and the network, retry later, or raise "
                    f"RetryPolicy(attempts=...) / {ENV_ATTEMPTS}."
                ) from raw
            sleep = policy.delay(0 if kind == "unreachable" else retry_number)
            logger.debug("%s failed (%s); retry %d in %.3fs", what, exc, retry_number + 1, sleep)
            retry_number += 1
            time.sleep(sleep)
