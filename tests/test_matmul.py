"""matmul (plain / residual / gate) against pycalm.cpu.reference's matmul_ref, matmul_residual_ref and
matmul_gate_ref, every weight dtype, at shapes that are not multiples of the tile.

Tolerance: X and the decoded weights are fp16, so the tensor cores' products are exact and the
kernel differs from the reference only in the order and rounding of the float32 sums: 1e-5 of
the |X| |W|^T sum covers that for these lengths. The gate's fp16 output may further differ by
one fp16 rounding (2**-11 relative) where the two float32 results straddle a rounding point.
q8's codes are exact in fp16 and its row scale multiplies the float32 sums (one more rounding);
a q4 weight d q + m enters the tensor cores rounded to fp16 (pycalm.kernels.matmul), so its
reference is matmul_ref over those fp16 weights (formats.decode, then fp16_encode), checked at
the same 1e-5; a second check bounds the distance to the float32 weights' product by the fp16
rounding, 2**-11 of |X| |W|^T.
"""

import functools

import numpy as np
import pytest
from device_weights import to_device
from gpu import GPU, gpu_only
from numba import cuda

from pycalm.cpu.reference import matmul_gate_ref, matmul_ref, matmul_residual_ref
from pycalm.kernels.matmul import (
    MID_TILE,
    ROW_TILE,
    SIM_TILE,
    TILE,
    Tile,
    matmul,
    matmul_split_scratch,
    splits_for,
)
from pycalm.kernels.panel import UNIT, panel_matmul, panel_scratch, rows_a_block, split_count
from pycalm.kernels.skinny import MAX_ROWS, skinny_matmul
from pycalm.kernels.wgmma_matmul import takes, wgmma_matmul
from pycalm.model import formats

DTYPES = ["fp16", "fp8", "gf4"]
MODES = ["plain", "residual", "gate"]
# (T, N, K): T = 1; T and N not multiples of the tile (SIM_TILE 32 x 32, gate: 16 outputs a
# block), K = 8 x odd (a partial last step of 32)
SHAPES = [(19, 40, 40), (1, 21, 24)]
if GPU:
    SHAPES += [(200, 1000, 4104), (1, 4099, 1032), (517, 333, 2056)]
# q8 (K a multiple of 16: 48 ends in half a step) and q4 with groups of 32 (K = 96: three
# groups, not a multiple of 64) and 64 (K = 128: two groups), each once with T = 1
QUANTIZED = [("q8", 32, 19, 40, 48), ("q8", 32, 1, 21, 16), ("q4", 32, 19, 40, 96), ("q4", 64, 1, 21, 128)]
if GPU:
    QUANTIZED += [("q8", 32, 517, 333, 2064), ("q4", 32, 200, 1000, 4128), ("q4", 64, 1, 4099, 1024)]
RTOL = 1e-5


def _inputs(rng, t_rows, n, k, dtype, scale=0.5, group=32):
    x = formats.fp16_encode(rng.standard_normal((t_rows, k)) * scale)
    w = formats.encode(rng.standard_normal((n, k)).astype(np.float32), dtype, group=group)
    return x, w


def _decoded(w, dtype):
    """The weights as the tensor cores take them: fp16 (a q4 weight rounded to it, the others
    exact; q8's codes times the row scale: float32, the scale being applied to the sums)."""
    if dtype == "q4":
        return formats.fp16_encode(formats.decode(w, dtype)), "fp16"
    return w, dtype


def _sum_scale(x, w, dtype):
    """|X| |W|^T: what the float32 rounding of the sums is relative to."""
    return np.abs(x.astype(np.float64)) @ np.abs(formats.decode(w, dtype).astype(np.float64)).T


def _check(got, want, scale):
    assert np.all(np.isfinite(got)), "unwritten or non-finite outputs"
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= RTOL * scale + 1e-30), f"max err / scale {np.max(err / scale):.3g}"


