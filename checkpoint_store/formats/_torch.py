"""The torch formats: ``torch.save`` files and torch.distributed.checkpoint (DCP)
directories, read as :class:`~._sources.Source` and written from one.

Reading uses torch's own loader: ``torch.load(mmap=True, weights_only=True)``
(tensors stay memory-mapped views of the file; only JSON-like values are
accepted); a DCP directory is read by :mod:`._dcp_source`.
Writing streams, at most two tensors in memory: DCP's own save plans from
meta-device placeholders and writes the ``.metadata``, and each tensor's
file is written here as the ``torch.save`` archive DCP's writer would put
there (:func:`write_dcp`); a ``torch.save`` file is written record by
record as ``torch.save`` does (:func:`write_torch_save`).

All paths here are local: :mod:`._api` downloads a remote source into a
temporary directory first and :mod:`._export` uploads what is written here.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
import zipfile
import zlib
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from checkpoint_store.errors import CheckpointCorruptError, FormatConversionError
from checkpoint_store.formats._sources import CHUNK_BYTES, Entry, Source
from checkpoint_store.state import DTYPES, flatten_state
from checkpoint_store.state._tree import build_tree, iter_leaves

__all__ = ["TorchSaveSource", "write_dcp", "write_torch_save"]

_BY_TORCH = {t: name for name, (_, _n, t) in DTYPES.items() if t}
DCP_METADATA = ".metadata"


def _dtype_name(dtype: Any, key: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _BY_TORCH:
        raise FormatConversionError(f"tensor {key!r} has dtype {dtype}, which safetensors "
                                    "cannot hold", key=key)
    return _BY_TORCH[name]


def _byte_view(t: Any) -> memoryview:
    """A contiguous CPU tensor's bytes as a flat read-only view (no copy)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).toreadonly()


def _pieces_of(view: memoryview) -> Iterator[memoryview]:
    for at in range(0, len(view), CHUNK_BYTES):
        yield view[at:at + CHUNK_BYTES]


class TorchSaveSource(Source):
    """The tensors and values of a local ``torch.save`` file.

    Raises (at construction):
        CheckpointCorruptError: not a ``torch.save`` file (of either format),
            or a damaged one.
        FormatConversionError: ``weights_only`` loading refuses the file (it
            pickles objects other than tensors and plain containers).
        UnsupportedStateError: a value a state cannot hold, two tensors
            overlapping without being one view (``.key`` names it).
    """

    kind = "torch_save"

    def __init__(self, path: str):
        import torch

        self.where = path
        # mmap needs torch's zip format; a file of the legacy format
        # (_use_new_zipfile_serialization=False) is read into memory.
        zipped = zipfile.is_zipfile(path)
        try:
            obj = torch.load(path, map_location="cpu", mmap=zipped, weights_only=True)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "global" not in str(exc).lower():  # damaged, or not torch's at all
                # (weights_only names the global it refuses; a text file fails
                # on its first byte as an "Unsupported operand")
                raise CheckpointCorruptError(
                    f"{path} is not a torch.save file, or is damaged ({type(exc).__name__}: "
                    f"{first}); give a file torch.save wrote", path=path) from exc
            raise FormatConversionError(
                f"{path} holds objects other than tensors, containers and plain values "
                f"(torch.load(weights_only=True) says: {first}); save the state_dict "
                "alone", key=None) from exc
        flat = flatten_state(obj)
        self._values = flat.values
        self.skeleton = flat.layout.skeleton
        self.entries = {k: Entry(k, s.dtype, s.shape) for k, s in flat.layout.tensors.items()}
        for k, target in flat.layout.aliases.items():
            s = flat.layout.tensors[target]
            self.entries[k] = Entry(k, s.dtype, s.shape, target)
        self.values = {k: n["value"] for k, n in iter_leaves(self.skeleton) if "value" in n}

    def chunks(self, key: str) -> Iterator[Any]:
        e = self.entries[key]
        yield from _pieces_of(_byte_view(self._values[e.alias_of or key]))


