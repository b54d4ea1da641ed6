"""matvec / matvec_residual / ffn_gate kernels against their NumPy references, every weight dtype
(q4 in groups of 32 and of 64: "q4/64").

Tolerance: the kernels decode exactly and accumulate in float32 in a different order than the
reference, so each output may differ by a few float32 roundings of the row's |W| |x| sum;
1e-5 of that sum is well above the accumulation error for these lengths (at most ~16k terms).
q8 and q4 multiply x in 16-bit integers (pycalm.cpu.reference.x_int16_ref, summed exactly in int32
a load): they are held to the same tolerance against W times that x (matvec_x_ref), and
test_q_matvec_error_bound bounds their distance to W x by the rounding of x.
"""

import numpy as np
import pytest
from device_weights import to_device
from gpu import GPU
from numba import cuda

from pycalm.cpu.reference import X_GROUP, matvec_ref, matvec_x_ref, rmsnorm_ref, silu_ref, x_int16_ref
from pycalm.kernels.matvec import ffn_gate, matvec, matvec_residual
from pycalm.model import formats

DTYPES = ["fp16", "fp8", "gf4", "q8", "q4", "q4/64"]
# Rows of a multiple of 16 bytes take the 16-byte-load kernels (fp16 always; fp8 and q8 when cols
# is a multiple of 16, gf4 of 32; q4 always), other rows the narrow fallbacks: 72 and 136
# columns (fp8, q8, gf4 narrow), 144 (fp8, q8 wide, gf4 narrow), 256 (every dtype wide; 19 rows:
# the last row group is partial), and for q4 (whole groups) 96 (3 groups of 32) and 192 (3 of
# 64). Rows odd, so the last row group is partial.
SHAPES = [(40, 72), (37, 136), (5, 144), (19, 256), (5, 96), (37, 192)]
if GPU:
    SHAPES += [(4099, 4104), (1023, 14344), (4099, 4096), (1021, 14336)]
RTOL = 1e-5


def _fits(dtype, cols):
    """Whether a dtype stores rows of `cols` (q4: whole groups, and the fp16-era shapes for the rest)."""
    if dtype.startswith("q4"):
        return cols % (64 if dtype == "q4/64" else 32) == 0
    return cols not in (96, 192)  # the q4-only shapes


CASES = [(d, r, c) for d in DTYPES for r, c in SHAPES if _fits(d, c)]


def _weights(rng, rows, cols, dtype):
    """(stored weights, their float64 values); dtype "q4/64": q4 in groups of 64."""
    base, _, group = dtype.partition("/")
    w = formats.encode(rng.standard_normal((rows, cols)).astype(np.float32), base, group=int(group or 32))
    return w, formats.decode(w, base).astype(np.float64)


def _base(dtype):
    return dtype.partition("/")[0]


def _x(x, dtype):
    """The x a matvec of `dtype` multiplies, float64 (q8, q4: x in 16-bit integers)."""
    return matvec_x_ref(x, _base(dtype)).astype(np.float64)


def _check(got, want, scale):
    assert np.all(np.isfinite(got)), "unwritten or non-finite outputs"
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= RTOL * scale + 1e-30), f"max err / scale {np.max(err / scale):.3g}"


