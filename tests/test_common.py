"""The device helpers of pycalm.kernels.common against pycalm.model.formats, bit for bit."""

import numpy as np
from numba import cuda, float32, int32

from pycalm.kernels import common
from pycalm.kernels.tensorcore import pack_f16x2
from pycalm.model import formats


@cuda.jit
def _decode_fp8_kernel(words, out, single):
    # words: (n,) int32 holding 4 e5m2 bytes each; out: (4 n,) float32 (the matvec decoder);
    # single: (n,) float32, the low byte through fp8_decode (the embedding's decoder)
    i = cuda.grid(1)
    if i < words.shape[0]:
        f0, f1, f2, f3 = common.fp8x4_cvt(words[i])
        out[4 * i] = f0
        out[4 * i + 1] = f1
        out[4 * i + 2] = f2
        out[4 * i + 3] = f3
        single[i] = common.fp8_decode(words[i] & int32(0xFF))


@cuda.jit
def _decode_fp16_kernel(words, out):
    # words: (n,) int32 holding 2 fp16 each; out: (2 n,) float32 (the matvec decoder, h2f2)
    i = cuda.grid(1)
    if i < words.shape[0]:
        lo, hi = common.h2f2(words[i])
        out[2 * i] = lo
        out[2 * i + 1] = hi


@cuda.jit
def _decode_gf4_kernel(words, x, out, dots):
    # words: (n,) int32 gf4 groups; out: (8 n,) float32 decoded (the embedding's decoder);
    # dots: (n,) group . x[8i:8i+8] (the matvec decoder, raw, times GF4_RAW_SCALE)
    i = cuda.grid(1)
    if i < words.shape[0]:
        w = words[i]
        for k in range(8):
            out[8 * i + k] = common.gf4_decode(w, k)
        b = 8 * i
        raw = common.gf4_dot8_raw(
            w, x[b], x[b + 1], x[b + 2], x[b + 3], x[b + 4], x[b + 5], x[b + 6], x[b + 7]
        )
        dots[i] = raw * float32(common.GF4_RAW_SCALE)


@cuda.jit
def _pair_decoders_kernel(gf4, q8, q4, q4_scales, out_gf4, out_q8, out_q4):
    # the f16x2 pair decoders of the tensor-core kernels' W tiles, a word a thread: gf4 (n,) words
    # -> out_gf4 (n, 4) words of two weights; q8 (n,) words of 4 codes -> out_q8 (n, 2); q4 (n,)
    # words of 8 codes with q4_scales (n, 2) fp16 (d, m) as float32 -> out_q4 (n, 4)
    i = cuda.grid(1)
    if i < gf4.shape[0]:
        f = common.gf4_factor(gf4[i])
        for p in range(4):
            out_gf4[i, p] = common.gf4_pair(gf4[i], p, f)
        out_q8[i, 0], out_q8[i, 1] = common.q8_pairs(q8[i])
        dd = pack_f16x2(q4_scales[i, 0], q4_scales[i, 0])
        mm = pack_f16x2(q4_scales[i, 1], q4_scales[i, 1])
        for b in range(4):
            out_q4[i, b] = common.q4_pair(q4[i], b, dd, mm)


@cuda.jit
def _encode_kernel(x, out16, out8):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out16[i] = common.fp16_encode(x[i])
        out8[i] = common.fp8_encode(x[i])


@cuda.jit
def _reduce_kernel(x, sums, maxs, bsum, bmax):
    # one block; x: (blockDim,) float32
    scratch = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    v = x[t]
    sums[t] = common.warp_reduce_sum(v)
    maxs[t] = common.warp_reduce_max(v)
    s = common.block_reduce_sum(v, scratch)
    m = common.block_reduce_max(v, scratch)
    bsum[t] = s
    bmax[t] = m