def _run(mode, x, w, dtype, out, w3=None, tile=None, scratch=None):
    """The kernel's out: matmul with `tile` (K split over blocks with a scratch), or the skinny
    kernel for tile="skinny", the panel kernel for tile="panel" (its scratch), or wgmma_matmul's
    for tile="wgmma"."""
    d_out = cuda.to_device(out)
    stream = cuda.default_stream()
    w3 = None if w3 is None else to_device(w3)
    if tile == "skinny":
        skinny_matmul(cuda.to_device(x), to_device(w), d_out, dtype, stream=stream, mode=mode, w3=w3)
    elif tile == "panel":
        panel_matmul(
            cuda.to_device(x), to_device(w), d_out, dtype, stream=stream, mode=mode, w3=w3, scratch=scratch
        )
    elif tile == "wgmma":
        wgmma_matmul(cuda.to_device(x), to_device(w), d_out, dtype, stream=stream, mode=mode, w3=w3)
    else:
        args = (cuda.to_device(x), to_device(w), d_out, dtype)
        matmul(*args, stream=stream, mode=mode, w3=w3, tile=tile, scratch=scratch)
    stream.synchronize()
    return d_out.copy_to_host()


def _test(mode, dtype, t_rows, n, k, tile=None, seed=0, group=32, scratch=None):
    rng = np.random.default_rng(seed)
    x, w = _inputs(rng, t_rows, n, k, dtype, group=group)
    scale = _sum_scale(x, w, dtype)
    wt, dt = _decoded(w, dtype)  # the reference's weights: what the tensor cores multiply
    if mode == "plain":
        got = _run(mode, x, w, dtype, np.full((t_rows, n), np.nan, np.float32), tile=tile, scratch=scratch)
        _check(got, matmul_ref(x, wt, dt), scale)
        if dt != dtype:  # the fp16 rounding of the weights, against their float32 values
            _check(got, matmul_ref(x, w, dtype), (RTOL + 2.0**-11) * scale / RTOL)
    elif mode == "residual":
        r0 = rng.standard_normal((t_rows, n)).astype(np.float32)
        got = _run(mode, x, w, dtype, r0.copy(), tile=tile, scratch=scratch)
        _check(got, matmul_residual_ref(x, wt, dt, r0), scale + np.abs(r0))
    else:
        _, w3 = _inputs(rng, t_rows, n, k, dtype, group=group)
        got = _run(
            mode, x, w, dtype, np.full((t_rows, n), np.nan, np.float16), w3=w3, tile=tile, scratch=scratch
        )
        _check_gate(got, x, w, w3, dtype)


def _check_gate(got: np.ndarray, x: np.ndarray, w: object, w3: object, dtype: str, scale=None) -> None:
    """got, fp16 silu(X W^T) * (X W3^T), against matmul_gate_ref on the decoded weights (with
    each row's scale, where given)."""
    wt, dt = _decoded(w, dtype)
    w3t, _ = _decoded(w3, dtype)
    want = matmul_gate_ref(x, wt, w3t, dt, scale=scale)
    assert got.dtype == np.float16 and np.all(np.isfinite(got))
    a, b = matmul_ref(x, wt, dt, scale), matmul_ref(x, w3t, dt, scale)
    s = 1.0 if scale is None else np.abs(scale)[:, None]
    da, db = RTOL * _sum_scale(x, w, dtype) * s, RTOL * _sum_scale(x, w3, dtype) * s
    # one fp16 rounding of the result each side, and the sums' float32 error through the gate
    # (|silu'| <= 1.1, |silu(a)| <= |a| + 0.28), plus fp16's smallest subnormal
    tol = 2.0**-10 * np.abs(want) + 1.1 * np.abs(b) * da + (np.abs(a) + 0.28) * db + 2.0**-24
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.all(err <= tol), f"max err / tol {np.max(err / tol):.3g}"