@pytest.mark.parametrize("dtype,rows,cols", CASES)
def test_matvec(dtype, rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    w, wd = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    y = cuda.to_device(np.full(rows, np.nan, np.float32))
    matvec(to_device(w), cuda.to_device(x), y, _base(dtype), stream=cuda.default_stream())
    cuda.synchronize()
    want = wd @ _x(x, dtype)
    _check(y.copy_to_host(), want, np.abs(wd) @ np.abs(x))
    # the NumPy reference agrees with the float64 product to the same tolerance
    _check(matvec_ref(w, x, _base(dtype)), want, np.abs(wd) @ np.abs(x))


def test_x_int16_ref():
    """x in 16-bit integers: a scale a group of X_GROUP columns (the last one shorter), |X| at
    most 32639 (two signed bytes), s X within s / 2 of x, a zero group all zero."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(2 * X_GROUP + 7) * np.logspace(-3, 3, 2 * X_GROUP + 7)).astype(np.float32)
    x[X_GROUP : 2 * X_GROUP] = 0
    xi, s = x_int16_ref(x)
    assert xi.dtype == np.int32 and s.shape == (3,)
    assert np.abs(xi).max() == 32639 and s[1] == 0 and np.all(xi[X_GROUP : 2 * X_GROUP] == 0)
    for g, (a, b) in enumerate([(0, X_GROUP), (X_GROUP, 2 * X_GROUP), (2 * X_GROUP, x.shape[0])]):
        assert s[g] == np.float32(np.abs(x[a:b]).max() / np.float32(32639))
        err = np.abs(xi[a:b] * np.float64(s[g]) - x[a:b])
        assert np.all(err <= 0.5001 * s[g])
        assert np.all((xi[a:b] >> 8) + ((xi[a:b] & 255) > 127) <= 127)  # h a signed byte


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_q_matvec_error_bound(dtype):
    """The q8 / q4 matvecs against W x with x exact: within the rounding of x, sum_k |w_k| s_k / 2
    (s_k: column k's group scale; 4.8e-5 of sum |w| |x| here), plus the float32 tolerance; on
    random x the roundings cancel and the error is within the float32 tolerance alone."""
    rows, cols = 19, 256
    rng = np.random.default_rng(12)
    w, wd = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    y = cuda.to_device(np.full(rows, np.nan, np.float32))
    matvec(to_device(w), cuda.to_device(x), y, dtype, stream=cuda.default_stream())
    cuda.synchronize()
    s = np.repeat(x_int16_ref(x)[1].astype(np.float64), X_GROUP)[:cols]
    bound = np.abs(wd) @ (s / 2)
    scale = np.abs(wd) @ np.abs(x)
    err = np.abs(y.copy_to_host() - wd @ x.astype(np.float64))
    assert np.all(err <= bound + RTOL * scale)
    assert np.all(err <= RTOL * scale)  # on random x the roundings cancel: 3.3e-6 of it measured


@pytest.mark.parametrize("dtype", DTYPES)
def test_matvec_fused_norm(dtype):
    rows, cols, eps = 37, 192 if dtype.startswith("q4") else 144, 1e-5
    rng = np.random.default_rng(7)
    w, wd = _weights(rng, rows, cols, dtype)
    x = (3 * rng.standard_normal(cols)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    y = cuda.to_device(np.full(rows, np.nan, np.float32))
    matvec(
        to_device(w),
        cuda.to_device(x),
        y,
        _base(dtype),
        stream=cuda.default_stream(),
        norm_w=cuda.to_device(nw),
        eps=eps,
    )
    cuda.synchronize()
    xn = rmsnorm_ref(x, nw, eps)
    _check(y.copy_to_host(), wd @ _x(xn, dtype), np.abs(wd) @ np.abs(xn))


RESIDUAL_SHAPES = [(37, 136), (37, 192)]
if GPU:  # long rows: the default launch shares each row group by two warps (split_for)
    RESIDUAL_SHAPES += [(2047, 5632), (1021, 14336)]


@pytest.mark.parametrize(
    "dtype,rows,cols", [(d, r, c) for d in DTYPES for r, c in RESIDUAL_SHAPES if _fits(d, c)]
)
def test_matvec_residual(dtype, rows, cols):
    rng = np.random.default_rng(8)
    w, wd = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    r = cuda.to_device(r0)
    matvec_residual(to_device(w), cuda.to_device(x), r, _base(dtype), stream=cuda.default_stream())
    cuda.synchronize()
    _check(r.copy_to_host(), r0 + wd @ _x(x, dtype), np.abs(wd) @ np.abs(x) + np.abs(r0))


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
        to_device(w1), to_device(w3), cuda.to_device(x), h, _base(dtype),
        stream=cuda.default_stream(), norm_w=cuda.to_device(nw), eps=eps,
    )  # fmt: skip
    cuda.synchronize()
    xn = rmsnorm_ref(x, nw, eps).astype(np.float64)
    a, b = w1d @ _x(xn, dtype), w3d @ _x(xn, dtype)
    ta, tb = RTOL * (np.abs(w1d) @ np.abs(xn)), RTOL * (np.abs(w3d) @ np.abs(xn))
    want = silu_ref(a) * b
    got = h.copy_to_host().astype(np.float64)
    assert np.all(np.isfinite(got))
    # |d silu| <= 1.1 |da|: the gate's error from the two row errors
    tol = 1.1 * ta * (np.abs(b) + tb) + (np.abs(a) + ta) * tb + 1e-6 * np.abs(want)
    assert np.all(np.abs(got - want) <= tol)


@pytest.mark.parametrize("dtype", ["fp16", "gf4", "q8", "q4/64"])
def test_matvec_chunked_x(dtype):
    """Rows longer than XCHUNK columns: x is staged in several chunks (q4: the groups of the
    second chunk are found by the load's index in the whole row)."""
    from pycalm.kernels.matvec import XCHUNK

    rows, cols = 3, XCHUNK + (192 if dtype.startswith("q4") else 144)
    rng = np.random.default_rng(10)
    w, wd = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    r = cuda.to_device(r0)
    matvec_residual(to_device(w), cuda.to_device(x), r, _base(dtype), stream=cuda.default_stream())
    cuda.synchronize()
    _check(r.copy_to_host(), r0 + wd @ _x(x, dtype), np.abs(wd) @ np.abs(x) + np.abs(r0))


def _launch_kernel(kernel, dtype, wa, wb, x, norm_w, eps, out, mode, split):
    """matvec_kernel launched on its own (launch_matvec's arguments), whatever the split rule
    would choose for the shape: the split kernels at test sizes."""
    from pycalm.kernels.launch import row_group_launch
    from pycalm.kernels.matvec import GATE, ROWS, XCHUNK, codes_and_scales, load_bytes, word_view

    wa, sa = codes_and_scales(wa, dtype, x)
    wb, sb = codes_and_scales(wb, dtype, x)
    nbytes = load_bytes(wa, dtype)
    n_groups = -(-wa.shape[0] // (ROWS // 2 if mode == GATE else ROWS))
    args = (
        word_view(wa, nbytes), word_view(wb, nbytes), sa, sb, x, x.view(np.uint64), x if norm_w is None else norm_w,
        np.float32(eps), out, np.int32(mode), np.int32(norm_w is not None), x.view(np.int32), x, np.int32(0),
        np.int32(0),
    )  # fmt: skip
    blocks, threads = row_group_launch(kernel, args, n_groups, -(-x.shape[0] // XCHUNK), split)
    kernel[blocks, threads, cuda.default_stream()](*args)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if not d.startswith("q4")])
def test_matvec_split_kernel(dtype):
    """Row groups shared by 2 and 3 warps (split): residual, fused-norm and gate launches give
    the references' values; 13 rows, so a block's warps loop over several groups (the sums'
    buffer halves alternate) and the last group is partial. 1288 columns: 161 loads a row
    (fp16 wide, fp8 / q8 / gf4 narrow), so every part has whole steps, a partial one and, for
    some, none at the end. Not q4: split_for never splits it, and its split kernel's registers
    do not fit the 16 warps a split block has (on the H200: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)."""
    from pycalm.kernels.matvec import GATE, PLAIN, RESIDUAL, load_bytes, matvec_kernel

    rows, cols, eps = 13, 1288, 1e-5
    rng = np.random.default_rng(11)
    w, wd = _weights(rng, rows, cols, dtype)
    w3, w3d = _weights(rng, rows, cols, dtype)
    x = rng.standard_normal(cols).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    xn = rmsnorm_ref(x, nw, eps).astype(np.float64)
    wdev, w3dev, xdev, nwdev = to_device(w), to_device(w3), cuda.to_device(x), cuda.to_device(nw)
    dtype = _base(dtype)
    nbytes = load_bytes(wdev.codes if dtype in formats.QUANTIZED else wdev, dtype)
    for rows_a_warp, unroll, split in ((2, 2, 2), (2, 1, 3), (4, 2, 2)):
        kernel = matvec_kernel(dtype, nbytes, rows_a_warp, unroll if nbytes == 16 else 1, split)
        r = cuda.to_device(r0)
        _launch_kernel(kernel, dtype, wdev, wdev, xdev, None, 0.0, r, RESIDUAL, split)
        y = cuda.to_device(np.full(rows, np.nan, np.float32))
        _launch_kernel(kernel, dtype, wdev, wdev, xdev, nwdev, eps, y, PLAIN, split)
        cuda.synchronize()
        _check(r.copy_to_host(), r0 + wd @ _x(x, dtype), np.abs(wd) @ np.abs(x) + np.abs(r0))
        _check(y.copy_to_host(), wd @ _x(xn, dtype), np.abs(wd) @ np.abs(xn))
        if rows_a_warp == 2:  # (the launch's group count assumes ROWS rows a warp for GATE)
            h = cuda.to_device(np.full(rows, np.nan, np.float32))
            _launch_kernel(kernel, dtype, wdev, w3dev, xdev, nwdev, eps, h, GATE, split)
            cuda.synchronize()
            a, b = wd @ _x(xn, dtype), w3d @ _x(xn, dtype)
            want = a / (1 + np.exp(-a)) * b
            scale = (np.abs(wd) @ np.abs(xn)) * (np.abs(w3d) @ np.abs(xn)) + np.abs(want)
            _check(h.copy_to_host(), want, scale)


def test_split_for_takes_long_residual_rows():
    """Which launches share a row group by two warps: dense residual launches of fp8 rows of at
    least SPLIT_LOADS 16-byte loads a lane (w2), nothing else."""
    from pycalm.kernels.matvec import GATE, PLAIN, RESIDUAL, split_for

    def lanes(cols, dtype):  # 16-byte loads a lane a row
        return cols // {"fp16": 8, "fp8": 16, "gf4": 32, "q8": 16, "q4": 32}[dtype] // 32

    assert split_for("fp8", RESIDUAL, lanes(5632, "fp8"), False) == 2  # 11 loads a lane
    assert split_for("q8", RESIDUAL, lanes(5632, "q8"), False) == 2  # one byte a weight, as fp8
    assert split_for("q8", RESIDUAL, lanes(4096, "q8"), False) == 1
    assert split_for("q4", RESIDUAL, lanes(14336, "q4"), False) == 1
    assert split_for("fp8", RESIDUAL, lanes(4608, "fp8"), False) == 2  # 9
    assert split_for("fp8", RESIDUAL, lanes(4096, "fp8"), False) == 1  # 8
    assert split_for("fp16", RESIDUAL, lanes(14336, "fp16"), False) == 1
    assert split_for("fp8", RESIDUAL, lanes(2048, "fp8"), False) == 1  # wo: 4 loads a lane
    assert split_for("gf4", RESIDUAL, lanes(14336, "gf4"), False) == 1
    assert split_for("fp8", GATE, lanes(5632, "fp8"), False) == 1
    assert split_for("fp8", PLAIN, lanes(5632, "fp8"), False) == 1
    assert split_for("fp8", RESIDUAL, lanes(5632, "fp8"), True) == 1  # expert slots


def _resident(regs):
    """blocks an SM holds for a kernel of `regs` registers a thread (64k registers an SM)"""
    return lambda threads: 65536 // (threads * regs)


def test_launch_shape_rules():
    """Warps a block and blocks (pure arithmetic, 132 SMs): where every warp can take one row
    group, the block size that spreads the groups evenly (TinyLlama's qkv: 1280 groups -> 10
    warps, 128 blocks, not 8 warps in 160 blocks); a block that would not fit an SM (registers)
    is never chosen; the blocks keep every block resident and every warp at the same number of
    groups. (132 SMs: n_sm() under the simulator, and the H200's count on the GPU.)"""
    from pycalm.kernels.launch import balance_warps, blocks_for

    assert balance_warps(1280, _resident(56)) == (10, 1)  # 128 blocks of 10 warps, one group each
    assert balance_warps(1024, _resident(80))[0] == 8  # 128 blocks of 8 already even
    warps, per_warp = balance_warps(5632, _resident(96))
    assert per_warp > 1 and warps * 32 * 96 <= 65536  # several groups a warp; the block fits
    assert balance_warps(100, lambda threads: 0) == (16, 0)  # nothing fits: the default
    # 16 warps of 72 registers: one block an SM; 14336 groups -> 7 a warp, 128 blocks
    assert blocks_for(14336, 16, 1, _resident(72)(512)) == 128
    assert blocks_for(14336, 16, 1, _resident(64)(512)) == 224  # two blocks an SM: 4 a warp
    assert blocks_for(2048, 16, 2, 1) == 128  # split: 8 teams a block, 2 groups a team


def test_kernel_script_versions():
    """scripts/kernels/matvec.py (the benchmark's versions) imports and its check passes under
    the simulator for a few versions that are not the shipped kernel: prefetch, shift decoders
    with late loads, direct x, a split of 3 warps."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "matvec.py"
    spec = importlib.util.spec_from_file_location("kernels_matvec_script", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # (its dataclass looks its module up)
    spec.loader.exec_module(script)
    V = script.Version
    versions = [
        V(prefetch=True),
        V(cvt=False, early=False),
        V(direct=True, warps=8),
        V(unroll=1, split=3, warps=6),
    ]
    assert script.check(cuda.default_stream(), True, ["fp8"], versions)


def test_tensor_core_script_matches_reference():
    """scripts/kernels/matvec_tc.py (the q4 matvec on the tensor cores, an experiment) gives
    matvec_ref's rows within 1e-5 of sum |w| |x| under the simulator: rows not a multiple of the
    16-row tile, groups of 32 and 64, steps split over warps strided and contiguous (a warp with
    no step at all included)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "matvec_tc.py"
    spec = importlib.util.spec_from_file_location("kernels_matvec_tc_script", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    rng = np.random.default_rng(3)
    for rows, cols, group in ((37, 256, 32), (16, 384, 64)):
        for cfg in ((1, 2, 2, 1, 0), (2, 1, 1, 1, 0), (1, 3, 2, 1, 1)):
            assert script.check(rows, cols, group, cfg, rng) < 1e-5, (rows, cols, group, cfg)
