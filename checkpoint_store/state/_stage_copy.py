"""One copy of a tensor's bytes into the staging area, from any device.

:class:`~checkpoint_store.state._staging.Stager` copies each tensor of a
state, in pieces, into its shared-memory staging area. :class:`StagingCopier`
does that copy, the same way for every source:

* a torch tensor (on any device, contiguous or not, any dtype the format
  stores) is copied with ``dst.copy_(src)`` into a torch view of the staging
  area (``torch.frombuffer`` over the area's ``mmap``, viewed as the
  tensor's dtype and the piece's shape): one copy, no intermediate tensor on
  the host. A GPU tensor is copied device-to-host straight into staging. A
  contiguous CPU tensor's bytes are copied as bytes (one ``memcpy``, on the
  calling thread);
* a numpy array (any strides, either byte order) is copied with
  ``numpy.copyto`` into a numpy view of the area, byte-swapped on the way.

A piece is a range of elements of the tensor's C-order flattening. A
contiguous source is sliced as one flat view; a strided one (transposed,
sliced with a step, broadcast) is covered by at most ``2 * ndim - 1`` strided
blocks (:func:`flat_blocks`), each copied into its place, so a piece may
start and end anywhere, whatever the size of a row.

With CUDA, the area is registered as pinned (page-locked) host memory once,
on the first CUDA tensor (or in :meth:`StagingCopier.warm` when CUDA is
already initialized), and unregistered by :meth:`StagingCopier.close`: a
device-to-host copy into pinned memory is a DMA that runs asynchronously, so
every piece's copy is issued with ``non_blocking=True`` on the tensor's
current stream (ordered after the kernels that produced it) and the stager
calls :meth:`StagingCopier.sync` (one event per device, recorded after the
last copy and waited for) before any piece is handed to the persist
process. Where pinning fails (no support, no memory to lock), it logs at
debug level and copies synchronously into pageable memory; never an error.
Other devices (``mps``, ``xpu``, ...) copy synchronously.
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
from typing import Any

__all__ = ["StagingCopier", "flat_blocks"]

logger = logging.getLogger(__name__)
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device


def flat_blocks(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], int, int]]:
    """Strided blocks covering elements ``[a, b)`` of the C-order flattening
    of an array of ``shape``, in order.

    Args:
        shape: at least one dimension, no zero-size dimension.
        a, b: ``0 <= a < b <= prod(shape)``.

    Returns:
        ``(index, lo, hi)`` triples: the block ``x[index][lo:hi]`` (``index``
        a tuple of ints fixing the leading dimensions; the dimensions after
        the sliced one whole), holding ``(hi - lo) * prod(shape[len(index) +
        1:])`` consecutive elements of the flattening. At most ``2 * ndim -
        1`` blocks.
    """
    out: list[tuple[tuple[int, ...], int, int]] = []

    def cover(index: tuple[int, ...], a: int, b: int) -> None:
        inner = math.prod(shape[len(index) + 1:])  # elements per step of this dimension
        first, last = -(-a // inner), b // inner  # the whole steps: [first, last)
        if first > last:  # inside one step
            i = a // inner
            cover((*index, i), a - i * inner, b - i * inner)
            return
        if a < first * inner:
            cover((*index, first - 1), a - (first - 1) * inner, inner)
        if first < last:
            out.append((index, first, last))
        if last * inner < b:
            cover((*index, last), 0, b - last * inner)

    cover((), a, b)
    return out


class StagingCopier:
    """Copies pieces of tensors into one staging area (module docstring).

    Args:
        area: the staging area's map (writable); it must outlive this copier,
            and :meth:`close` must run before it is closed.

    Attributes:
        pinned: the area is registered as pinned host memory with CUDA.
        copied: source device type (``"cpu"``, ``"cuda"``, ``"numpy"``) ->
            bytes copied into the area from it, over the copier's life.

    Thread-safety: the stager's stage lock serializes every call.
    """

    def __init__(self, area: mmap.mmap):
        self._area = area
        self._view: Any = None  # a torch uint8 view of the whole area, made on first use
        self._pin_tried = False
        self.pinned = False
        self._pending: set[Any] = set()  # CUDA devices with copies not yet waited for
        self.copied: dict[str, int] = {}

    # -- pinning ---------------------------------------------------------------

    def _torch_view(self) -> Any:
        if self._view is None:
            import torch

            self._view = torch.frombuffer(self._area, dtype=torch.uint8)
        return self._view

    def warm(self) -> None:
        """Pin the area now if this process already uses CUDA (best effort)."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            self._pin()

    def _pin(self) -> None:
        """Register the area as pinned with CUDA, once; a failure leaves it
        pageable (logged at debug level)."""
        if self._pin_tried:
            return
        self._pin_tried = True
        try:
            import torch

            if not torch.cuda.is_available():
                return
            view = self._torch_view()
            err = torch.cuda.cudart().cudaHostRegister(
                view.data_ptr(), view.numel(), _CUDA_HOST_REGISTER_PORTABLE)
            if int(err) != 0:
                _clear_cuda_error()
                logger.debug("staging stays pageable: cudaHostRegister returned %s", err)
                return
            self.pinned = True
        except Exception as exc:  # no CUDA runtime, an old torch: copy without pinning
            logger.debug("staging stays pageable: %s", exc)

    def close(self) -> None:
        """Wait for copies in flight, unregister the pinning, drop the view
        (the area may then be closed). Errors are logged, never raised."""
        try:
            self.sync()
        except Exception as exc:
            logger.debug("a staging copy failed at close: %s", exc)
        if self.pinned:
            self.pinned = False
            try:
                import torch

                err = torch.cuda.cudart().cudaHostUnregister(self._view.data_ptr())
                if int(err) != 0:
                    _clear_cuda_error()
                    logger.debug("cudaHostUnregister of the staging area returned %s", err)
            except Exception as exc:  # CUDA torn down at exit
                logger.debug("could not unregister the staging area: %s", exc)
        self._view = None

    # -- copies ----------------------------------------------------------------

    def source(self, value: Any) -> Any:
        """What :meth:`copy` copies from: ``value`` detached (torch) or as an
        array (numpy: a scalar as a 0-d array)."""
        if _is_numpy(value):
            return sys.modules["numpy"].asarray(value)
        return value.detach()

    def copy(self, src: Any, start: int, count: int, off: int) -> None:
        """Copy elements ``[start, start + count)`` of ``src``'s C-order
        flattening (a :meth:`source`), little-endian, to bytes ``[off, off +
        count * itemsize)`` of the area.

        A CUDA source's copy may still be running on return (pinned area):
        :meth:`sync` waits for it. Raises what ``copy_`` / ``copyto`` raise.
        """
        if _is_numpy(src):
            self._copy_numpy(src, start, count, off)
            return
        item = src.element_size()
        device = src.device
        if device.type == "cpu" and _contiguous(src) and not (src.is_conj() or src.is_neg()):
            # A memcpy of its bytes: torch's copy_ would split it over its
            # intra-op threads, which costs more than it saves (4x measured on
            # two busy cores) where the persist process and the loop want them.
            import numpy as np
            import torch

            raw = src.reshape(-1)[start:start + count].view(torch.uint8).numpy()
            np.copyto(np.frombuffer(self._area, dtype=np.uint8, count=raw.size, offset=off), raw)
            self.copied["cpu"] = self.copied.get("cpu", 0) + raw.size
            return
        dst = self._torch_view()[off:off + count * item].view(src.dtype)
        non_blocking = False
        if device.type == "cuda":
            self._pin()
            non_blocking = self.pinned
        if non_blocking:  # before the first copy: sync() waits even if a later one fails
            self._pending.add(device)
        _copy_blocks(src, start, count, dst, lambda d, s: d.copy_(s, non_blocking=non_blocking),
                     lambda d, shape: d.view(shape))
        self.copied[device.type] = self.copied.get(device.type, 0) + count * item

    def _copy_numpy(self, src: Any, start: int, count: int, off: int) -> None:
        import numpy as np

        dtype = src.dtype.newbyteorder("<") if src.dtype.byteorder == ">" else src.dtype
        dst = np.frombuffer(self._area, dtype=dtype, count=count, offset=off)
        _copy_blocks(src, start, count, dst, np.copyto, lambda d, shape: d.reshape(shape))
        self.copied["numpy"] = self.copied.get("numpy", 0) + count * dtype.itemsize

    def sync(self) -> None:
        """Return once every copy issued so far is in the area: one event per
        CUDA device, recorded on its current stream after the last copy,
        waited for. Raises the CUDA error of a failed copy."""
        if not self._pending:
            return
        import torch

        devices, self._pending = self._pending, set()
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            event.synchronize()


