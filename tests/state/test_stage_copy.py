"""Every tensor is copied once, straight into the staging area
(state/_stage_copy.py): every dtype, any strides, pieces cut anywhere, bit
for bit through the persist process; on CUDA the copy goes device-to-host
into the pinned area."""

from __future__ import annotations

import math

import numpy as np
import pytest

from checkpoint_store import Checkpoint, StorageContext, session
from checkpoint_store.state._stage_copy import flat_blocks
from checkpoint_store.state._staging import Stager
from checkpoint_store.testing import session_internals

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

MiB = 1 << 20
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.uint16, torch.int16, torch.uint32,
                torch.int32, torch.uint64, torch.int64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn,
                torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz]
# Ops that make a tensor of their own: none may run while a state is staged.
ALLOCATING = {"_to_copy", "clone", "contiguous", "empty", "empty_like", "empty_strided",
              "new_empty", "new_empty_strided", "to", "zeros", "zeros_like"}


def _random(shape: tuple[int, ...], dtype, gen, device="cpu"):
    """Random bits of ``dtype`` (NaNs and all), or 0/1 for bool."""
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool().to(device)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * item,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def _layouts(dtype, gen, device="cpu") -> dict:
    """One tensor of ``dtype`` in every layout a state may hold, each on memory
    of its own."""
    return {
        "contiguous": _random((7, 9), dtype, gen, device),
        "transposed": _random((9, 7), dtype, gen, device).t(),
        "stepped": _random((4, 9, 6), dtype, gen, device)[:, ::2, 1:],
        "permuted": _random((3, 4, 5), dtype, gen, device).permute(2, 0, 1),
        "broadcast": _random((11,), dtype, gen, device).expand(3, 2, 11),
        "column": _random((8, 5), dtype, gen, device)[:, 3],
        "zero_size": _random((0, 5), dtype, gen, device),
        "zero_size_strided": _random((4, 6), dtype, gen, device)[:, 2:2],
        "scalar": _random((), dtype, gen, device),
    }