def _launch(kernel, n, *args):
    kernel[(n + 127) // 128, 128](*args)
    cuda.synchronize()


def test_fp8_and_fp16_decoders_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    words = b.view(np.int32)  # 64 words, bytes in little-endian order
    out = cuda.to_device(np.full(256, np.nan, np.float32))
    single = cuda.to_device(np.full(64, np.nan, np.float32))
    _launch(_decode_fp8_kernel, 64, cuda.to_device(words), out, single)
    got, want = out.copy_to_host(), formats.fp8_decode(b)
    finite = (b & 0x7C) != 0x7C  # exponent 31 (inf/NaN) never occurs in weights
    assert finite.sum() == 248
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    low = b[0::4]  # the low byte of each word
    keep = (low & 0x7C) != 0x7C
    np.testing.assert_array_equal(
        single.copy_to_host()[keep].view(np.uint32), want[0::4][keep].view(np.uint32)
    )

    rng = np.random.default_rng(1)
    h = np.concatenate([np.arange(0, 0x7C00), np.arange(0x8000, 0xFC00)]).astype(np.uint16)  # finite
    h = np.concatenate([h[:80], h[0x7B00:0x7C80], rng.choice(h, 2048)])  # subnormals, the top, random
    words16 = h.view(np.int32)
    out = cuda.to_device(np.full(len(h), np.nan, np.float32))
    _launch(_decode_fp16_kernel, len(words16), cuda.to_device(words16), out)
    want16 = h.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(out.copy_to_host().view(np.uint32), want16.view(np.uint32))


def test_gf4_decoder_random_words():
    rng = np.random.default_rng(2)
    n = 256
    w = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    w[(w & 0x7C) == 0x7C] &= ~np.uint32(0x40)  # finite scales only (as the encoder makes)
    w[:8] = formats.gf4_encode(rng.standard_normal((1, 64)).astype(np.float32))[0]
    x = rng.standard_normal(8 * n).astype(np.float32)
    out = cuda.to_device(np.full(8 * n, np.nan, np.float32))
    dots = cuda.to_device(np.full(n, np.nan, np.float32))
    _launch(_decode_gf4_kernel, n, cuda.to_device(w.view(np.int32)), cuda.to_device(x), out, dots)
    want = formats.gf4_decode(w[None, :])[0]
    np.testing.assert_array_equal(out.copy_to_host(), want)
    want_dot = (want.astype(np.float64) * x).reshape(n, 8).sum(1)
    scale = (np.abs(want.astype(np.float64) * x)).reshape(n, 8).sum(1)
    np.testing.assert_allclose(dots.copy_to_host(), want_dot, rtol=0, atol=1e-6 * scale.max() + 0)
    assert np.all(np.abs(dots.copy_to_host() - want_dot) <= 4e-7 * scale + 1e-30)


def test_encoders_match_formats():
    rng = np.random.default_rng(3)
    # every fp8 value and the midpoints between neighbours (ties), fp16 ties, random magnitudes
    # from subnormal to beyond saturation, both signs
    b = np.arange(256, dtype=np.uint8)
    v8 = np.sort(formats.fp8_decode(b[(b & 0x7C) != 0x7C]).astype(np.float64))
    mids8 = (v8[1:] + v8[:-1]) / 2
    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    mids16 = (h[1:] + h[:-1]) / 2
    mags = np.exp2(rng.uniform(-30, 18, 1500)) * rng.choice([-1, 1], 1500)
    bits = rng.integers(0, 0x7F800000, 1000).astype(np.uint32).view(np.float32)
    x = np.concatenate(
        [
            v8,
            mids8,
            -mids8,
            rng.choice(mids16, 800),
            -rng.choice(mids16, 800),
            mags,
            bits,
            -bits,
            [0.0, -0.0, 57344, 61439, 61440, 1e6, 65504, 65520, 65536, -70000, np.inf, -np.inf],
        ]
    ).astype(np.float32)
    # the float32 midpoints must be exactly representable for the ties to be ties
    out16 = cuda.to_device(np.zeros(len(x), np.float16))
    out8 = cuda.to_device(np.zeros(len(x), np.int32))
    _launch(_encode_kernel, len(x), cuda.to_device(x), out16, out8)
    np.testing.assert_array_equal(out8.copy_to_host().astype(np.uint8), formats.fp8_encode(x))
    np.testing.assert_array_equal(
        out16.copy_to_host().view(np.uint16), formats.fp16_encode(x).view(np.uint16)
    )


def test_reductions():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(96).astype(np.float32)
    outs = [cuda.to_device(np.full(96, np.nan, np.float32)) for _ in range(4)]
    _reduce_kernel[1, 96](cuda.to_device(x), *outs)
    sums, maxs, bsum, bmax = (o.copy_to_host() for o in outs)
    w = x.reshape(3, 32)
    np.testing.assert_allclose(sums, np.repeat(w.sum(1), 32), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(maxs, np.repeat(w.max(1), 32))
    np.testing.assert_allclose(bsum, np.full(96, x.sum()), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(bmax, np.full(96, x.max()))


def test_pair_decoders_match_formats():
    """gf4_pair, q8_pairs and q4_pair (the W tiles of skinny, matmul and wgmma_matmul) give the
    formats' weights as fp16, bit for bit: gf4 and q8 exactly, q4 as d q + m rounded once."""
    rng = np.random.default_rng(3)
    n = 512
    gf4 = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    gf4[(gf4 & 0x7C) == 0x7C] &= ~np.uint32(0x40)  # finite scales only (as the encoder makes)
    gf4[:64] = formats.gf4_encode(rng.standard_normal((1, 512)).astype(np.float32))[0]
    gf4[64:72] = formats.gf4_encode(1e-4 * rng.standard_normal((1, 64)).astype(np.float32))[0]  # tiny scales
    q8 = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    q4 = formats.q4_encode(
        rng.standard_normal((n // 4, 32)).astype(np.float32) * rng.uniform(1e-3, 10, (n // 4, 1))
    )
    q4_words = q4.codes.reshape(n)  # (n // 4, 4) words of 8 codes, one group of 32 a row
    q4_scales = np.repeat(q4.scales.reshape(n // 4, 2), 4, axis=0).astype(
        np.float32
    )  # (n, 2) each word's d, m
    outs = [cuda.to_device(np.zeros((n, k), np.int32)) for k in (4, 2, 4)]
    args = (gf4.view(np.int32), q8.view(np.int32), q4_words.view(np.int32), q4_scales)
    _launch(_pair_decoders_kernel, n, *(cuda.to_device(a) for a in args), *outs)
    got_gf4, got_q8, got_q4 = (o.copy_to_host().view(np.float16).reshape(n, -1) for o in outs)
    want_gf4 = formats.gf4_decode(gf4[None, :])[0].reshape(n, 8)
    np.testing.assert_array_equal(got_gf4.astype(np.float32), want_gf4)
    assert np.all(np.signbit(got_gf4) == np.signbit(want_gf4))  # -0 stays -0
    want_q8 = q8.view(np.int8).reshape(n, 4).astype(np.float16)
    np.testing.assert_array_equal(got_q8.view(np.uint16), want_q8.view(np.uint16))
    d, m = q4_scales[:, :1].astype(np.float64), q4_scales[:, 1:].astype(np.float64)
    codes = formats.q4_unpack(q4_words[:, None]).reshape(n, 8).astype(np.float64)
    want_q4 = (d * codes + m).astype(np.float16)  # exact, then rounded once
    np.testing.assert_array_equal(got_q4.view(np.uint16), want_q4.view(np.uint16))
    # and the formats' float32 weights, rounded to fp16 (no double rounding on these scales)
    ref = formats.q4_decode(q4).reshape(n, 8).astype(np.float16)
    np.testing.assert_array_equal(got_q4.view(np.uint16), ref.view(np.uint16))
