"""matvec / matvec_residual / ffn_gate kernels against their NumPy references, every weight dtype.

Tolerance: the kernels decode exactly and accumulate in float32 in a different order than the
reference, so each output may differ by a few float32 roundings of the row's |W| |x| sum;
1e-5 of that sum is well above the accumulation error for these lengths (at most ~16k terms).
"""

import os

import numpy as np
import pytest
from numba import cuda

from pycalm import formats
from pycalm.kernels.matvec import ffn_gate, matvec, matvec_ref, matvec_residual, silu_ref
from pycalm.kernels.norm import rmsnorm_ref

GPU = os.environ.get("PYCALM_TEST_GPU") == "1"
DTYPES = ["fp16", "fp8", "gf4"]
# Rows of a multiple of 16 bytes take the 16-byte-load kernels (fp16 always; fp8 when cols is a
# multiple of 16, gf4 of 32), other rows the narrow fallbacks: 72 and 136 columns (fp8, gf4
# narrow), 144 (fp8 wide, gf4 narrow), 256 (every dtype wide; 19 rows: gf4's groups of 4 rows
# end in a partial group). Rows odd, so the last row group is partial.
SHAPES = [(40, 72), (37, 136), (5, 144), (19, 256)]
if GPU:
    SHAPES += [(4099, 4104), (1023, 14344), (4099, 4096), (1021, 14336)]
RTOL = 1e-5


def _weights(rng, rows, cols, dtype):
    w = formats.encode(rng.standard_normal((rows, cols)).astype(np.float32), dtype)
    return w, formats.decode(w, dtype).astype(np.float64)