def _bits(t) -> bytes:
    """A tensor's bytes in C order (on the CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(got, want, key: str) -> None:
    assert isinstance(got, torch.Tensor), key
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), key
    assert _bits(got) == _bits(want), key


@pytest.fixture(scope="module")
def stager():
    # Pieces of 100 bytes cut every tensor mid-row, at an element boundary of
    # any width; a budget of 1 MiB keeps the area small.
    s = Stager(MiB, piece_bytes=100)
    yield s
    s.close()


def _round_trip(stager: Stager, state: dict, tmp_path) -> dict:
    staged = stager.stage(state, str(tmp_path / "state"))
    staged.write_to()
    return Checkpoint.from_directory(str(tmp_path / "state")).load_state()


def test_flat_blocks_cover_every_range_in_order():
    for shape in [(5,), (3, 4), (2, 3, 4), (1, 5, 1, 2), (4, 1), (2, 2, 2, 2)]:
        n = math.prod(shape)
        x = np.arange(n).reshape(shape)
        for a in range(n):
            for b in range(a + 1, n + 1):
                blocks = flat_blocks(shape, a, b)
                assert len(blocks) <= 2 * len(shape) - 1
                got = np.concatenate([x[i][lo:hi].reshape(-1) for i, lo, hi in blocks])
                assert got.tolist() == list(range(a, b)), (shape, a, b)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_and_layout_round_trips_bit_for_bit(stager, tmp_path, dtype):
    gen = torch.Generator().manual_seed(TORCH_DTYPES.index(dtype))
    state = _layouts(dtype, gen)
    got = _round_trip(stager, state, tmp_path)
    assert list(got) == list(state)
    for key, want in state.items():
        _same(got[key], want, key)
        assert got[key].is_contiguous()


def test_conjugate_and_negative_views_are_stored_as_their_values(stager, tmp_path):
    z = torch.randn(6, 5, dtype=torch.complex64)
    state = {"conj": z.conj(), "conj_t": torch.randn(5, 6, dtype=torch.complex64).conj().t()}
    got = _round_trip(stager, state, tmp_path)
    for key, want in state.items():
        assert torch.equal(got[key], want.resolve_conj()), key


def test_numpy_arrays_of_any_strides_and_byte_order_round_trip(stager, tmp_path):
    rng = np.random.default_rng(3)
    base = rng.standard_normal((40, 30))
    state = {
        "big_endian": base.astype(">f8"),
        "big_endian_t": base.astype(">i4").T,
        "stepped": base.astype(np.float32)[::3, 1::2],
        "broadcast": np.broadcast_to(np.arange(17, dtype=np.int16), (4, 17)),
        "bool": base > 0,
        "complex": (base + 1j * base.T[:30, :40].T).astype(np.complex64)[::2],
        "scalar": np.float64(2.5),
        "zero_size": np.zeros((3, 0), dtype=np.uint8),
    }
    got = _round_trip(stager, state, tmp_path)
    for key, want in state.items():
        arr = np.asarray(want)
        assert got[key].dtype == arr.dtype.newbyteorder("<") and got[key].shape == arr.shape
        assert np.array_equal(got[key], arr), key
    assert isinstance(got["scalar"], np.float64)


def _area_copies(stager: Stager, state: dict, tmp_path) -> list[tuple[str, int, int]]:
    """Stage ``state`` and record every torch op run meanwhile: ``(op, address,
    bytes)`` (address and bytes of the destination for ``copy_``)."""
    seen: list[tuple[str, int, int]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "copy_":
                dst = args[0]
                seen.append((name, dst.data_ptr(), dst.numel() * dst.element_size()))
            else:
                seen.append((name, 0, 0))
            return func(*args, **(kwargs or {}))

    with Record():
        staged = stager.stage(state, str(tmp_path / "state"))
    staged.write_to()
    return seen


def test_each_tensor_is_copied_once_straight_into_the_area(tmp_path):
    """No intermediate tensor (no .contiguous(), .cpu() nor clone): a strided
    tensor is copied with ``copy_`` into the staging area, as many bytes as
    it holds (a contiguous CPU one as bytes, which is no torch op)."""
    gen = torch.Generator().manual_seed(1)
    state = {str(d): _layouts(d, gen) for d in (torch.float32, torch.bfloat16, torch.bool)}
    state["big_t"] = torch.randn(300, 500, generator=gen).t()
    s = Stager(MiB, piece_bytes=4096)
    try:
        ops = _area_copies(s, state, tmp_path)
        base = s.copier._torch_view().data_ptr()
    finally:
        s.close()
    assert not ALLOCATING & {name for name, _, _ in ops}
    copies = [(p, n) for name, p, n in ops if name == "copy_"]
    assert sum(n for _, n in copies) == sum(t.numel() * t.element_size()
                                            for t in _leaves(state) if not t.is_contiguous())
    assert all(base <= p and p + n <= base + MiB for p, n in copies)
    got = Checkpoint.from_directory(str(tmp_path / "state")).load_state()
    _same(got["big_t"], state["big_t"], "big_t")


def test_tensors_larger_than_a_piece_the_budget_and_its_rows_round_trip(tmp_path):
    """A 1 MiB budget (pieces of 256 KiB): tensors over budget / 4 and over
    the budget, a transposed one whose every row is larger than the budget,
    staged while the persist process drains the area."""
    gen = torch.Generator().manual_seed(7)
    state = {
        "contiguous_3mib": torch.randn(3 * MiB // 4, generator=gen),
        "transposed_2_8mb": torch.randn(1000, 700, generator=gen).t(),
        "rows_over_budget": torch.randn(300_000, 2, generator=gen).t(),
        "bf16_stepped": torch.randn(2000, 600, generator=gen).to(torch.bfloat16)[::2, ::3],
        "numpy_big_endian": np.arange(400_000, dtype=">i8"),
    }
    s = Stager(MiB)
    try:
        assert s.piece_bytes == MiB // 4
        got = _round_trip(s, state, tmp_path)
        assert s.peak_in_use <= MiB
    finally:
        s.close()
    for key, want in state.items():
        if isinstance(want, np.ndarray):
            assert np.array_equal(got[key], want), key
        else:
            _same(got[key], want, key)


def test_report_state_and_load_state_round_trip_every_dtype_bit_for_bit(tmp_path):
    gen = torch.Generator().manual_seed(11)
    state = {str(d).removeprefix("torch."): _layouts(d, gen) for d in TORCH_DTYPES}
    state["big"] = torch.randn(700, 900, generator=gen).t()  # > budget / 4
    state["step"] = 3
    with session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                       trial_name="t", upload_config=session.UploadConfig(
                           staging_budget=MiB)) as s:
        s.report({"step": 3}, state=state)
        s.wait()
        copied = dict(session_internals(s).stager.copier.copied)
    [(ckpt, _meta)] = StorageContext(str(tmp_path / "store"), "e", "t").committed_checkpoints()
    got = ckpt.load_state()
    assert got["step"] == 3
    _same(got["big"], state["big"], "big")
    for dtype_name, tensors in state.items():
        if isinstance(tensors, dict):
            for key, want in tensors.items():
                _same(got[dtype_name][key], want, f"{dtype_name}/{key}")
    assert copied == {"cpu": sum(
        t.numel() * t.element_size() for t in _leaves(state))}


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, torch.Tensor):
        yield tree


def test_without_cuda_the_area_is_not_pinned(stager, tmp_path):
    stager.copier.warm()
    _round_trip(stager, {"w": torch.ones(10)}, tmp_path)
    if not torch.cuda.is_available():
        assert not stager.copier.pinned
        assert "cuda" not in stager.copier.copied


# -- CUDA ------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_tensors_go_device_to_host_straight_into_the_pinned_area(tmp_path):
    """Contiguous and strided CUDA tensors, several pieces each, a state four
    times the budget (the area is reused while copies are in flight):
    pinned, copied once into the area, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    state = {d: _layouts(getattr(torch, d), gen, "cuda")
             for d in ("float32", "bfloat16", "bool", "int8", "float64", "complex64")}
    state["big"] = torch.randn(MiB, generator=gen).cuda()  # 4 MiB: 4x the budget
    state["big_t"] = torch.randn(1024, 512, generator=gen).cuda().t()
    s = Stager(MiB)
    try:
        ops = _area_copies(s, state, tmp_path)
        got = Checkpoint.from_directory(str(tmp_path / "state")).load_state()
        assert s.copier.pinned
        nbytes = sum(t.numel() * t.element_size() for t in _leaves(state))
        assert s.copier.copied == {"cuda": nbytes}
        base = s.copier._torch_view().data_ptr()
        assert not ALLOCATING & {name for name, _, _ in ops}
        copies = [(p, n) for name, p, n in ops if name == "copy_"]
        assert sum(n for _, n in copies) == nbytes
        assert all(base <= p and p + n <= base + s.budget for p, n in copies)
    finally:
        s.close()
    for key, tensors in state.items():
        if isinstance(tensors, dict):
            for k, want in tensors.items():
                _same(got[key][k], want, f"{key}/{k}")
        else:
            _same(got[key], tensors, key)


