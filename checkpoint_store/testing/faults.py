"""A fault-injecting filesystem: transient and permanent errors, latency, crash points.

Wrap any ``pyarrow.fs.FileSystem`` (or a whole :class:`~checkpoint_store.backends.Backend`)
and drive checkpoint-store, or your own backend plugin, through the failures
real storage produces::

    from checkpoint_store.testing.faults import FaultPlan, faulty_backend, SimulatedCrash

    plan = FaultPlan(seed=7, transient_rate=0.2)            # 20% of calls fail, retryably
    backend = faulty_backend(real_backend, plan)
    storage = StorageContext.from_backend(backend, root, "exp", "trial")

    plan = FaultPlan(permanent={"write": "access_denied"})   # every upload is refused
    plan = FaultPlan(crash_after_writes=5)                   # "dies" at the 6th write
    plan = FaultPlan(crash_on_path=".internal_metadata.json")  # dies before the commit marker
    plan = FaultPlan(vanish_after_open=".condemned/")         # deleted between open and read
    plan = FaultPlan(torn_reads=".cs_manager_lease.json")      # read while it is rewritten

Across processes (Ray workers, torchrun ranks), register the URI scheme
``faulty+<scheme>`` by dotted path and pass the plan as storage options::

    register_backend("faulty+s3", "checkpoint_store.testing.faults:faulty_scheme_backend")
    # faulty+s3://bucket/prefix, storage_options={"fault_transient_rate": 0.2,
    #     "fault_seed": 1, "fault_call_log": "/tmp/calls", ...the S3 options}

Everything is deterministic from ``seed``: whether a call fails depends only
on ``(seed, operation, path, how many times that operation hit that path)``,
never on thread scheduling, so a failing test replays exactly.

A crash raises :class:`SimulatedCrash`, a ``BaseException`` (like the
``KeyboardInterrupt`` a dying process sees), so ``except Exception`` cleanup
code does not run; after it, every further call raises it again, as a dead
process does nothing more. Storage is left exactly as the crash left it.

Operation names (for ``permanent`` and ``transient_ops``): ``stat``,
``list``, ``mkdir``, ``delete``, ``move``, ``copy``, ``read``, ``write``
(groups), or the pyarrow handler method names (``open_output_stream`` ...).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from checkpoint_store.backends.base import Backend
from checkpoint_store.backends.forwarding import ForwardingHandler

__all__ = [
    "FaultPlan",
    "FaultInjectingHandler",
    "SimulatedCrash",
    "faulty_backend",
    "faulty_filesystem",
    "faulty_scheme_backend",
    "read_call_log",
]


class SimulatedCrash(BaseException):
    """The process "died" at a crash point. A BaseException so that
    ``except Exception`` handlers (cleanup, retries) do not run."""


_GROUPS: dict[str, str] = {
    "get_file_info": "stat",
    "get_file_info_selector": "list",
    "create_dir": "mkdir",
    "delete_dir": "delete",
    "delete_dir_contents": "delete",
    "delete_root_dir_contents": "delete",
    "delete_file": "delete",
    "move": "move",
    "copy_file": "copy",
    "open_input_stream": "read",
    "open_input_file": "read",
    "open_output_stream": "write",
    "open_append_stream": "write",
}
# Calls that change storage: what crash points count.
_MUTATING = {"mkdir", "delete", "move", "copy", "write"}

# Messages real stores send for retryable conditions (S3, GCS, Azure, sockets).
_TRANSIENT: tuple[tuple[type[OSError], str], ...] = (
    (ConnectionResetError, "injected: [Errno 104] Connection reset by peer"),
    (TimeoutError, "injected: read timed out"),
    (OSError, "injected: AWS Error SLOW_DOWN during PutObject: 503 Slow Down, please reduce "
              "your request rate"),
    (OSError, "injected: HTTP 500 InternalError: we encountered an internal error"),
)
_PERMANENT: dict[str, tuple[type[OSError], str]] = {
    "access_denied": (PermissionError, "injected: AWS Error ACCESS_DENIED: 403 AccessDenied"),
    "not_found": (FileNotFoundError, "injected: 404 NoSuchKey"),
    "no_space": (OSError, "injected: [Errno 28] No space left on device"),
    "expired": (OSError, "injected: AWS Error: ExpiredToken: the provided token has expired"),
}


@dataclass(frozen=True)
class FaultPlan:
    """What to inject. All fields optional; the default injects nothing.

    Args:
        seed: makes every decision reproducible.
        transient_rate: probability in [0, 1] that a call fails with a
            retryable error (connection reset, timeout, 503, 500).
        transient_ops: the operations (names or groups) transient faults hit;
            None means every operation.
        permanent: ``{operation or group: kind}``; every such call fails with
            ``kind`` in ``"access_denied"``, ``"not_found"``, ``"no_space"``,
            ``"expired"``.
        path_contains: only calls whose path contains this substring get
            transient or permanent faults (crash points count every call).
        latency: seconds added to every call; a ``(low, high)`` pair draws
            a deterministic value in between.
        crash_after_writes: raise :class:`SimulatedCrash` at the first mutating
            call after this many succeeded (0: at the very first).
        crash_on_path: raise :class:`SimulatedCrash` at the first mutating call
            whose path contains this substring.
        expire_after: after this many calls, every call fails with an
            expired-credentials error (until the filesystem is rebuilt).
        call_log: a local directory; each process appends every call, as
            ``method<TAB>path`` lines, to ``calls-<pid>.txt`` there (a spy
            that works across processes).
        vanish_after_open: the first read of each file whose path contains
            this substring deletes the file, for real, through the inner
            filesystem, right after opening it and before the first byte is
            read: what a gc or a retention pass in another process does
            between a listing and a read. The read then meets the store's own
            answer for an object gone (pyarrow's S3 client answers it three
            ways by the object's size); a local file stays readable through
            its open handle, as POSIX keeps it.
        torn_reads: the first ``torn_read_count`` reads of each file whose
            path contains this substring return a torn body: the file's
            bytes cut short, as a reader sees a file rewritten in place
            (pyarrow's S3, GCS and Azure clients read the new version cut at
            the old length; its Azure client and fsspec filesystems over
            directories show it empty or half written). The first torn read
            of a file is empty, the second its first half, and so on
            alternately. Storage itself is not changed.
        torn_read_count: how many reads of each such file are torn (>= 0).

    Raises:
        ValueError: a rate outside [0, 1], an unknown kind, negative counts.
    """

    seed: int = 0
    transient_rate: float = 0.0
    transient_ops: frozenset[str] | None = None
    permanent: Mapping[str, str] = field(default_factory=dict)
    path_contains: str | None = None
    latency: float | tuple[float, float] = 0.0
    crash_after_writes: int | None = None
    crash_on_path: str | None = None
    expire_after: int | None = None
    call_log: str | None = None
    vanish_after_open: str | None = None
    torn_reads: str | None = None
    torn_read_count: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.transient_rate) <= 1.0:
            raise ValueError(f"transient_rate must be in [0, 1], got {self.transient_rate!r}")
        for op, kind in self.permanent.items():
            if kind not in _PERMANENT:
                raise ValueError(f"permanent[{op!r}] must be one of {sorted(_PERMANENT)}, "
                                 f"got {kind!r}")
        for name in ("crash_after_writes", "expire_after", "torn_read_count"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {v!r}")
        if self.transient_ops is not None:
            object.__setattr__(self, "transient_ops", frozenset(self.transient_ops))


class FaultInjectingHandler(ForwardingHandler):
    """A ``pyarrow.fs.FileSystemHandler`` that forwards to ``inner`` and injects
    the faults of ``plan``. Use :func:`faulty_filesystem` to get a filesystem.

    Attributes (counters, for assertions):
        calls: Counter of calls per handler method.
        injected: Counter of injected faults per kind (``"transient"``,
            ``"permanent"``, ``"expired"``, ``"crash"``, ``"vanished"``,
            ``"torn"``).
        writes: mutating calls that went through.
        crashed: True once a crash point fired.
    """

    def __init__(self, inner: pafs.FileSystem, plan: FaultPlan | None = None):
        super().__init__(inner)
        self.plan = plan or FaultPlan()
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self.writes = 0
        self.crashed = False
        self._per_path: Counter[tuple[str, str]] = Counter()
        self._vanished: set[str] = set()
        self._torn: Counter[str] = Counter()
        self._total = 0
        self._lock = threading.Lock()

    # -- decisions ------------------------------------------------------------------

    def _draw(self, *key: object) -> float:
        h = hashlib.blake2b(repr((self.plan.seed, *key)).encode(), digest_size=8).digest()
        return int.from_bytes(h, "big") / 2.0**64

    def _matches(self, ops: Mapping[str, Any] | frozenset[str] | None, method: str) -> bool:
        if ops is None:
            return True
        return method in ops or _GROUPS[method] in ops

    def _before(self, method: str, path: str) -> None:
        plan = self.plan
        group = _GROUPS[method]
        with self._lock:
            if self.crashed:
                raise SimulatedCrash(f"the process already crashed (call {method} {path})")
            self.calls[method] += 1
            if plan.call_log is not None:
                _log_call(plan.call_log, method, path)
            self._total += 1
            total = self._total
            n = self._per_path[(method, path)]
            self._per_path[(method, path)] = n + 1
            if group in _MUTATING:
                crash = (
                    plan.crash_after_writes is not None and self.writes >= plan.crash_after_writes
                ) or (plan.crash_on_path is not None and plan.crash_on_path in path)
                if crash:
                    self.crashed = True
                    self.injected["crash"] += 1
                    raise SimulatedCrash(f"crash point before {method} {path}")
        if plan.latency:
            lo, hi = plan.latency if isinstance(plan.latency, tuple) else (plan.latency,) * 2
            time.sleep(lo + (hi - lo) * self._draw("latency", method, path, n))
        if plan.expire_after is not None and total > plan.expire_after:
            self._count("expired")
            cls, msg = _PERMANENT["expired"]
            raise cls(f"{msg} ({method} {path})")
        if plan.path_contains is not None and plan.path_contains not in path:
            return
        for op, kind in plan.permanent.items():
            if op in (method, group):
                self._count("permanent")
                cls, msg = _PERMANENT[kind]
                raise cls(f"{msg} ({method} {path})")
        if plan.transient_rate and self._matches(plan.transient_ops, method):
            if self._draw("transient", method, path, n) < plan.transient_rate:
                self._count("transient")
                cls, msg = _TRANSIENT[int(self._draw("kind", method, path, n) * len(_TRANSIENT))]
                raise cls(f"{msg} ({method} {path})")

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1

    def _wrote(self) -> None:
        with self._lock:
            self.writes += 1

    # -- FileSystemHandler ----------------------------------------------------------

    def get_type_name(self) -> str:
        return f"faulty+{self.inner.type_name}"

    # Each injector has its own plan and counters: equal only to itself.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        for p in paths:
            self._before("get_file_info", p)
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self._before("get_file_info_selector", selector.base_dir)
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self._before("create_dir", path)
        self.inner.create_dir(path, recursive=recursive)
        self._wrote()

    def delete_dir(self, path: str) -> None:
        self._before("delete_dir", path)
        self.inner.delete_dir(path)
        self._wrote()

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._before("delete_dir_contents", path)
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)
        self._wrote()

    def delete_root_dir_contents(self) -> None:
        self._before("delete_root_dir_contents", "/")
        self.inner.delete_dir_contents("/", accept_root_dir=True)
        self._wrote()

    def delete_file(self, path: str) -> None:
        self._before("delete_file", path)
        self.inner.delete_file(path)
        self._wrote()

    def move(self, src: str, dest: str) -> None:
        self._before("move", f"{src} -> {dest}")
        self.inner.move(src, dest)
        self._wrote()

    def copy_file(self, src: str, dest: str) -> None:
        self._before("copy_file", f"{src} -> {dest}")
        self.inner.copy_file(src, dest)
        self._wrote()

    def open_input_stream(self, path: str) -> pa.NativeFile:
        self._before("open_input_stream", path)
        return self._tear(path, self._vanish(path, self.inner.open_input_stream(path)))

    def open_input_file(self, path: str) -> pa.NativeFile:
        self._before("open_input_file", path)
        return self._tear(path, self._vanish(path, self.inner.open_input_file(path)))

    def _tear(self, path: str, opened: pa.NativeFile) -> pa.NativeFile:
        """``opened``, or a torn copy of its bytes (see ``FaultPlan.torn_reads``)."""
        mark = self.plan.torn_reads
        if mark is None or mark not in path:
            return opened
        with self._lock:
            n = self._torn[path]
            if n >= self.plan.torn_read_count:
                return opened
            self._torn[path] = n + 1
        with opened:
            data = opened.read()
        self._count("torn")
        return pa.BufferReader(data[: len(data) // 2] if n % 2 else b"")

    def _vanish(self, path: str, opened: pa.NativeFile) -> pa.NativeFile:
        mark = self.plan.vanish_after_open
        if mark is None or mark not in path:
            return opened
        with self._lock:
            if path in self._vanished:
                return opened
            self._vanished.add(path)
        self.inner.delete_file(path)
        self._count("vanished")
        return opened

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        self._before("open_output_stream", path)
        out = self.inner.open_output_stream(path, metadata=metadata)
        self._wrote()
        return out

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        self._before("open_append_stream", path)
        out = self.inner.open_append_stream(path, metadata=metadata)
        self._wrote()
        return out


def _log_call(directory: str, method: str, path: str) -> None:
    import os

    with open(os.path.join(directory, f"calls-{os.getpid()}.txt"), "a") as f:
        f.write(f"{method}\t{path}\n")


def read_call_log(directory: str) -> dict[int, list[tuple[str, str]]]:
    """``{pid: [(method, path), ...]}`` from a :class:`FaultPlan` ``call_log`` directory."""
    import os

    out: dict[int, list[tuple[str, str]]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("calls-") and name.endswith(".txt"):
            with open(os.path.join(directory, name)) as f:
                rows = (line.rstrip("\n").split("\t", 1) for line in f if "\t" in line)
                out[int(name[6:-4])] = [(method, path) for method, path in rows]
    return out


def faulty_filesystem(
    inner: pafs.FileSystem, plan: FaultPlan | None = None, **plan_fields: Any
) -> pafs.PyFileSystem:
    """``inner`` behind a :class:`FaultInjectingHandler`. The handler is
    ``result.handler`` (counters, ``crashed``).

    Args:
        inner: any pyarrow filesystem.
        plan: the faults; or give :class:`FaultPlan` fields as keywords.
    """
    if plan is None:
        plan = FaultPlan(**plan_fields)
    elif plan_fields:
        plan = replace(plan, **plan_fields)
    return pafs.PyFileSystem(FaultInjectingHandler(inner, plan))


def faulty_backend(backend: Backend, plan: FaultPlan | None = None, **plan_fields: Any) -> Backend:
    """The same backend (scheme, capabilities) with its filesystem wrapped.

    The commit protocol stays the one of the real backend (a wrapped local
    disk still commits by rename). ``rebuild`` builds a fresh wrapper whose
    plan has no ``expire_after`` (fresh credentials), around
    ``backend.rebuild()`` when the real backend has one, else around the same
    inner filesystem.
    """
    if plan is None:
        plan = FaultPlan(**plan_fields)
    elif plan_fields:
        plan = replace(plan, **plan_fields)

    def rebuild() -> pafs.FileSystem:
        inner = backend.rebuild() if backend.rebuild is not None else backend.filesystem
        return faulty_filesystem(inner, replace(plan, expire_after=None))

    return Backend(
        faulty_filesystem(backend.filesystem, plan),
        scheme=backend.scheme,
        capabilities=backend.capabilities,
        name=f"{backend.name or backend.scheme} (faulty)",
        rebuild=rebuild,
    )


_PLAN_OPTIONS = {
    "fault_seed": "seed",
    "fault_transient_rate": "transient_rate",
    "fault_call_log": "call_log",
    "fault_latency": "latency",
    "fault_vanish_after_open": "vanish_after_open",
    "fault_torn_reads": "torn_reads",
    "fault_torn_read_count": "torn_read_count",
}


def faulty_scheme_backend(uri: str, storage_options: Mapping[str, Any]) -> Backend:
    """Backend factory for ``faulty+<scheme>://...``: the ``<scheme>`` backend
    behind a :class:`FaultInjectingHandler`.

    The plan comes from the storage options ``fault_seed``,
    ``fault_transient_rate``, ``fault_latency``, ``fault_call_log``,
    ``fault_vanish_after_open``, ``fault_torn_reads`` and
    ``fault_torn_read_count`` (:class:`FaultPlan` fields); every other option goes to the inner
    backend. Registered by dotted path, it reaches other processes that
    unpickle a filesystem built on it (``checkpoint_store.integrations.ray``).
    """
    from checkpoint_store.registry import backend_for_scheme, split_scheme

    scheme, _, rest = uri.partition("://")
    if not scheme.startswith("faulty+"):
        raise ValueError(f"faulty_scheme_backend serves faulty+<scheme>:// URIs, got {uri!r}")
    inner_uri = f"{scheme[len('faulty+'):]}://{rest}"
    options = dict(storage_options)
    plan = FaultPlan(**{field_: options.pop(k) for k, field_ in _PLAN_OPTIONS.items()
                        if k in options})
    inner = backend_for_scheme(split_scheme(inner_uri) or "file", inner_uri, options)
    return faulty_backend(inner, plan)