def _check(got, want, scale):
    assert np.all(np.isfinite(got)), "unwritten or non-finite outputs"
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= RTOL * scale + 1e-30), f"max err / scale {np.max(err / scale):.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_matvec(dtype, rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    w, wd = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    y = cuda.to_device(np.full(rows, np.nan, np.float32))
    n = matvec(cuda.to_device(w), cuda.to_device(x), y, dtype, stream=cuda.default_stream())
    cuda.synchronize()
    assert n == w.nbytes + x.nbytes + 4 * rows
    want = wd @ x.astype(np.float64)
    _check(y.copy_to_host(), want, np.abs(wd) @ np.abs(x))
    # the NumPy reference agrees with the float64 product to the same tolerance
    _check(matvec_ref(w, x, dtype), want, np.abs(wd) @ np.abs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matvec_fused_norm(dtype):
    rows, cols, eps = 37, 144, 1e-5
    rng = np.random.default_rng(7)
    w, wd = _weights(rng, rows, cols, dtype)
    x = (3 * rng.standard_normal(cols)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    y = cuda.to_device(np.full(rows, np.nan, np.float32))
    matvec(
        cuda.to_device(w),
        cuda.to_device(x),
        y,
        dtype,
        stream=cuda.default_stream(),
        norm_w=cuda.to_device(nw),
        eps=eps,
    )
    cuda.synchronize()
    xn = rmsnorm_ref(x, nw, eps).astype(np.float64)
    _check(y.copy_to_host(), wd @ xn, np.abs(wd) @ np.abs(xn))


RESIDUAL_SHAPES = [(37, 136)]
if GPU:  # long rows: the default launch shares each row group by two warps (split_rows)
    RESIDUAL_SHAPES += [(2047, 5632), (1021, 14336)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", RESIDUAL_SHAPES)
def test_matvec_residual(dtype, rows, cols):
    rng = np.random.default_rng(8)
    w, wd = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    r = cuda.to_device(r0)
    n = matvec_residual(cuda.to_device(w), cuda.to_device(x), r, dtype, stream=cuda.default_stream())
    cuda.synchronize()
    assert n == w.nbytes + x.nbytes + 8 * rows
    _check(r.copy_to_host(), r0 + wd @ x, np.abs(wd) @ np.abs(x) + np.abs(r0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ffn_gate(dtype):
    rows, cols, eps = 37, 256, 1e-6  # wide loads (gf4: 4 rows a warp, 2 of W1 and 2 of W3)
    rng = np.random.default_rng(9)
    w1, w1d = _weights(rng, rows, cols, dtype)
    w3, w3d = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    h = cuda.to_device(np.full(rows, np.nan, np.float32))
    ffn_gate(
        cuda.to_device(w1), cuda.to_device(w3), cuda.to_device(x), h, dtype,
        stream=cuda.default_stream(), norm_w=cuda.to_device(nw), eps=eps,
    )  # fmt: skip
    cuda.synchronize()
    xn = rmsnorm_ref(x, nw, eps).astype(np.float64)
    a, b = w1d @ xn, w3d @ xn
    ta, tb = RTOL * (np.abs(w1d) @ np.abs(xn)), RTOL * (np.abs(w3d) @ np.abs(xn))
    want = silu_ref(a) * b
    got = h.copy_to_host().astype(np.float64)
    assert np.all(np.isfinite(got))
    # |d silu| <= 1.1 |da|: the gate's error from the two row errors
    tol = 1.1 * ta * (np.abs(b) + tb) + (np.abs(a) + ta) * tb + 1e-6 * np.abs(want)
    assert np.all(np.abs(got - want) <= tol)


@pytest.mark.parametrize("dtype", ["fp16", "gf4"])
def test_matvec_chunked_x(dtype):
    """Rows longer than XCHUNK columns: x is staged in several chunks."""
    from pycalm.kernels.matvec import XCHUNK

    rows, cols = 3, XCHUNK + 144
    rng = np.random.default_rng(10)
    w, wd = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    r = cuda.to_device(r0)
    matvec_residual(cuda.to_device(w), cuda.to_device(x), r, dtype, stream=cuda.default_stream())
    cuda.synchronize()
    _check(r.copy_to_host(), r0 + wd @ x, np.abs(wd) @ np.abs(x) + np.abs(r0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(19, 256), (37, 136)])
def test_matvec_direct_variant(dtype, rows, cols):
    """The benchmark's direct-x variant (x read from global memory, no staging), R1, R2 and R4,
    and the staged R1 variant, as a residual launch: the same values as the default kernels."""
    from pycalm.kernels.matvec import RESIDUAL, Variant, launch_family

    rng = np.random.default_rng(rows + cols)
    w, wd = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    wdev, xdev = cuda.to_device(w), cuda.to_device(x)
    for v in (
        Variant(2, 2, n_warps=2, direct=True),
        Variant(4, 1, n_warps=2, direct=True),
        Variant(1, 4, n_warps=2, direct=True),
        Variant(1, 2, n_warps=2),
    ):
        r = cuda.to_device(r0)
        launch_family(
            wdev, wdev, xdev, None, 0.0, r, dtype, RESIDUAL, stream=cuda.default_stream(), variant=v
        )
        cuda.synchronize()
        _check(r.copy_to_host(), r0 + wd @ x, np.abs(wd) @ np.abs(x) + np.abs(r0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matvec_split_variant(dtype):
    """Row groups shared by 2 and 3 warps (split): residual, fused-norm and gate launches give
    the references' values; 13 rows, so a block's warps loop over several groups (the sums'
    buffer halves alternate) and the last group is partial. 1288 columns: 161 loads a row (fp16 wide, fp8 / gf4 narrow),
    so every part has whole steps, a partial one and, for some, none at the end."""
    from pycalm.kernels.matvec import GATE, PLAIN, RESIDUAL, Variant, launch_family

    rows, cols, eps = 13, 1288, 1e-5
    rng = np.random.default_rng(11)
    w, wd = _weights(rng, rows, cols, dtype)
    w3, w3d = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    xn = rmsnorm_ref(x, nw, eps).astype(np.float64)
    s = cuda.default_stream()
    wdev, w3dev, xdev, nwdev = cuda.to_device(w), cuda.to_device(w3), cuda.to_device(x), cuda.to_device(nw)
    for v in (
        Variant(2, 2, split=2),
        Variant(2, 1, n_warps=6, split=3),
        Variant(1, 2, split=2, prefetch=True),
    ):
        r = cuda.to_device(r0)
        launch_family(wdev, wdev, xdev, None, 0.0, r, dtype, RESIDUAL, stream=s, variant=v)
        y = cuda.to_device(np.full(rows, np.nan, np.float32))
        launch_family(wdev, wdev, xdev, nwdev, eps, y, dtype, PLAIN, stream=s, variant=v)
        h = cuda.to_device(np.full(rows, np.nan, np.float32))
        launch_family(wdev, w3dev, xdev, nwdev, eps, h, dtype, GATE, stream=s, variant=v)
        cuda.synchronize()
        _check(r.copy_to_host(), r0 + wd @ x, np.abs(wd) @ np.abs(x) + np.abs(r0))
        _check(y.copy_to_host(), wd @ xn, np.abs(wd) @ np.abs(xn))
        a, b = wd @ xn, w3d @ xn
        want = a / (1 + np.exp(-a)) * b
        scale = (np.abs(wd) @ np.abs(xn)) * (np.abs(w3d) @ np.abs(xn)) + np.abs(want)
        _check(h.copy_to_host(), want, scale)


def test_split_rows_takes_long_residual_rows():
    """Which default launches share a row group by two warps: dense residual launches of fp8
    rows of at least SPLIT_LOADS loads a lane (w2), nothing else."""
    from pycalm.kernels.matvec import GATE, PLAIN, RESIDUAL, Variant, split_rows

    v = Variant(2, 2, n_warps=8)
    assert split_rows(v, "fp8", RESIDUAL, 5632, 0) == v._replace(split=2, n_warps=16)  # 11 loads a lane
    assert split_rows(v, "fp8", RESIDUAL, 4608, 0).split == 2  # 9 loads a lane
    assert split_rows(v, "fp8", RESIDUAL, 4096, 0) == v  # 8
    assert split_rows(v, "fp16", RESIDUAL, 14336, 0) == v
    assert split_rows(v, "fp8", RESIDUAL, 2048, 0) == v  # wo: 4 loads a lane
    assert split_rows(v, "gf4", RESIDUAL, 14336, 0) == v
    assert split_rows(v, "fp8", GATE, 5632, 0) == v
    assert split_rows(v, "fp8", PLAIN, 5632, 0) == v
    assert split_rows(v, "fp8", RESIDUAL, 5632, 2) == v  # expert slots


def _resident(regs):
    """blocks an SM holds for a kernel of `regs` registers a thread (64k registers an SM)"""
    return lambda threads: 65536 // (threads * regs)


def test_launch_warps_balances_one_group_a_warp():
    """Warps a block (pure arithmetic, 132 SMs): where every warp can take one row group, the
    launch spreads the groups evenly (TinyLlama's qkv: 1280 groups -> 10 warps, 128 blocks, not
    fill_sms's 8 warps in 160 blocks); where warps take several groups it keeps fill_sms's rule;
    a block that would not fit an SM (registers) is never chosen; long rows keep the variant.
    (132 SMs: n_sm() under the simulator, and the H200's count on the GPU.)"""
    from pycalm.kernels.matvec import Variant, balance_warps, fill_sms, launch_warps

    v = Variant(2, 2, n_warps=16)
    res = _resident(56)
    got = launch_warps(1280, 2048, v, res)
    assert got.n_warps == 10  # 128 blocks of 10 warps, one group each
    assert launch_warps(1024, 2048, v, _resident(80)).n_warps == 8  # 128 blocks of 8 already even
    assert launch_warps(5632, 2048, v, _resident(80)) == fill_sms(5632, 2048, v)  # 3 groups a warp
    assert launch_warps(1280, 16384, v, res) == v  # rows of two x chunks: unchanged
    balanced, per_warp = balance_warps(5632, v, _resident(96))
    assert per_warp > 1 and balanced.n_warps * 32 * 96 <= 65536  # the block fits
    assert balance_warps(100, v, lambda threads: 0) == (v, 0)  # nothing fits: unchanged
