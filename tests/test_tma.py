"""Hopper's TMA and mbarrier intrinsics (pycalm.kernels.tma) against NumPy: a box lands swizzled
where the model says (zeros outside the array), and boxes fetched by TMA feed wgmma as they are.
Under the simulator these test the twins; with PYCALM_TEST_GPU=1 the same tests run the inline PTX
on the GPU (compute capability 9.0)."""

import numpy as np
import pytest
from numba import cuda, float32, int32

from pycalm.kernels.tma import (
    SWIZZLE_128B,
    SWIZZLE_NONE,
    fence_mbarrier_init,
    mbarrier_expect_tx,
    mbarrier_init,
    mbarrier_try_wait,
    tensor_map_2d,
    tensormap_acquire,
    tma_load_2d,
)
from pycalm.kernels.warpgroup import (
    SWIZZLE_128B as DESC_SWIZZLE_128B,
)
from pycalm.kernels.warpgroup import (
    shared_byte_address,
    smem_desc,
    wgmma_commit,
    wgmma_f16,
    wgmma_fence,
    wgmma_wait,
)

BOX_ROWS, BOX_COLS = 24, 64  # fp16: 128-byte rows, three 1 KiB atoms
BOX_WORDS = BOX_ROWS * BOX_COLS // 2
SMEM_WORDS = BOX_WORDS + 256 + 2  # the box at a 1 KiB boundary, then the barrier


@cuda.jit
def _box_kernel(tmap, out, row, col):  # noqa: ANN001, ANN201
    # out (BOX_WORDS,) int32: the shared image of the box at (row, col)
    smem = cuda.shared.array(SMEM_WORDS, int32)  # the box, then the barrier (2 words)
    tid = cuda.threadIdx.x
    pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2  # words to a 1 KiB boundary
    bar = pad + BOX_WORDS
    if tid == 0:
        mbarrier_init(smem, bar, 1)
        fence_mbarrier_init()
    cuda.syncthreads()  # the barrier is set up before anyone waits on it
    if tid == 0:
        tensormap_acquire(tmap)
        mbarrier_expect_tx(smem, bar, BOX_WORDS * 4)
        tma_load_2d(smem, pad, tmap, col, row, bar)
    while mbarrier_try_wait(smem, bar, 0) == 0:  # phase 0: the box's bytes have landed
        pass
    for i in range(tid, BOX_WORDS, cuda.blockDim.x):
        out[i] = smem[pad + i]


def _model(src: np.ndarray, row: int, col: int, swizzle: int) -> np.ndarray:
    """The box's shared image as the module docstring says: rows of 128 bytes, zeros outside
    the array, the 16-byte chunk c of row r at c ^ (r & 7) when swizzled -> (BOX_WORDS,) int32."""
    box = np.zeros((BOX_ROWS, BOX_COLS), np.float16)
    part = src[row : row + BOX_ROWS, col : col + BOX_COLS]
    box[: part.shape[0], : part.shape[1]] = part
    data = box.reshape(-1).view(np.uint8)
    image = np.zeros(BOX_WORDS * 4, np.uint8)
    a = np.arange(data.size)
    if swizzle == SWIZZLE_128B:
        a = a ^ (((a >> 7) & 7) << 4)
    image[a] = data
    return image.view(np.int32)


@pytest.mark.parametrize("swizzle", [SWIZZLE_128B, SWIZZLE_NONE])
@pytest.mark.parametrize(("row", "col"), [(8, 0), (40, 64)])  # inside; past the last row and column
def test_tma_box_lands_where_the_model_says(swizzle: int, row: int, col: int) -> None:
    rng = np.random.default_rng(row + swizzle)
    src = rng.standard_normal((50, 104)).astype(np.float16)  # rows of 208 bytes
    d_src = cuda.to_device(src)
    out = cuda.to_device(np.zeros(BOX_WORDS, np.int32))
    _box_kernel[1, 128](tensor_map_2d(d_src, BOX_ROWS, BOX_COLS, swizzle), out, row, col)
    got = out.copy_to_host()
    want = _model(src, row, col, swizzle)
    assert np.array_equal(got, want), np.nonzero(got != want)[0][:8]


K = 64  # the tiles' K: one 128-byte row
_wgmma64 = wgmma_f16(64)
_wait0 = wgmma_wait(0)


@cuda.jit
def _tma_wgmma_kernel(tmap_a, tmap_b, out):  # noqa: ANN001, ANN201
    # out (64, 64) float32 = A (64, K) B^T, A and B^T (64, K) fp16 boxes fetched by TMA
    smem = cuda.shared.array(2 * 2048 + 256 + 2, int32)  # A's box, B's box (1 KiB aligned), the barrier
    tid = cuda.threadIdx.x
    pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2
    bar = pad + 4096
    if tid == 0:
        mbarrier_init(smem, bar, 1)
        fence_mbarrier_init()
    cuda.syncthreads()  # the barrier is set up before anyone waits on it
    if tid == 0:
        tensormap_acquire(tmap_a)
        tensormap_acquire(tmap_b)
        mbarrier_expect_tx(smem, bar, 2 * 8192)
        tma_load_2d(smem, pad, tmap_a, 0, 0, bar)
        tma_load_2d(smem, pad + 2048, tmap_b, 0, 0, bar)
    while mbarrier_try_wait(smem, bar, 0) == 0:  # both boxes have landed
        pass
    acc = cuda.local.array(32, float32)  # (8, 4) this thread's D elements
    for i in range(32):
        acc[i] = 0.0
    wgmma_fence()
    for kk in range(K // 16):  # the kk-th 16 of K: 32 bytes on in the swizzled rows
        da = smem_desc(smem, pad + 8 * kk, 16, 1024, DESC_SWIZZLE_128B)
        db = smem_desc(smem, pad + 2048 + 8 * kk, 16, 1024, DESC_SWIZZLE_128B)
        _wgmma64(acc, smem, da, db, 1)
    wgmma_commit()
    _wait0()
    q, lane = tid >> 5, tid & 31
    g, t = lane >> 2, lane & 3
    for j in range(8):
        out[16 * q + g, 8 * j + 2 * t] = acc[4 * j]
        out[16 * q + g, 8 * j + 2 * t + 1] = acc[4 * j + 1]
        out[16 * q + g + 8, 8 * j + 2 * t] = acc[4 * j + 2]
        out[16 * q + g + 8, 8 * j + 2 * t + 1] = acc[4 * j + 3]


def test_tma_boxes_feed_wgmma() -> None:
    """A box fetched with the 128-byte swizzle is a wgmma operand as it is: D = A B^T."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, K)).astype(np.float16)
    bt = rng.standard_normal((64, K)).astype(np.float16)
    maps = [tensor_map_2d(cuda.to_device(m), 64, K, SWIZZLE_128B) for m in (a, bt)]
    out = cuda.to_device(np.zeros((64, 64), np.float32))
    _tma_wgmma_kernel[1, 128](*maps, out)
    got = out.copy_to_host()
    want = a.astype(np.float64) @ bt.astype(np.float64).T
    scale = np.abs(a.astype(np.float64)) @ np.abs(bt.astype(np.float64)).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6)


def test_a_box_the_hardware_does_not_take_is_refused() -> None:
    src = cuda.to_device(np.zeros((8, 104), np.float16))
    with pytest.raises(ValueError, match="128 swizzled"):
        tensor_map_2d(src, 8, 72, SWIZZLE_128B)  # 144-byte rows
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        tensor_map_2d(cuda.to_device(np.zeros((8, 100), np.float16)), 8, 64, SWIZZLE_128B)
