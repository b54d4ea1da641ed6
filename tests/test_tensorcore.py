"""The tensor-core intrinsics of pycalm.kernels.tensorcore against NumPy, fragment layouts as the
PTX ISA defines them (g = lane >> 2, t = lane & 3). Under the simulator these test the twins;
with PYCALM_TEST_GPU=1 the same tests run the inline PTX on the GPU.
"""

import numpy as np
import pytest
from numba import cuda, int32

from pycalm.kernels.tensorcore import (
    cp_async16,
    cp_async_commit,
    cp_async_wait_all,
    ldg64,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_16816,
    pack_f16x2,
    sts128,
)


def _words(h: np.ndarray) -> np.ndarray:
    """A float16 array (..., 2n) as int32 words of two halves, low half first."""
    return np.ascontiguousarray(h.astype(np.float16)).view(np.int32)


@cuda.jit
def _mma_kernel(a, bt, c, d):  # noqa: ANN001, ANN202
    # a (16, 8) words of A (16, 16); bt (8, 8) words of B^T (8, 16); c, d (16, 8) float32
    lane = cuda.threadIdx.x
    g, t = lane >> 2, lane & 3
    d0, d1, d2, d3 = mma_16816(
        a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], bt[g, t], bt[g, t + 4],
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1],
    )  # fmt: skip
    d[g, 2 * t] = d0
    d[g, 2 * t + 1] = d1
    d[g + 8, 2 * t] = d2
    d[g + 8, 2 * t + 1] = d3


def test_mma_16816():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = cuda.to_device(np.full((16, 8), np.nan, np.float32))
    _mma_kernel[1, 32](cuda.to_device(_words(a)), cuda.to_device(_words(b.T)), cuda.to_device(c), d)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)) + np.abs(c)
    err = np.abs(d.copy_to_host() - want)
    # the products of fp16 are exact; 16 float32 additions, a few roundings of the |a| |b| sum
    assert np.all(err <= 1e-6 * scale), f"max err / scale {np.max(err / scale):.3g}"


PITCH = 8  # words a staged row in the ldmatrix test: 4 of data, 4 of padding (rows 16-byte aligned)
STAGED_WORDS = 32 * PITCH


@cuda.jit
def _ldmatrix_kernel(src, trans, out):  # noqa: ANN001, ANN202
    # src (32, 4) words: rows 8i..8i+7 are matrix i (8 x 8 fp16); out (32, 4) words a lane;
    # trans: through the .trans form
    smem = cuda.shared.array(STAGED_WORDS, int32)  # (32 rows, PITCH) words, rows padded
    lane = cuda.threadIdx.x
    for e in range(4):
        smem[lane * PITCH + e] = src[lane, e]
        smem[lane * PITCH + 4 + e] = -1  # the padding: never read
    cuda.syncthreads()  # the rows are in shared memory before any lane loads
    if trans:  # (uniform over the warp) lane l: the address of row l
        r0, r1, r2, r3 = ldmatrix_x4_trans(smem, lane * PITCH)
    else:
        r0, r1, r2, r3 = ldmatrix_x4(smem, lane * PITCH)
    out[lane, 0] = r0
    out[lane, 1] = r1
    out[lane, 2] = r2
    out[lane, 3] = r3


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_x4(trans: bool):
    rng = np.random.default_rng(2)
    m = rng.standard_normal((32, 8)).astype(np.float16)  # 4 matrices of 8 x 8, stacked
    words = _words(m)  # (32, 4)
    out = cuda.to_device(np.zeros((32, 4), np.int32))
    _ldmatrix_kernel[1, 32](cuda.to_device(words), int(trans), out)
    got = out.copy_to_host().view(np.float16).reshape(32, 4, 2)  # lane, register, half
    g, t = np.arange(32) >> 2, np.arange(32) & 3
    for i in range(4):
        mat = m[8 * i : 8 * i + 8]
        if trans:  # register i: matrix i's column g, rows 2t and 2t + 1
            want = np.stack([mat[2 * t, g], mat[2 * t + 1, g]], axis=1)
        else:  # register i: matrix i's row g, elements 2t and 2t + 1
            want = np.stack([mat[g, 2 * t], mat[g, 2 * t + 1]], axis=1)
        np.testing.assert_array_equal(got[:, i], want)


@cuda.jit
def _copy_kernel(src, rows_ok, out):  # noqa: ANN001, ANN202
    # thread i copies 16 bytes of row i of src (n, 8) float16, or zeros where rows_ok[i] == 0,
    # through cp.async into shared memory; then packs two floats and stores 4 words by sts128
    smem = cuda.shared.array(64, int32)  # (16 rows, 4 words)
    i = cuda.threadIdx.x
    ok = rows_ok[i] != 0
    cp_async16(smem, 4 * i, src, i if ok else 0, 0, 16 if ok else 0)
    cp_async_commit()
    cp_async_wait_all()
    cuda.syncthreads()  # every thread's copy has landed
    for e in range(4):
        out[i, e] = smem[4 * i + e]
    cuda.syncthreads()  # all reads done before sts128 overwrites
    sts128(smem, 4 * ((i + 1) % 16), pack_f16x2(float(i), -0.5), i, 2 * i, -i)
    cuda.syncthreads()  # the stores are visible
    for e in range(4):
        out[16 + i, e] = smem[4 * ((i + 1) % 16) + e]


def test_cp_async16_sts128_pack_f16x2():
    rng = np.random.default_rng(3)
    src = rng.standard_normal((16, 8)).astype(np.float16)
    rows_ok = (rng.random(16) < 0.7).astype(np.int32)
    out = cuda.to_device(np.full((32, 4), 7, np.int32))
    _copy_kernel[1, 16](cuda.to_device(src), cuda.to_device(rows_ok), out)
    got = out.copy_to_host()
    want = np.where(rows_ok[:, None] != 0, _words(src), 0)
    np.testing.assert_array_equal(got[:16], want)
    i = np.arange(16)
    np.testing.assert_array_equal(got[16:, 0], _words(np.stack([i, np.full(16, -0.5)], axis=1))[:, 0])
    np.testing.assert_array_equal(got[16:, 1:], np.stack([i, 2 * i, -i], axis=1))


def test_pack_f16x2_rounds_to_nearest_even():
    @cuda.jit
    def pack(v, out):  # noqa: ANN001, ANN202
        i = cuda.threadIdx.x
        out[i] = pack_f16x2(v[2 * i], v[2 * i + 1])

    # 1 + 2**-11 is halfway between fp16 1 and 1 + 2**-10: ties to even (1); 1 + 3 * 2**-11 -> 1 + 2**-9
    v = np.array([1 + 2**-11, 1 + 3 * 2**-11, 60000.5, -3.25e-6, 0.1, -0.2], np.float32)
    out = cuda.to_device(np.zeros(3, np.int32))
    pack[1, 3](cuda.to_device(v), out)
    np.testing.assert_array_equal(out.copy_to_host(), _words(v.astype(np.float16)))


@cuda.jit
def _ldg64_kernel(src, out):  # noqa: ANN001, ANN202
    i = cuda.threadIdx.x
    lo, hi = ldg64(src, i, 8)
    out[i, 0] = lo
    out[i, 1] = hi


def test_ldg64():
    src = np.random.default_rng(4).integers(0, 256, (4, 24), dtype=np.uint8)
    out = cuda.to_device(np.zeros((4, 2), np.int32))
    _ldg64_kernel[1, 4](cuda.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), np.ascontiguousarray(src[:, 8:16]).view(np.int32))
