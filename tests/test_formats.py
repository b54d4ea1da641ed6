"""pycalm.model.formats: the weight number formats, bit for bit.

The fast fp8 encoder (integer arithmetic on float32 bits) is checked against the original
float64 definition kept here as the oracle (`fp8_encode_oracle`), on every float16, on random
float32 bit patterns, on exact rounding ties, subnormals and values past the largest e5m2.
"""

import numpy as np
import pytest

from pycalm.model import formats


def fp8_encode_oracle(x: np.ndarray) -> np.ndarray:
    """The e5m2 encoder as first written: round to nearest even in float64, saturating."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    _, e = np.frexp(ax)  # ax = m * 2**e, 0.5 <= m < 1
    exp = np.maximum(e - 1, -14)
    quantum = np.ldexp(1.0, exp - 2)
    y = np.rint(ax / quantum) * quantum
    y = np.minimum(np.where(np.isfinite(y), y, formats.FP8_MAX), formats.FP8_MAX)
    y = np.copysign(y, x)
    out = (y.astype(np.float16).view(np.uint16) >> 8).astype(np.uint8)
    out[np.isnan(x)] = 0x7F
    return out


ALL_BYTES = np.arange(256, dtype=np.uint8)
FINITE_BYTES = ALL_BYTES[(ALL_BYTES & 0x7C) != 0x7C]  # exponent field 31: inf and NaN
E5M2_VALUES = np.unique(np.abs(formats.fp8_decode(FINITE_BYTES)).astype(np.float64))  # 0 .. 57344


def _quiet_oracle(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return fp8_encode_oracle(x)


# ---------------------------------------------------------------------------------------------
# fp8 e5m2


def test_fp8_byte_round_trip():
    """decode -> encode is the identity on every finite byte (both zeros included)."""
    assert len(FINITE_BYTES) == 248
    np.testing.assert_array_equal(formats.fp8_encode(formats.fp8_decode(FINITE_BYTES)), FINITE_BYTES)
    # the byte is the top half of the fp16 with the same value
    want = (FINITE_BYTES.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(formats.fp8_decode(FINITE_BYTES), want)


def test_fp8_inf_saturates_nan_marked():
    inf = formats.fp8_decode(np.array([0x7C, 0xFC], np.uint8))
    assert np.isposinf(inf[0]) and np.isneginf(inf[1])
    np.testing.assert_array_equal(formats.fp8_encode(inf), [0x7B, 0xFB])
    nans = formats.fp8_decode(np.array([0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF], np.uint8))
    assert np.isnan(nans).all()
    assert (formats.fp8_encode(nans) == 0x7F).all()
    assert formats.fp8_encode(np.array([np.nan], np.float32))[0] == 0x7F


def test_fp8_largest_and_smallest():
    assert formats.fp8_decode(np.array([0x7B], np.uint8))[0] == formats.FP8_MAX == 57344.0
    assert formats.fp8_decode(np.array([0x01], np.uint8))[0] == 2.0**-16  # smallest subnormal
    assert formats.fp8_decode(np.array([0x04], np.uint8))[0] == 2.0**-14  # smallest normal


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fp8_saturation(dtype):
    x = np.array([57344, 59000, 61439, 61440, 65504, -61440, -65504], dtype)
    if dtype == np.float32:
        x = np.concatenate([x, np.array([1e6, -3.0e38, np.finfo(np.float32).max], np.float32)])
    want = np.where(x > 0, 0x7B, 0xFB).astype(np.uint8)
    np.testing.assert_array_equal(formats.fp8_encode(x), want)
    np.testing.assert_array_equal(_quiet_oracle(x), want)


def test_fp8_ties_round_to_even():
    """Midpoints between neighbouring e5m2 values go to the even mantissa, at every exponent."""
    lo, hi = E5M2_VALUES[:-1], E5M2_VALUES[1:]
    mid = (lo + hi) / 2  # needs 3 mantissa bits: exact in float16 and float32
    assert np.all(mid.astype(np.float32).astype(np.float64) == mid)
    lo_b = formats.fp8_encode(lo.astype(np.float32))
    hi_b = formats.fp8_encode(hi.astype(np.float32))
    want = np.where(lo_b % 2 == 0, lo_b, hi_b)  # the even byte is the even mantissa
    for sign in (1.0, -1.0):
        for dt in (np.float32, np.float16, np.float64):
            got = formats.fp8_encode((sign * mid).astype(dt))
            np.testing.assert_array_equal(got, want | (0x80 if sign < 0 else 0))
    # hand-checked: 1.125 lies between 1.0 (0x3C, even) and 1.25 (0x3D): down; 1.375 up to 1.5
    np.testing.assert_array_equal(formats.fp8_encode(np.float32([1.125, 1.375])), [0x3C, 0x3E])
    # just off the midpoint is not a tie
    above = np.nextafter(mid.astype(np.float32), np.float32(np.inf))
    below = np.nextafter(mid.astype(np.float32), np.float32(0))
    np.testing.assert_array_equal(formats.fp8_encode(above), hi_b)
    np.testing.assert_array_equal(formats.fp8_encode(below), lo_b)


def test_fp8_subnormals():
    q = 2.0**-16  # e5m2's subnormal step
    x = np.array([0, q / 2, q * 0.51, q, 1.5 * q, 2.5 * q, 3.5 * q, 3.9 * q, 4 * q, 2.0**-20, 1e-30, 1e-45])
    want = np.array([0, 0, 1, 1, 2, 2, 4, 4, 4, 0, 0, 0], np.uint8)
    np.testing.assert_array_equal(formats.fp8_encode(x.astype(np.float32)), want)
    np.testing.assert_array_equal(formats.fp8_encode(-x.astype(np.float32)), want | 0x80)
    np.testing.assert_array_equal(fp8_encode_oracle(x), want)
    # float32 subnormals themselves
    tiny = np.array([1, 2, 0x7FFFFF], np.uint32).view(np.float32)
    np.testing.assert_array_equal(formats.fp8_encode(tiny), [0, 0, 0])


def test_fp8_negative_zero_keeps_sign():
    np.testing.assert_array_equal(formats.fp8_encode(np.float32([-0.0, -1e-9, 0.0])), [0x80, 0x80, 0])


def test_fp8_every_float16_matches_oracle():
    """All 65536 fp16 bit patterns (the GGUF F16 and HF fp16 sources)."""
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    np.testing.assert_array_equal(formats.fp8_encode(x), _quiet_oracle(x))


def test_fp8_random_float32_matches_oracle():
    rng = np.random.default_rng(1234)
    # any bit pattern: every exponent, subnormals, infinities, NaNs
    bits = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(formats.fp8_encode(bits), _quiet_oracle(bits))
    # weight-like values at many scales
    scale = 10.0 ** rng.uniform(-9, 6, 1_000_000)
    x = (rng.standard_normal(1_000_000) * scale).astype(np.float32)
    np.testing.assert_array_equal(formats.fp8_encode(x), fp8_encode_oracle(x))
    # values a few float32 ulps either side of every e5m2 value and midpoint
    centres = np.concatenate([E5M2_VALUES, (E5M2_VALUES[:-1] + E5M2_VALUES[1:]) / 2]).astype(np.float32)
    ulps = np.arange(-3, 4, dtype=np.int64)
    near = (centres.view(np.int32)[:, None].astype(np.int64) + ulps).clip(0, 0x7F7FFFFF)
    near = near.astype(np.int32).view(np.float32).ravel()
    near = np.concatenate([near, -near])
    np.testing.assert_array_equal(formats.fp8_encode(near), fp8_encode_oracle(near))


def test_fp8_keeps_shape_and_wider_inputs():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    got = formats.fp8_encode(x)
    assert got.shape == (2, 3, 4) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, fp8_encode_oracle(x))
    # float64 and integer sources round from the exact source value (no detour through float32)
    x64 = np.array([1.125 + 2.0**-40, 1.125, 3, 7, 1e300], np.float64)
    np.testing.assert_array_equal(formats.fp8_encode(x64), [0x3D, 0x3C, 0x42, 0x47, 0x7B])
    np.testing.assert_array_equal(formats.fp8_encode(np.array([3, 7], np.int64)), [0x42, 0x47])
    assert formats.fp8_encode(np.float32(1.5)).shape == ()


# ---------------------------------------------------------------------------------------------
# fp16


def test_fp16_saturates_and_round_trips():
    x = np.float32([1e5, -1e5, 65504, 65520, 1.0, 2.0**-24, np.inf])
    got = formats.fp16_encode(x)
    np.testing.assert_array_equal(got, np.float16([65504, -65504, 65504, 65504, 1.0, 2.0**-24, 65504]))
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    np.testing.assert_array_equal(
        formats.fp16_encode(formats.fp16_decode(h)).view(np.uint16), h.view(np.uint16)
    )


# ---------------------------------------------------------------------------------------------
# gf4


def _gf4_word(scale_byte: int, codes: list[int]) -> int:
    return scale_byte | sum(q << (8 + 3 * k) for k, q in enumerate(codes))


def test_gf4_codes_map_to_scale_fractions():
    s_byte = int(formats.fp8_encode(np.float32([2.0]))[0])
    for q in range(8):
        w = np.array([[_gf4_word(s_byte, [q] * 8)]], np.uint32)
        want = 2.0 * [1, 0.75, 0.5, 0.25, 0, -0.25, -0.5, -0.75][q]
        np.testing.assert_array_equal(formats.gf4_decode(w), np.full((1, 8), want, np.float32))


def test_gf4_spec_example():
    """The largest element is exact (when e5m2-representable) and keeps its sign in the scale."""
    x = np.float32([[-3.0, 0.75, 1.5, 2.25, -0.1, 0.0, -1.5, 3.0 * 0.7]])
    w = formats.gf4_encode(x)
    assert w.shape == (1, 1) and w.dtype == np.uint32
    word = int(w[0, 0])
    assert word & 0xFF == formats.fp8_encode(np.float32([-3.0]))[0]  # signed scale s = -3
    codes = [(word >> (8 + 3 * k)) & 7 for k in range(8)]
    # q = rint(clip(-4 x / s + 4, 0, 7)) with s = -3, worked by hand
    assert codes == [0, 5, 6, 7, 4, 4, 2, 7]
    dec = formats.gf4_decode(w)
    assert dec[0, 0] == -3.0  # the largest element is exact
    np.testing.assert_array_equal(dec[0], [-3.0, 0.75, 1.5, 2.25, 0.0, 0.0, -1.5, 2.25])


def test_gf4_largest_exact_and_error_bound():
    rng = np.random.default_rng(7)
    # values already e5m2 (normal, positive bytes 0x04..0x7A) so each group's scale is exact
    x = formats.fp8_decode(rng.integers(4, 0x7B, (64, 256), dtype=np.uint8))
    x = (x * rng.choice([-1, 1], (64, 256))).astype(np.float32)
    dec = formats.gf4_decode(formats.gf4_encode(x))
    g, d = x.reshape(64, 32, 8), dec.reshape(64, 32, 8)
    idx = np.argmax(np.abs(g), axis=-1)[..., None]
    np.testing.assert_array_equal(np.take_along_axis(d, idx, -1), np.take_along_axis(g, idx, -1))
    # every element within the codes' range (down to -0.75 s) is within half a code step, |s| / 8;
    # the opposite-sign side is clipped at -0.75 s, so an error there is at most |s| / 4
    sv = np.take_along_axis(g, idx, -1)
    s = np.abs(sv)
    in_range = -4 * g / sv + 4 <= 7.5
    assert np.all(np.abs(d - g)[in_range] <= np.broadcast_to(s / 8, g.shape)[in_range])
    assert np.all(np.abs(d - g) <= s / 4)
    assert (~in_range).any()  # the clipped case does occur in this sample


def test_gf4_zero_group():
    x = np.zeros((3, 16), np.float32)
    x[1, 8:] = [0, 1, 0, 0, 0, 0, 0, -0.5]
    w = formats.gf4_encode(x)
    assert w.shape == (3, 2)
    zero_word = _gf4_word(0, [4] * 8)
    assert (w[0] == zero_word).all() and w[1, 0] == zero_word and w[2, 1] == zero_word
    np.testing.assert_array_equal(formats.gf4_decode(w), x)


def test_gf4_round_trip_of_decoded():
    """Decoded gf4 groups encode back to the same words (codes and scale are reproduced)."""
    rng = np.random.default_rng(3)
    w = formats.gf4_encode(rng.standard_normal((32, 64)).astype(np.float32))
    np.testing.assert_array_equal(formats.gf4_encode(formats.gf4_decode(w)), w)


def test_gf4_needs_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        formats.gf4_encode(np.zeros((2, 12), np.float32))
    with pytest.raises(ValueError, match="multiple of 8"):
        formats.storage_shape(2, 12, "gf4")


# ---------------------------------------------------------------------------------------------
# encode / decode dispatch


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "gf4"])
def test_encode_decode_shapes(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 40)).astype(np.float32)
    w = formats.encode(x, dtype)
    assert w.dtype == formats.STORAGE_DTYPE[dtype]
    assert w.shape == ((3, 5, 5) if dtype == "gf4" else (3, 5, 40))
    assert formats.storage_shape(15, 40, dtype) == w.reshape(15, -1).shape
    y = formats.decode(w, dtype)
    assert y.shape == x.shape and y.dtype == np.float32
    # relative rounding error: fp16 2**-11, e5m2 2**-3; gf4 (relative to the group's largest
    # magnitude m): half a code step of a scale up to 9/8 m, plus the scale's own error m / 8
    rel = {"fp16": 2.0**-11, "fp8": 2.0**-3, "gf4": 9 / 64 + 1 / 8}[dtype]
    if dtype == "gf4":
        scale = np.abs(x.reshape(3, 5, 5, 8)).max(-1, keepdims=True)
        err = np.abs(y - x).reshape(3, 5, 5, 8) / scale
    else:
        err = np.abs(y - x) / np.abs(x)
    assert err.max() <= rel
    np.testing.assert_array_equal(formats.decode(y, "fp32"), y)


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "gf4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_rejects_nan_and_inf(dtype, bad):
    x = np.ones((2, 8), np.float32)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or infinity"):
        formats.encode(x, dtype)


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown weight dtype"):
        formats.encode(np.ones((1, 8), np.float32), "int4")
    with pytest.raises(ValueError, match="unknown weight dtype"):
        formats.decode(np.ones((1, 8), np.float32), "int4")


# ---------------------------------------------------------------------------------------------
# q8 and q4: the spec against float64, at odd shapes

ODD = [(7, 96), (3, 5, 160), (1, 32)]  # q4's rows must be a multiple of 32 columns


def q8_spec_decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """w = scale * code in float64, rounded once to float32 (the spec's float32 product)."""
    return (scales.astype(np.float64)[..., None] * codes.astype(np.float64)).astype(np.float32)


def q4_spec_decode(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The q4 spec from the bits: nibble k of word j is column 8j + k; w = d q + m in float64
    (exact), rounded once to float32."""
    cols = words.shape[-1] * 8
    q = np.zeros((*words.shape[:-1], cols), np.float64)
    for col in range(cols):
        q[..., col] = (words[..., col // 8].astype(np.uint64) >> np.uint64(4 * (col % 8))) & 15
    group = cols // scales.shape[-2]
    d = np.repeat(scales[..., 0].astype(np.float64), group, axis=-1)
    m = np.repeat(scales[..., 1].astype(np.float64), group, axis=-1)
    return (d * q + m).astype(np.float32)


@pytest.mark.parametrize("shape", ODD)
def test_q8_round_trip(shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_t(4, size=shape) * rng.uniform(0.01, 3, size=(*shape[:-1], 1))).astype(np.float32)
    w = formats.encode(x, "q8")
    assert isinstance(w, formats.Quantized)
    assert w.codes.dtype == np.int8 and w.codes.shape == shape
    assert w.scales.dtype == np.float32 and w.scales.shape == shape[:-1]
    assert w.codes.min() >= -127  # -128 is never written
    y = formats.decode(w, "q8")
    np.testing.assert_array_equal(y, q8_spec_decode(w.codes, w.scales))
    # unclipped weights are within half a step of their value; the error of the whole row is
    # never more than the plain absmax / 127 scale gives
    s = w.scales.astype(np.float64)[..., None]
    inside = np.abs(x) <= 127 * s
    assert np.all(
        np.abs(y.astype(np.float64) - x)[inside]
        <= (s / 2 * (1 + 1e-6) + 1e-30).repeat(x.shape[-1], -1)[inside]
    )
    plain = formats.decode(formats.q8_encode_absmax(x), "q8")
    assert np.all(((y - x) ** 2).sum(-1) <= ((plain - x) ** 2).sum(-1) * (1 + 1e-6))


@pytest.mark.parametrize("shape,group", [((7, 96), 32), ((3, 5, 160), 32), ((1, 32), 32), ((3, 5, 192), 64)])
def test_q4_round_trip(shape, group):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) + rng.uniform(-0.5, 0.5, size=(*shape[:-1], 1))).astype(np.float32)
    w = formats.encode(x, "q4", group=group)
    groups = shape[-1] // group
    assert w.codes.dtype == np.uint32 and w.codes.shape == (*shape[:-1], shape[-1] // 8)
    assert w.scales.dtype == np.float16 and w.scales.shape == (*shape[:-1], groups, 2)
    y = formats.decode(w, "q4")
    np.testing.assert_array_equal(y, q4_spec_decode(w.codes, w.scales))
    # each weight inside its group's range is within half a step (plus float32's rounding)
    d = np.repeat(w.scales[..., 0].astype(np.float64), group, -1)
    m = np.repeat(w.scales[..., 1].astype(np.float64), group, -1)
    inside = (x >= m) & (x <= m + 15 * d)
    err = np.abs(y.astype(np.float64) - x)
    assert np.all(err[inside] <= (d / 2 + np.abs(x) * 2.0**-23)[inside])
    # the search never does worse, group by group, than the plain min..max range
    plain = formats.decode(formats.q4_encode_minmax(x, group), "q4")
    sq = ((y - x) ** 2).reshape(*shape[:-1], groups, group).sum(-1)
    sq_plain = ((plain - x) ** 2).reshape(*shape[:-1], groups, group).sum(-1)
    assert np.all(sq <= sq_plain * (1 + 1e-5) + 1e-12)
    if sq.size >= 20:  # and over many groups it does better (about 18% on normal weights)
        assert sq.sum() < 0.9 * sq_plain.sum()


@pytest.mark.parametrize(
    "dtype,shape,block",
    [("q8", (2, 13, 160), 3), ("q4", (2, 13, 160), 3), ("q8", (9, 14336), 2), ("q4", (9, 14336), 2)],
)
def test_quantized_search_in_blocks_gives_the_whole_matrix_bits(dtype, shape, block, monkeypatch):
    """The q8 / q4 searches a block of rows at a time give each row the bits one search over the
    whole matrix gives it, the last, shorter block's rows too. (np.einsum's row sums, which the
    searches once took, differ in the last bit at 14,336 columns between a call of 2 rows and one
    of 9.)"""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 3, size=(*shape[:-1], 1))).astype(np.float32)
    monkeypatch.setattr(formats, "ENCODE_BLOCK_ELEMS", block * shape[-1])
    blocks = formats.encode(x, dtype)
    monkeypatch.setattr(formats, "ENCODE_BLOCK_ELEMS", x.size)
    whole = formats.encode(x, dtype)
    assert blocks.codes.shape == whole.codes.shape and blocks.scales.shape == whole.scales.shape
    assert np.array_equal(blocks.codes, whole.codes) and np.array_equal(blocks.scales, whole.scales)


def test_q4_hand_made_codes():
    # word 0x76543210: columns 0..7 hold codes 0..7; word 0x89ABCDEF: columns 8..15 codes 15..8
    words = np.array([[0x76543210, 0x89ABCDEF, 0, 0xFFFFFFFF]], np.uint32)
    scales = np.array([[[0.5, -1.0]]], np.float16)  # one group of 32: d = 0.5, m = -1
    got = formats.decode(formats.Quantized(words, scales), "q4")
    codes = [*range(8), *range(15, 7, -1), *[0] * 8, *[15] * 8]
    np.testing.assert_array_equal(got[0], np.float32(0.5) * np.array(codes, np.float32) - 1)
    np.testing.assert_array_equal(formats.q4_unpack(words)[0], codes)
    np.testing.assert_array_equal(formats.q4_pack(formats.q4_unpack(words)), words)


def test_q8_hand_made_codes():
    codes = np.array([[-127, 0, 5, 127], [1, -1, 2, -2]], np.int8)
    scales = np.array([0.25, 3.0], np.float32)
    got = formats.decode(formats.Quantized(codes, scales), "q8")
    np.testing.assert_array_equal(got, [[-31.75, 0, 1.25, 31.75], [3, -3, 6, -6]])


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_quantized_zero_rows_and_constant_groups(dtype):
    x = np.zeros((3, 64), np.float32)
    x[1] = 0.3  # a constant row: q4 is exact (m = fp16(0.3)), q8 a single step
    x[2, :32] = -2.0
    y = formats.decode(formats.encode(x, dtype), dtype)
    np.testing.assert_array_equal(y[0], 0)
    np.testing.assert_allclose(y[1:], x[1:], rtol=2.0**-11)


def test_quantized_bits_and_shapes():
    assert formats.bits_per_weight("q4", 4096, 32) == 5.0
    assert formats.bits_per_weight("q4", 4096, 64) == 4.5
    assert formats.bits_per_weight("q8", 4096) == 8 + 32 / 4096
    assert formats.scales_shape(10, 128, "q4", 64) == (10, 2, 2)
    assert formats.scales_shape(10, 128, "q8") == (10,)
    assert formats.storage_shape(10, 128, "q4") == (10, 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        formats.storage_shape(2, 48, "q4")
    with pytest.raises(ValueError, match="groups of 64"):
        formats.encode(np.ones((2, 96), np.float32), "q4", group=64)
    w = formats.encode(np.ones((4, 64), np.float32), "q4")
    row = formats.take_rows(w, 2)
    assert row.codes.shape == (8,) and row.scales.shape == (2, 2)