@cuda
def test_report_waits_for_the_device_to_host_copies_and_the_kernels_before_them(tmp_path):
    """The copies are queued behind the kernels that produce the state (a busy
    stream, then an in-place change), and report() returns, and the persist
    process reads a piece, only once they have finished: the saved bytes are
    the changed ones, not the staging area's earlier content, and a change
    right after report() is not in them."""
    w = torch.randn(4 * MiB, device="cuda")  # 16 MiB: 4 pieces of the default size, 8 with wt
    want = w.cpu() * 2
    with session.start(storage_path=str(tmp_path / "store"), experiment_name="e",
                       trial_name="t", upload_config=session.UploadConfig(
                           staging_budget=16 * MiB)) as s:
        torch.cuda._sleep(200_000_000)  # the stream stays busy for a while
        w.mul_(2)  # queued behind it: what is saved
        s.report({"step": 1}, state={"w": w, "wt": w.view(2048, -1).t()})
        w.add_(1.0)  # after report(): not saved
        s.wait()
        assert session_internals(s).stager.copier.pinned
    [(ckpt, _meta)] = StorageContext(str(tmp_path / "store"), "e", "t").committed_checkpoints()
    got = ckpt.load_state()
    assert torch.equal(got["w"], want)
    assert torch.equal(got["wt"], want.view(2048, -1).t())