class _Storage:
    """Stands for one tensor's storage while the tree is pickled: ``key``
    names its ``data/<key>`` record, ``source_key`` the tensor it is read from."""

    def __init__(self, key: str, source_key: str, dtype: Any, nbytes: int):
        self.key, self.source_key, self.dtype, self.nbytes = key, source_key, dtype, nbytes


class _Tensor:
    """Pickles as a contiguous CPU tensor over a :class:`_Storage`, with the
    reduce ``torch.Tensor._reduce_ex_internal`` gives a plain dense tensor:
    ``_rebuild_tensor_v2(TypedStorage, offset, size, stride, requires_grad,
    hooks)``, or ``_rebuild_tensor_v3(UntypedStorage, ..., dtype)`` for the
    dtypes of ``torch.storage._new_dtypes()`` (float8 and the like)."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: Any) -> Any:
        import collections

        import torch

        dtype = self.storage.dtype
        stride = torch.empty(self.shape, dtype=dtype, device="meta").stride()
        hooks: Any = collections.OrderedDict()
        args: tuple[Any, ...] = (self.storage, 0, self.shape, stride, False, hooks)
        if dtype in torch.storage._new_dtypes():
            return (torch._utils._rebuild_tensor_v3, (*args, dtype))
        return (torch._utils._rebuild_tensor_v2, args)


def _pickled(tree: Any) -> tuple[bytes, list[_Storage]]:
    """``data.pkl`` of ``tree`` (its tensors :class:`_Tensor` placeholders)
    and its storages in the order the pickler met them (their records'
    order)."""
    import pickle

    import torch
    from torch import serialization as ser

    order: list[_Storage] = []

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:  # _save's persistent_id
            if not isinstance(obj, _Storage):
                return None
            if not obj.key:
                obj.key = str(len(order))
                order.append(obj)
            if obj.dtype in torch.storage._new_dtypes():
                return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.nbytes)
            kind = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", kind, obj.key, "cpu", obj.nbytes // obj.dtype.itemsize)

    buf = io.BytesIO()
    _Pickler(buf, protocol=ser.DEFAULT_PROTOCOL).dump(tree)
    return buf.getvalue(), order


@contextmanager
def _archive(path: str, crcs: dict[str, int]) -> Iterator[Any]:
    """A ``torch._C.PyTorchFileWriter`` at local ``path`` made as torch.save
    makes it (its storage alignment), but with its CRC-32s left to
    :func:`~._zipcrc.fill_crcs`: the caller writes the records
    (:func:`_preamble`, then the storages) and puts each storage's CRC-32
    in ``crcs`` (``"data/<key>"``: taken as it was read ahead); the
    archive's end is written, and its CRCs filled in, on a normal exit
    only. (The writer's own CRC runs at 1.1 GB/s, a third of its speed
    without; torch.save's CRC option off leaves them 0, which
    ``fill_crcs`` does not.)"""
    import torch
    from torch import serialization as ser

    from checkpoint_store.formats._zipcrc import fill_crcs

    # _open_zipfile_writer_file: the writer opens an ASCII path itself (the
    # archive's folder is then the file's stem), else it writes to a stream.
    with contextlib.ExitStack() as stack:
        target: Any = path if path.isascii() else stack.enter_context(open(path, "wb"))
        writer = torch._C.PyTorchFileWriter(target, False, ser._get_storage_alignment())
        yield writer
        writer.write_end_of_file()
    if ser.get_crc32_options():
        fill_crcs(path, crcs)


def _preamble(writer: Any, pkl: bytes) -> None:
    """``data.pkl``, ``.format_version``, ``.storage_alignment`` and
    ``byteorder``: the records torch.save writes before the storages."""
    import sys

    from torch import serialization as ser

    writer.write_record("data.pkl", pkl, len(pkl))
    alignment = str(ser._get_storage_alignment())
    for name, text in ((".format_version", "1"), (".storage_alignment", alignment),
                       ("byteorder", sys.byteorder)):
        writer.write_record(name, text.encode(), len(text))


def _tied(source: Source, keys: list[str], make: Callable[[Entry], Any]) -> dict[str, Any]:
    """``make(entry)`` of each key; a tied key and the key it aliases get
    one object (pickled once, planned once: they load tied)."""
    out: dict[str, Any] = {}
    for key in keys:
        e = source.entries[key]
        if e.alias_of is not None and e.alias_of in out:
            out[key] = out[e.alias_of]
            continue
        out[key] = make(e)
        if e.alias_of is not None:
            out[e.alias_of] = out[key]
    return out


def _slots(source: Source, keys: list[str]) -> dict[str, _Tensor]:
    """A :class:`_Tensor` of each key (tied keys: one, :func:`_tied`)."""
    import torch

    return _tied(source, keys, lambda e: _Tensor(_Storage(
        "", e.alias_of or e.key, getattr(torch, str(DTYPES[e.dtype][2])), e.nbytes), e.shape))


def write_torch_save(source: Source, keys: list[str], skeleton: Any, path: str) -> None:
    """Write the tree ``skeleton`` describes as a ``torch.save`` file at local
    ``path``, one tensor in memory at a time.

    Mirrors ``torch.serialization._save`` (torch 2.x zip format) record by
    record: ``data.pkl`` (the tree pickled with protocol 2, each storage a
    persistent id ``("storage", <type>, "<n>", "cpu", <numel>)``),
    ``.format_version``, ``.storage_alignment``, ``byteorder``, then one
    ``data/<n>`` per storage in the order the pickler met them, written by
    ``torch._C.PyTorchFileWriter`` as torch.save does. A tied tensor is one
    placeholder object, pickled once (pickle's memo), so it loads tied.
    """
    pkl, order = _pickled(build_tree(skeleton, _slots(source, keys).__getitem__))
    crcs: dict[str, int] = {}
    with _archive(path, crcs) as writer:
        _preamble(writer, pkl)
        _write_storages(writer, source, order, crcs)


def _fill(source: Source, key: str, out: Any) -> None:
    """The bytes of tensor ``key`` into ``out`` (a uint8 array of its size),
    checked as the source checks them (read straight into it where the
    source can)."""
    source.read_into(key, memoryview(out).cast("B"))


def _read_ahead(source: Source, keys: Sequence[str],
                sizes: Sequence[int]) -> Generator[tuple[Any, Any], None, None]:
    """Each tensor of ``keys`` in turn (``sizes``: their bytes) as ``(a
    uint8 torch.UntypedStorage whose first bytes are that tensor's, a
    future of their CRC-32)``, read and checked as the source checks them;
    valid until the next one is asked for. Close the generator
    (``contextlib.closing``) to free its buffers on an early exit.

    Two buffers of the largest tensor, made once and reused: the next
    tensor is read on a thread while the caller writes this one (torch's
    writers release the GIL), and no tensor costs a fresh allocation, whose
    page faults took as long as the copy itself (an export of 1 GiB in
    64 MiB tensors: 2.06 s, against 0.4-0.5 s for ``torch.save`` of the
    same tensors from memory). Peak memory: the two buffers, within the
    bound of two tensors the exports promise. The archive's CRC-32 of each
    tensor (``zlib.crc32``, the GIL released) runs on a third thread while
    the caller writes it and the next one is read; a buffer is refilled
    only once its CRC is taken."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch

    if not keys:
        return
    largest = max(1, max(sizes))
    areas = [mmap.mmap(-1, largest) for _ in range(2 if len(keys) > 1 else 1)]
    flats = [np.frombuffer(a, dtype=np.uint8) for a in areas]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer: "buffer is not writable" never applies
        storages = [torch.frombuffer(a, dtype=torch.uint8).untyped_storage() for a in areas]
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-store-format-read") as pool, \
                ThreadPoolExecutor(1, thread_name_prefix="checkpoint-store-format-crc") as crcs:
            def fill(i: int) -> None:
                _fill(source, keys[i], flats[i % len(areas)][:sizes[i]])

            pending = pool.submit(fill, 0)
            taken: list[Any] = []
            for i in range(len(keys)):
                pending.result()
                taken.append(crcs.submit(zlib.crc32, memoryview(areas[i % len(areas)])[:sizes[i]]))
                if i + 1 < len(keys):
                    if i >= 1:
                        taken[i - 1].result()  # its buffer is the one refilled next
                    pending = pool.submit(fill, i + 1)
                yield storages[i % len(areas)], taken[i]
    finally:
        flats.clear()
        storages.clear()
        for a in areas:
            with contextlib.suppress(BufferError):  # a view still alive: freed with it
                a.close()


def _write_storages(writer: Any, source: Source, order: list[_Storage],
                    crcs: dict[str, int]) -> None:
    """Each storage of ``order`` as its ``data/<key>`` record, in order,
    read ahead (:func:`_read_ahead`); its CRC-32 into ``crcs``."""
    filled = _read_ahead(source, [st.source_key for st in order], [st.nbytes for st in order])
    with contextlib.closing(filled):
        for st, (storage, crc) in zip(order, filled, strict=True):
            writer.write_record(f"data/{st.key}", storage, st.nbytes)
            crcs[f"data/{st.key}"] = crc.result()


def _placeholders(source: Source, keys: list[str]) -> dict[str, Any]:
    """``keys`` as meta-device tensors of their dtype and shape (no bytes);
    an alias is the same object as the tensor it aliases (:func:`_tied`)."""
    import torch

    return _tied(source, keys, lambda e: torch.empty(
        e.shape, dtype=getattr(torch, str(DTYPES[e.dtype][2])), device="meta"))


def write_dcp(source: Source, keys: list[str], skeleton: Any, path: str) -> None:
    """Save the tree ``skeleton`` describes as a DCP directory at local
    ``path`` with no process group, one tensor in memory at a time.

    DCP plans from a state dict of meta-device placeholders (dtype and shape
    are all planning needs) and writes the ``.metadata`` itself (its
    ``FileSystemWriter.finish``); the tensors' files are written by
    :func:`_dcp_writer`'s writer: one file per tensor, each the
    ``torch.save`` archive of that tensor that DCP's own writer would put
    there (``_write_item``: ``torch.save(tensor, stream)``), so DCP's reader
    (``torch.load`` of the byte range, then the chunk's narrowing) reads it
    as its own. DCP's writer pickles each tensor through a Python stream and
    keeps every tensor of a file referenced until the file closes; this one
    streams from :meth:`Source.read_into` into two reused buffers, the next
    tensor read on a thread while this one is written.
    """
    import torch.distributed.checkpoint as dcp

    slots = _placeholders(source, keys)
    tree = build_tree(skeleton, slots.__getitem__)
    pickled = _pickled_whole(tree)
    if pickled:
        # DCP pickles these whole (a tuple, a list of plain values): they
        # need their bytes, read here (small, as values of that kind are).
        real: dict[int, Any] = {}
        for k, t in list(slots.items()):
            if id(t) in pickled:
                if id(t) not in real:
                    real[id(t)] = _read_tensor(source, k)
                slots[k] = real[id(t)]
        tree = build_tree(skeleton, slots.__getitem__)
    by_id = {id(t): (e.alias_of or k) for k, t in slots.items()
             for e in (source.entries[k],)}
    with _quiet():
        dcp.save(tree, storage_writer=_dcp_writer(path, source, by_id), no_dist=True)


def _pickled_whole(tree: Any) -> set[int]:
    """The ``id`` of each tensor of ``tree`` that DCP does not save as a
    tensor but inside a value it pickles whole (its own flattening: it
    walks dicts and lists that hold tensors, nothing else)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(tree)
    out: set[int] = set()
    stack = [v for v in flat.values() if not isinstance(v, torch.Tensor)]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.add(id(v))
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return out


def _read_tensor(source: Source, key: str) -> Any:
    """Tensor ``key`` of ``source`` read into a new CPU tensor (checked as
    the source checks it)."""
    import torch

    e = source.entries[key]
    t = torch.empty(e.shape, dtype=getattr(torch, str(DTYPES[e.dtype][2])))
    if e.nbytes:
        _fill(source, key, t.reshape(-1).view(torch.uint8).numpy())
    return t


def _dcp_writer(path: str, source: Source, by_id: dict[int, str]) -> Any:
    """A ``FileSystemWriter`` (one file per write item, each fsynced before
    the ``.metadata`` is written: DCP's ``sync_files``) whose tensor items
    are written by :func:`_write_tensor_files`. ``by_id`` maps each
    placeholder's ``id`` to the key whose bytes it stands for.

    Reads DCP's private ``filesystem._StorageInfo`` (what its reader
    expects in ``Metadata.storage_data``): the import fails loudly if a
    torch release renames it."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class _Writer(FileSystemWriter):
        def _write_data(self, planner: Any, file_queue: Any) -> Any:
            results: list[Any] = []
            tensors: list[tuple[str, str, Any, str]] = []
            while not file_queue.empty():
                file_path, name, items = file_queue.get_nowait()
                for item in items:
                    if item.type != WriteItemType.BYTE_IO:
                        key = by_id[id(planner.lookup_object(item.index))]
                        tensors.append((str(file_path), name, item, key))
                        continue
                    data = planner.resolve_data(item).getbuffer()
                    with open(file_path, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    results.append(WriteResult(index=item.index, size_in_bytes=len(data),
                                               storage_data=_StorageInfo(name, 0, len(data))))
            for (_, name, item, _), n in zip(tensors, _write_tensor_files(source, tensors),
                                            strict=True):
                results.append(WriteResult(index=item.index, size_in_bytes=n,
                                           storage_data=_StorageInfo(name, 0, n)))
            done: Future[list[Any]] = Future()
            done.set_result(results)
            return done

    return _Writer(path, single_file_per_rank=False, thread_count=1)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tensor_files(source: Source, jobs: list[tuple[str, str, Any, str]]) -> list[int]:
    """Each ``(file path, _, _, key)`` of ``jobs`` as a file holding the
    ``torch.save`` archive of tensor ``key`` alone; returns each file's
    size once every file is fsynced. The tensors are read ahead
    (:func:`_read_ahead`), and each written file is fsynced on another
    thread while the next ones are written (DCP's own writer fsyncs each
    file before it starts the next)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    entries = [source.entries[key] for *_, key in jobs]
    filled = _read_ahead(source, [e.key for e in entries], [e.nbytes for e in entries])
    sizes: list[int] = []
    synced: list[Any] = []
    with contextlib.closing(filled), \
            ThreadPoolExecutor(1, thread_name_prefix="checkpoint-store-format-sync") as syncer:
        for (file_path, *_), e, (data, crc) in zip(jobs, entries, filled, strict=True):
            storage = _Storage("", e.key, getattr(torch, str(DTYPES[e.dtype][2])), e.nbytes)
            pkl, _ = _pickled(_Tensor(storage, e.shape))
            record_crcs: dict[str, int] = {}
            with _archive(file_path, record_crcs) as writer:
                _preamble(writer, pkl)
                writer.write_record(f"data/{storage.key}", data, e.nbytes)
                record_crcs[f"data/{storage.key}"] = crc.result()
            sizes.append(os.path.getsize(file_path))
            synced.append(syncer.submit(_fsync, file_path))
        for done in synced:
            done.result()
    return sizes


@contextmanager
def _quiet() -> Iterator[None]:
    """Around a DCP call: its warning that it runs in a single process (the
    intent here) is silenced, and its ``CheckpointException`` (a
    ``BaseException`` wrapping each rank's error) is unwrapped, so the
    caller meets the error itself (``TensorCorruptError``, ``OSError``, ...)."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as exc:
            failures = list(exc.failures.values())
            if not failures:
                raise
            raise failures[0][0] from exc