@pytest.mark.parametrize("t_rows,n,k", SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul(dtype, mode, t_rows, n, k):
    _test(mode, dtype, t_rows, n, k)


@pytest.mark.parametrize("dtype,group,t_rows,n,k", QUANTIZED)
@pytest.mark.parametrize("mode", MODES)
def test_matmul_quantized(dtype, group, mode, t_rows, n, k):
    _test(mode, dtype, t_rows, n, k, group=group, seed=3)


# pycalm.kernels.wgmma_matmul (Hopper): under the simulator its small tile (T = 70: a partial second
# row tile; N = 120: a partial last W tile, the gate's of 32 outputs 4; K = 192: three steps,
# more than the ring's stages) in each format, fp16 (TMA) in every mode; on the GPU every format
# and mode at a prompt's row count (T = 1,100: a partial ninth row tile;
# K = 1088: 17 steps)
WGMMA_CASES = [("fp16", m) for m in MODES] + [
    ("fp8", "plain"),
    ("gf4", "gate"),
    ("q8", "gate"),
    ("q4", "residual"),
]
if GPU:
    WGMMA_CASES = [(d, m) for d in ("fp16", "fp8", "gf4", "q8", "q4") for m in MODES]


@pytest.mark.parametrize("dtype,mode", WGMMA_CASES)
def test_wgmma_matmul(dtype, mode):
    if GPU:  # a prompt's pass, which the prompt pass sends to wgmma_matmul (an H100 / H200)
        assert takes(1100, 1088, dtype), (
            "the prompt pass would not send a 1,100-row pass to wgmma_matmul here"
        )
        _test(mode, dtype, 1100, 520, 1088, tile="wgmma", seed=5, group=64 if mode == "gate" else 32)
    else:
        _test(mode, dtype, 70, 120, 192, tile="wgmma", seed=5)


@pytest.mark.parametrize("tile", [Tile(32, 64, 2, 2), Tile(32, 64, 1, 2)], ids=["2units", "4units"])
@pytest.mark.parametrize("dtype,group", [("q8", 32), ("q4", 64)])
def test_matmul_quantized_tiles(dtype, group, tile):
    # a thread's units of a W row-step: SIM_TILE 1; 2 as in the engine's TILE (q8: one 16-byte
    # load, q4: one of 8 bytes); 4 (q8: two 16-byte loads, q4: one). K = 80 / 128: a q8 step
    # half past K
    _test("gate", dtype, 19, 40, 80 if dtype == "q8" else 128, tile=tile, seed=4, group=group)


@pytest.mark.parametrize("dtype,group", [("fp16", 32), ("fp8", 32), ("gf4", 32), ("q8", 32), ("q4", 64)])
def test_matmul_rows_do_not_depend_on_the_tile(dtype, group):
    """Passes of at most 16 rows take ROW_TILE, longer ones the larger tile: the same rows give
    the same bits in either (plain and gate, odd N, K not a multiple of the tile's step), so a
    row's result does not depend on the pass it is in (batch-invariant decoding rests on it)."""
    rng = np.random.default_rng(7)
    k = 128 if dtype == "q4" else 80
    x, w = _inputs(rng, 5, 37, k, dtype, group=group)
    _, w3 = _inputs(rng, 5, 37, k, dtype, group=group)
    big = TILE if GPU else SIM_TILE
    for mode, out, gate in (("plain", np.float32, None), ("gate", np.float16, w3)):
        rows = _run(mode, x, w, dtype, np.full((5, 37), np.nan, out), w3=gate, tile=ROW_TILE)
        assert np.all(np.isfinite(rows))
        assert np.array_equal(rows, _run(mode, x, w, dtype, np.full((5, 37), np.nan, out), w3=gate, tile=big))


def test_matmul_default_tile():
    # the engine's tile (128 x 128, 8 warps of 64 x 32) under the simulator too: one block
    _test("residual", "gf4", 70, 100, 56, tile=TILE, seed=1)


@gpu_only("the small tile is what the simulator runs already")
@pytest.mark.parametrize("mode", MODES)
def test_matmul_small_tile_on_gpu(mode):
    _test(mode, "gf4", 45, 77, 264, tile=SIM_TILE, seed=2)


def test_matmul_rejects_bad_shapes():
    from pycalm.errors import PycalmError

    x = cuda.to_device(np.zeros((2, 12), np.float16))
    w = cuda.to_device(np.zeros((4, 12), np.float16))
    out = cuda.to_device(np.zeros((2, 4), np.float32))
    with pytest.raises(PycalmError, match="multiple of 8"):
        matmul(x, w, out, "fp16", stream=cuda.default_stream())
    with pytest.raises(PycalmError, match="w3"):
        matmul(x, w, out, "fp16", stream=cuda.default_stream(), mode="gate")
    x16 = cuda.to_device(np.zeros((2, 16), np.float16))
    with pytest.raises(PycalmError, match="divide"):
        matmul(x16, w, out, "fp16", stream=cuda.default_stream(), tile=Tile(32, 32, 2, 4))
    with pytest.raises(PycalmError, match="Quantized"):
        matmul(x16, w, out, "q8", stream=cuda.default_stream())
    x24 = cuda.to_device(np.zeros((2, 24), np.float16))
    q8 = formats.Quantized(cuda.to_device(np.zeros((4, 24), np.int8)), cuda.to_device(np.ones(4, np.float32)))
    with pytest.raises(PycalmError, match="K = 24 does not fit"):  # q8: 16-byte rows
        matmul(x24, q8, out, "q8", stream=cuda.default_stream())
    x64 = cuda.to_device(np.zeros((2, 64), np.float16))
    q4 = formats.Quantized(
        cuda.to_device(np.zeros((4, 8), np.uint32)), cuda.to_device(np.ones((4, 4, 2), np.float16))
    )
    with pytest.raises(PycalmError, match="K = 64 does not fit"):  # groups of 16: two a step
        matmul(x64, q4, out, "q4", stream=cuda.default_stream())


# ---------------------------------------------------------------------------------------------
# the skinny kernel (pycalm.kernels.skinny): the same products for T <= 64, against the same
# references at the same tolerances. (T, N, K) per dtype: K a multiple of its 16-byte unit (fp16
# 8, fp8 / q8 16, gf4 / q4 32 columns) and not of a step (4 units); T = 1, T in the second, the
# fourth (two A tiles, and q4's and gf4's X loaded ahead: skinny.X_AHEAD) and the eighth n-tile;
# N odd (a partial tile of 16, or of 8 for the gate)
SKINNY_K = {"fp16": 40, "fp8": 48, "gf4": 96, "q8": 48, "q4": 96}
SKINNY_SHAPES = [(1, 21), (13, 37), (27, 21), (41, 19)]
if GPU:
    SKINNY_SHAPES += [(8, 4099), (64, 1000), (29, 333)]


@pytest.mark.parametrize("t_rows,n", SKINNY_SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["fp16", "fp8", "gf4", "q8", "q4"])
def test_skinny(dtype, mode, t_rows, n):
    k = SKINNY_K[dtype] * (103 if GPU else 1)  # on the GPU: 4,120 to 9,888 columns
    _test(mode, dtype, t_rows, n, k, tile="skinny", seed=5)


def test_skinny_q4_groups_of_64():
    _test("gate", "q4", 9, 21, 192, tile="skinny", seed=6, group=64)


# the decoders' three kinds: as loaded (fp16), by prmt (fp8), by half2 arithmetic (q4, groups of 64)
@pytest.mark.parametrize("dtype,group", [("fp16", 32), ("fp8", 32), ("q4", 64)])
def test_skinny_rows_do_not_depend_on_the_pass(dtype, group):
    """A row's outputs are the same bits in a pass of 1 row, of 5, of 13 and of 40 (1, 2 and 8
    n-tiles), at any place in the pass: batch-invariant decoding rests on it."""
    rng = np.random.default_rng(8)
    k = SKINNY_K[dtype] * 2
    x, w = _inputs(rng, 40, 21, k, dtype, group=group)
    _, w3 = _inputs(rng, 40, 21, k, dtype, group=group)
    for mode, out, gate in (("residual", np.float32, None), ("gate", np.float16, w3)):
        full = _run(mode, x, w, dtype, np.ones((40, 21), out), w3=gate, tile="skinny")
        assert np.all(np.isfinite(full))
        for rows in (slice(3, 4), slice(0, 5), slice(27, 40)):
            part = _run(
                mode, x[rows], w, dtype, np.ones((rows.stop - rows.start, 21), out), w3=gate, tile="skinny"
            )
            assert np.array_equal(part, full[rows]), (mode, rows)


def _skinny_shapes(dtype: str, mode: str, t_rows: int, k: int, seed: int, shapes: list) -> tuple:
    """skinny's outputs for block shapes (row_tiles, x_words) on one random problem (N =
    37, gate 21 outputs: partial last blocks), each from the same out; and that out."""
    from pycalm.kernels import skinny

    rng = np.random.default_rng(seed)
    n = 21 if mode == "gate" else 37
    x, w = _inputs(rng, t_rows, n, k, dtype)
    _, w3 = _inputs(rng, t_rows, n, k, dtype)
    args = skinny.stored_args(to_device(w), to_device(w3) if mode == "gate" else None, dtype, k)
    x_words = cuda.to_device(x).view(np.uint32)
    r0 = rng.standard_normal((t_rows, n)).astype(np.float16 if mode == "gate" else np.float32)
    outs = []
    for row_tiles, ahead in shapes:
        kernel = skinny.make_skinny_kernel(dtype, skinny.MODES[mode], skinny.n_tiles_for(t_rows), skinny.WARPS,
                                           skinny.UNROLL, 0, row_tiles, ahead)  # fmt: skip
        out = cuda.to_device(r0)
        kernel[skinny.blocks_for(n, mode, row_tiles), 32 * skinny.WARPS](x_words, *args, out)
        outs.append(out.copy_to_host())
    assert np.all(np.isfinite(outs[0])) and not np.array_equal(outs[0], r0)
    return outs, r0


@pytest.mark.parametrize(
    "dtype,mode,t_rows",
    [("fp16", "residual", 13), ("q8", "gate", 41), ("q4", "plain", 9), ("gf4", "gate", 27)],
)
def test_skinny_row_tiles(dtype, mode, t_rows):
    """Warps of 2 and 3 A tiles (a partial last block at N = 37, gate 21 outputs: past its
    third of 8) give one A tile's bits: each output's sum takes the same steps in the same order."""
    outs, _ = _skinny_shapes(dtype, mode, t_rows, SKINNY_K[dtype] * 2, 9, [(1, 0), (2, 0), (3, 0)])
    assert np.array_equal(outs[1], outs[0]) and np.array_equal(outs[2], outs[0])


@pytest.mark.parametrize("dtype,mode,t_rows", [("q4", "gate", 27), ("gf4", "residual", 19)])
def test_skinny_x_loaded_ahead(dtype, mode, t_rows):
    """X loaded with a chunk's weights (x_words 64: all four n-tiles' 16 words a lane, which
    X_WORDS_AHEAD loads where they are used) gives the same bits: only the loads move, and the
    tail chunk's checked loads still give zeros past K (K = 4.5 steps)."""
    outs, _ = _skinny_shapes(dtype, mode, t_rows, SKINNY_K[dtype] * 6, 12, [(2, 0), (2, 64)])
    assert np.array_equal(outs[1], outs[0])


@pytest.mark.parametrize("mode", ["residual", "gate"])
def test_skinny_adds_the_warps_sums_in_parts(mode):
    """Blocks of 16 warps at 8 n-tiles (the 8B shape's w2, K > LONG_K, in passes of 33 to 64
    rows) would take 64 KiB of static shared memory for the warps' sums of a tile, past the 48
    KiB a kernel may: they add them in two parts of 4 n-tiles (the gate's W1 and W3 sums in one).
    The outputs are the reference's, as at any block shape."""
    from pycalm.kernels import skinny

    warps, t_rows, n, k = 16, 41, 21 if mode == "gate" else 19, 512  # 16 steps of 32 columns
    kernel = skinny.make_skinny_kernel("fp16", skinny.MODES[mode], 8, warps, skinny.UNROLL, 0, 2)
    rng = np.random.default_rng(10)
    x, w = _inputs(rng, t_rows, n, k, "fp16")
    _, w3 = _inputs(rng, t_rows, n, k, "fp16")
    args = skinny.stored_args(to_device(w), to_device(w3) if mode == "gate" else None, "fp16", k)
    r0 = rng.standard_normal((t_rows, n)).astype(np.float16 if mode == "gate" else np.float32)
    out = cuda.to_device(r0)
    kernel[skinny.blocks_for(n, mode, 2), 32 * warps](cuda.to_device(x).view(np.uint32), *args, out)
    got = out.copy_to_host()
    if mode == "residual":
        _check(got, matmul_residual_ref(x, w, "fp16", r0), _sum_scale(x, w, "fp16") + np.abs(r0))
    else:
        _check_gate(got, x, w, w3, "fp16")


# the next RMSNorm folded into the residual products of a rows pass (skinny.NormFold), and the
# products after it scaled: (dtype, T, N, K), N the next product's K (a whole number of its
# units: fp16's 40 ends in half a 16-column tile), T in the first, second, fourth and eighth
# n-tile, 2 or 3 blocks (the last one adds the slots)
FOLD_CASES = [("fp16", 1, 40, 40), ("q8", 13, 48, 48), ("q4", 27, 96, 96), ("gf4", 41, 32, 96)]
if GPU:
    FOLD_CASES += [("fp16", 8, 4096, 4096), ("q4", 64, 1536, 8960)]


def _products(tile):
    """skinny_matmul, or panel_matmul on a scratch of its own (tile "panel")."""
    if tile == "skinny":
        return skinny_matmul
    return functools.partial(panel_matmul, scratch=panel_scratch())


def _fold(x, w, dtype, r0, norm_w, rho, eps=1e-5, tile="skinny"):
    """skinny's (or the panel's) residual launch with the next norm folded in: (out, xb, rms,
    scale), host copies."""
    from pycalm.kernels.skinny import NormFold, slot_count

    t_rows, n = r0.shape
    d = {
        name: cuda.to_device(np.full(shape, np.nan, np.float32))
        for name, shape in (("rms", t_rows), ("scale", t_rows))
    }
    fold = NormFold(
        w=cuda.to_device(norm_w), rho=cuda.to_device(rho), xb=cuda.to_device(np.full((t_rows, n), np.nan, np.float16)),
        slots=cuda.to_device(np.full((t_rows, slot_count(n)), np.nan, np.float32)),
        counter=cuda.to_device(np.zeros(1, np.int32)), rms=d["rms"], scale=d["scale"], eps=eps,
    )  # fmt: skip
    out = cuda.to_device(r0)
    stream = cuda.default_stream()
    _products(tile)(cuda.to_device(x), to_device(w), out, dtype, stream=stream, mode="residual", fold=fold)
    stream.synchronize()
    assert fold.counter.copy_to_host()[0] == 0, "the last block resets the counter"
    return out.copy_to_host(), fold.xb.copy_to_host(), fold.rms.copy_to_host(), fold.scale.copy_to_host()


@pytest.mark.parametrize("tile", ["skinny", "panel"])
@pytest.mark.parametrize("dtype,t_rows,n,k", FOLD_CASES)
def test_folds_the_next_norm(dtype, t_rows, n, k, tile):
    """skinny's and the panel's residual product with the next RMSNorm folded in: out as matmul_residual_ref's; xb
    is fp16(out w rho) of that out, bit for bit; rms and scale = rms / rho as
    matmul_residual_fold_ref's; a second launch gives the same bits (the counter is reset). Then
    the next products, plain and gate, scaled by each row's scale: within the fp16 rounding of
    xb of the products of rmsnorm(out) w, the unfolded pass's input."""
    from pycalm.cpu.reference import matmul_residual_fold_ref, rmsnorm_rows_ref

    rng = np.random.default_rng(11)
    x, w = _inputs(rng, t_rows, n, k, dtype)
    wt, dt = _decoded(w, dtype)
    r0 = (rng.standard_normal((t_rows, n)) * np.exp(rng.uniform(-4, 4, (t_rows, 1)))).astype(np.float32)
    norm_w = rng.uniform(0.5, 2.0, n).astype(np.float32)
    rho = np.exp(rng.uniform(-3, 3, t_rows)).astype(np.float32)  # (T,) the last norm's rms
    out, xb, rms, scale = _fold(x, w, dtype, r0, norm_w, rho, tile=tile)
    _check(out, matmul_residual_ref(x, wt, dt, r0), _sum_scale(x, w, dtype) + np.abs(r0))
    assert np.array_equal(xb, formats.fp16_encode(out * norm_w * rho[:, None]))
    _, _, want_rms, want_scale = matmul_residual_fold_ref(x, wt, dt, r0, norm_w, rho, 1e-5)
    np.testing.assert_allclose(rms, want_rms, rtol=2e-5)
    np.testing.assert_allclose(scale, want_scale, rtol=2e-5)
    again = _fold(x, w, dtype, r0, norm_w, rho, tile=tile)
    assert all(np.array_equal(a, b) for a, b in zip(again, (out, xb, rms, scale), strict=True))
    # the next products of xb, scaled, against those of the unfolded input rmsnorm(out) w
    k2 = SKINNY_K[dtype]
    _, w2 = _inputs(rng, t_rows, k2, n, dtype)
    _, w3 = _inputs(rng, t_rows, k2, n, dtype)
    d_scale = cuda.to_device(scale)
    stream = cuda.default_stream()
    plain = cuda.to_device(np.full((t_rows, k2), np.nan, np.float32))
    product = _products(tile)
    product(cuda.to_device(xb), to_device(w2), plain, dtype, stream=stream, scale=d_scale)
    gate = cuda.to_device(np.full((t_rows, k2), np.nan, np.float16))
    product(cuda.to_device(xb), to_device(w2), gate, dtype, stream=stream, mode="gate", w3=to_device(w3),
            scale=d_scale)  # fmt: skip
    w2t, _ = _decoded(w2, dtype)
    _check(plain.copy_to_host(), matmul_ref(xb, w2t, dt, scale), _sum_scale(xb, w2, dtype) * scale[:, None])
    _check_gate(gate.copy_to_host(), xb, w2, w3, dtype, scale)
    unfolded = matmul_ref(rmsnorm_rows_ref(out, norm_w, 1e-5), w2t, dt)  # xb's fp16 rounding apart
    # both inputs' fp16 roundings (relative 2**-11 each; 2**-25 absolute where subnormal)
    tiny = _sum_scale(np.full_like(xb, 2.0**-24), w2, dtype)
    bound = ((2.0**-10 + 1e-5) * _sum_scale(xb, w2, dtype) + tiny) * scale[:, None]
    assert np.all(np.abs(plain.copy_to_host() - unfolded) <= bound)


def test_skinny_fold_rows_do_not_depend_on_the_pass():
    """A row's folded outputs (out, xb, rms, scale) are the same bits alone and in a pass of 40:
    its sums of squares take the same tiles and lanes in the same order."""
    rng = np.random.default_rng(12)
    x, w = _inputs(rng, 40, 37, 40, "fp16")
    r0 = rng.standard_normal((40, 37)).astype(np.float32)  # (N = 37: a partial third tile)
    norm_w = rng.uniform(0.5, 2.0, 37).astype(np.float32)
    rho = np.exp(rng.uniform(-1, 1, 40)).astype(np.float32)
    full = _fold(x, w, "fp16", r0, norm_w, rho)
    for rows in (slice(3, 4), slice(27, 40)):
        part = _fold(x[rows], w, "fp16", r0[rows], norm_w, rho[rows])
        assert all(np.array_equal(p, f[rows]) for p, f in zip(part, full, strict=True)), rows


def test_skinny_rejects_bad_shapes():
    from pycalm.errors import PycalmError

    s = cuda.default_stream()
    w = cuda.to_device(np.zeros((4, 40), np.float16))
    out = cuda.to_device(np.zeros((MAX_ROWS + 1, 4), np.float32))
    with pytest.raises(PycalmError, match="1 to 64 rows"):
        skinny_matmul(cuda.to_device(np.zeros((MAX_ROWS + 1, 40), np.float16)), w, out, "fp16", stream=s)
    with pytest.raises(PycalmError, match="multiple of 32 for gf4"):
        skinny_matmul(cuda.to_device(np.zeros((2, 40), np.float16)), cuda.to_device(np.zeros((4, 5), np.uint32)),
                      out, "gf4", stream=s)  # fmt: skip


# panel (the rows pass's q4 and q8 products at 33 to 64 rows): (T, N, K in units of 16 bytes a row). Under
# the simulator (blocks of 32 rows of W, 16 outputs for the gate; 2 "SMs") N past one block, and
# within one (K split over two blocks), K a step and a quarter (a last step past K in part); on
# the GPU a partial block, qkv's and w2's widths at the 8B shape (splits of K: 5 and 8)
PANEL_SHAPES = [(19, 40, 5), (37, 13, 5)]
if GPU:
    PANEL_SHAPES += [(64, 1000, 129), (33, 4099, 33), (50, 6144, 128), (64, 4096, 448)]


@pytest.mark.parametrize("t_rows,n,units", PANEL_SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype,group", [("fp16", 32), ("fp8", 32), ("gf4", 32), ("q8", 32), ("q4", 32), ("q4", 64)]
)
def test_panel(dtype, group, mode, t_rows, n, units):
    """The panel kernel against the reference, with and without K split over blocks; in residual
    mode twice on one scratch (the split counters reset for the next launch)."""
    k = units * UNIT[dtype]
    k = -(-k // group) * group if dtype == "q4" else k  # q4: whole groups
    scratch = panel_scratch()
    for seed in (5, 6) if mode == "residual" else (5,):
        _test(mode, dtype, t_rows, n, k, tile="panel", seed=seed, group=group, scratch=scratch)


def test_panel_splits_k_where_the_blocks_are_few():
    """K splits where the blocks leave SMs idle and not where they fill them: under the simulator
    at its shapes above; on the GPU at the 8B shape's qkv (6,144 outputs of 4,096) and w2 (4,096
    of 14,336), which split, and its gate pair (2 x 14,336 of 4,096), which fills the SMs."""
    if GPU:
        assert split_count(-(-6144 // rows_a_block("plain")), 4096, "q4") > 1
        assert split_count(-(-4096 // rows_a_block("plain")), 14336, "q8") > 1
        assert split_count(-(-14336 // rows_a_block("gate")), 4096, "q4") == 1
    else:
        assert split_count(-(-13 // rows_a_block("gate")), 5 * UNIT["q4"], "q4") > 1
        assert split_count(-(-40 // rows_a_block("plain")), 5 * UNIT["fp16"], "fp16") == 1


# split K: (dtype, q4 group, T, N, K, tile). Under the simulator one or two tiles of N over 7 to
# 9 steps of K, so a split takes 1 to 4 steps (SIM_TILE: 4 blocks a wave, ROW_TILE: 16), a last
# split with none where ceil(steps / splits) overshoots; on the GPU the engine's tiles at the
# 8B shape's widths
SPLITS = [("fp16", 32, 19, 20, 200, SIM_TILE), ("fp8", 32, 5, 40, 232, ROW_TILE), ("gf4", 32, 19, 20, 200, SIM_TILE),
          ("q8", 32, 5, 21, 240, ROW_TILE), ("q4", 64, 19, 20, 256, SIM_TILE)]  # fmt: skip
if GPU:  # (a split takes 8 steps at least there)
    SPLITS = [(d, 32, 37, 1000, 4104, MID_TILE) for d in DTYPES] + [("fp8", 32, 5, 40, 4104, ROW_TILE)]
    SPLITS += [("q8", 32, 64, 512, 14336, MID_TILE), ("q4", 32, 33, 4099, 4096, MID_TILE)]


@pytest.mark.parametrize("dtype,group,t_rows,n,k,tile", SPLITS)
@pytest.mark.parametrize("mode", MODES)
def test_matmul_split_k(dtype, group, t_rows, n, k, tile, mode):
    """K split over blocks (the splits' partial sums added by the last block of a tile, in split
    order): the reference's sums; in residual mode twice on one scratch (its counters reset for
    the next launch)."""
    scratch = matmul_split_scratch()
    out_n = tile.block_n // 2 if mode == "gate" else tile.block_n
    tiles = -(-t_rows // tile.block_m) * -(-n // out_n)
    assert splits_for(tile, tiles, k) > 1  # the case splits
    for seed in (5, 6) if mode == "residual" else (5,):
        _test(mode, dtype, t_rows, n, k, tile=tile, seed=seed, group=group, scratch=scratch)