def _copy_blocks(src: Any, start: int, count: int, dst: Any, copy: Any, shaped: Any) -> None:
    """``copy(dst_part, src_part)`` for each block of elements ``[start,
    start + count)`` of ``src`` (one flat slice when ``src`` is contiguous),
    ``dst`` a flat contiguous view of ``count`` elements and ``shaped(view,
    shape)`` a view of a part of it in a block's shape."""
    if _contiguous(src):
        copy(dst, src.reshape(-1)[start:start + count])
        return
    shape = tuple(int(n) for n in src.shape)
    at = 0
    for index, lo, hi in flat_blocks(shape, start, start + count):
        rest = shape[len(index) + 1:]
        n = (hi - lo) * math.prod(rest)
        copy(shaped(dst[at:at + n], (hi - lo, *rest)), src[index][lo:hi])
        at += n


def _contiguous(src: Any) -> bool:
    if _is_numpy(src):
        return bool(src.flags.c_contiguous)
    return bool(src.is_contiguous())


def _is_numpy(value: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.ndarray, np.generic))


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call that was
    handled here, so the next kernel launch check does not report it: through
    the process's loaded ``libcudart`` (torch exposes no binding for it); a
    runtime linked statically is left as it is."""
    try:
        import ctypes

        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libcudart" in line}
        for path in libs:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError, IndexError) as exc:
        logger.debug("could not reset the CUDA error: %s", exc)
