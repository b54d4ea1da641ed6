"""Grouped-query attention of one query position over the KV cache.

For query head h (kv head g = h // (n_heads // n_kv_heads)) and cached positions t in
[start, n_pos), start = max(0, n_pos - window) with a sliding window, else 0:
  score_t = q_h . k_t,g / sqrt(head_dim);  p = softmax(score);  out_h = sum_t p_t v_t,g
The caches hold (seq_len, n_kv_heads * head_dim) per layer, fp16 or fp8 e5m2.

GPU: one kernel, grid (n_heads, n_chunks), THREADS threads a block. Block (h, c) takes query head
h and the c-th chunk of CHUNK positions (a power of two, sized so that a thread's share of the
chunk's K and V rows fits in REG_WORDS int64 registers each). A captured grid cannot depend on
pos, so n_chunks covers a span of positions (attention_span: the engine captures a step for
each power-of-two multiple of CHUNK) and blocks past the live chunks exit at once. A block:

1. issues ALL its K and V loads first, before any arithmetic: one DRAM round trip for the chunk.
   K: teams of TL lanes, one position a team, each lane KW interleaved int64 words of the row
   (~4: a few shuffles per position). V: teams of VL lanes, VW words a lane (~2).
2. scores: each team dots its K row with the lane's slice of q (held in registers, times
   1/sqrt(head_dim)), xor-shuffles the partial dots inside the team, and writes the score to
   shared memory. One barrier.
3. softmax: EVERY warp reads the chunk's scores and computes their max m and sum of
   exp(score - m) itself (a few shared loads a lane, then shuffles): no second barrier.
4. p V: each V team takes its positions, p = exp(score - m) (read back from shared memory),
   and accumulates p * v for its slice of the row; the teams of a warp are added by xor
   shuffles, the warps through shared memory (one barrier).
5. one live chunk (every context up to CHUNK positions): out = sum / sum of exp, done. Several:
   the block writes (unnormalised out, m, sum) to its slot of `part`, and the LAST block of the
   head to finish (a per-head atomic counter) combines the chunks' partials and resets the
   counter. Each (head, chunk) slot of `part` is padded to whole 128-byte lines, so no line the
   combining block reads was ever cached in its SM's L1 before it was written.

Why this shape: at short context attention costs not bytes but latency (the KV read of
TinyLlama at 256 positions is 128 KB a layer). The previous design (flash-decoding with 8 query
heads of a group a block and a separate combine kernel) spent 10.4 us a layer there: Nsight
Compute showed ~1,850 dependent instructions a live warp at 6-7 cycles each, and the combine
kernel's launch and barrier. Here every load is in flight at once, a warp's chain is a few
hundred instructions, and at up to CHUNK positions there is one kernel and no partials.
The G query heads of a group read the same K and V rows: the first block brings them into L2,
the others read them from there. The price is at long context: every head's block decodes the
rows itself and the blocks run in waves (H200, Llama-3-8B shape at 4000 positions: 21-28 us a
layer against 19 for the previous design; 4-8 us against 10.5-11 up to 256 positions). Blocks
of 2-8 query heads (each element decoded once for all) were measured slower at every length.

Decode of the caches in registers: fp16 and e5m2 are both "sign, 5-bit exponent, mantissa",
so shifting the bits into an fp32 (sign to bit 31, the rest to bits 13 / 21 on) gives the
value / 2^112 exactly (subnormals included). The 2^112 is folded into q (for scores) and into
the final output, so the inner loops are 2-3 integer ops and an FMA per element. The decoders
here wrap every shift in int32() (real numba computes int32 shifts in int64).

Bytes moved: n attended positions x kv_dim x 2 (K and V) x bytes per element from DRAM (plus
(G - 1) times that from L2), q, the partials of a multi-chunk context (written and read) and out.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32, int64, uint32
from numba.cuda import libdevice

from pycalm.errors import PycalmError
from pycalm.kernels.common import (
    FP_RAW_SCALE,
    STATE_POS,
    as_f32,
    dependent_start,
    warp_reduce_max,
    warp_reduce_sum,
)

# ---------------------------------------------------------------------------------------------
# GPU kernel

# Tuning knobs, read when a scratch is made and at launch (scripts/bench_attention.py varies
# them; a launch takes the chunk length its scratch was made for).
# under the CUDA simulator (a Python thread per CUDA thread) smaller blocks and chunks of the
# same kernel, so that the tests' short contexts still cover several chunks
THREADS = 64 if _numba_config.ENABLE_CUDASIM else 256  # threads a block
MAX_CHUNK = 16 if _numba_config.ENABLE_CUDASIM else 256  # most positions a block takes
REG_WORDS = 16  # int64 words of K (and as many of V) a thread holds in flight: 64 registers
K_WORDS = 4  # words of a K row a lane takes (fewer lanes a position: fewer shuffles)
V_WORDS = 2  # words of a V row a lane takes (more lanes a position: fewer team merges)
# registers a thread at most, so that two blocks of THREADS fit an SM's 64k (tests/test_ptx.py
# checks it with ptxas): one block an SM runs the blocks of a long context in twice the waves
MAX_REGISTERS = 65536 // (2 * THREADS)
UNROLL = 8  # independent partial loads in flight per thread of the combine
NEG = -1.0e30  # "no score yet": finite, so exp(NEG - m) is 0, not NaN
KV_DTYPES = ("fp16", "fp8")
_MASK_FP16 = 0x8FFFE000 - (1 << 32)  # int32: sign and the e5m10 fields after an arithmetic >> 3
_MASK_E5M2 = 0x8FE00000 - (1 << 32)  # int32: sign and the e5m2 fields after an arithmetic >> 3
_LINE = 32  # floats in a 128-byte cache line


def _elems_per_word(kv_dtype: str) -> int:
    return 8 if kv_dtype == "fp8" else 4


def attention_chunk_len(head_dim: int, kv_dtype: str) -> int:
    """Positions a block takes: MAX_CHUNK, or fewer (a power of two) where a thread's share of
    the chunk's K words (chunk x words a row / THREADS) would exceed REG_WORDS."""
    row_words = head_dim // _elems_per_word(kv_dtype)
    chunk = MAX_CHUNK
    while chunk > 1 and chunk * row_words > REG_WORDS * THREADS:
        chunk //= 2
    return chunk


@dataclass(frozen=True)
class KVCache:
    """One layer's KV cache: rows are positions, each row the n_kv_heads heads side by side."""

    k: object  # (seq_len, n_kv_heads * head_dim) float16, or uint8 holding fp8 e5m2
    v: object  # (seq_len, n_kv_heads * head_dim), as k
    dtype: str  # "fp16" or "fp8" (pycalm.config.kv_dtype_for decides)


@dataclass(frozen=True)
class AttentionScratch:
    """Device scratch one engine allocates once; every layer shares it (the layers run one
    after another on one stream).

    part: (n_heads, n_chunks, padded head_dim + 2) float32, per head and chunk the unnormalised
      sum of p*V, then the chunk's score max and its sum of exp(score - max); padded to 128-byte
      lines. Written before it is read: no initial contents needed.
    count: (n_heads,) int32, chunks of the head finished in the running launch; zero between
      launches (the last block resets it), so it must start zeroed.
    chunk: positions a block takes (attention_chunk_len when the scratch was made).
    """

    part: object
    count: object
    chunk: int


def attention_scratch(
    n_heads: int,
    head_dim: int,
    kv_dtype: str,
    seq_len: int,
    *,
    chunk: int | None = None,
    stream: object = 0,
) -> AttentionScratch:
    """Allocate the scratch for contexts of up to seq_len positions (see AttentionScratch).
    chunk: positions a block takes, a power of two no larger than attention_chunk_len (the
    default); the tests take short chunks to cover the combine at short contexts."""
    longest = attention_chunk_len(head_dim, kv_dtype)
    chunk = longest if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1) or chunk > longest:
        raise PycalmError(f"attention chunk {chunk} is not a power of two up to {longest}")
    n_chunks = -(-seq_len // chunk)
    padded = -(-(head_dim + 2) // _LINE) * _LINE
    part = cuda.device_array((n_heads, n_chunks, padded), np.float32, stream=stream)
    count = cuda.to_device(np.zeros(n_heads, np.int32), stream=stream)
    return AttentionScratch(part, count, chunk)


@cuda.jit(device=True, inline=True)
def _exp(x):  # noqa: ANN001, ANN202
    """exp(x) as ex2.approx(x log2 e): two instructions instead of the accurate expf's ~10
    (relative error ~1e-7 for the |x| < 20 that carry weight in a softmax; 0 for -1e30)."""
    return libdevice.fast_expf(x)


@cuda.jit(device=True, inline=True)
def _decode(w, e, fp8):  # noqa: ANN001, ANN202
    """Element e (a constant after unrolling) of an int64 word of the cache, 4 fp16 or 8 e5m2
    from the lowest address up, as value * 2**-112. Every shift is wrapped in int32(): real
    numba computes int32 << / >> in int64, and the sign must come from bit 31 of the word."""
    half = e >= (4 if fp8 else 2)
    x = int32(w >> 32) if half else int32(w)
    if fp8:
        k = e & 3
        if k < 3:
            x = int32(x << int32(24 - 8 * k))
        return as_f32(int32(x >> int32(3)) & int32(_MASK_E5M2))
    if (e & 1) == 0:
        x = int32(x << int32(16))
    return as_f32(int32(x >> int32(3)) & int32(_MASK_FP16))


def _team(row_words: int, words_a_lane: int) -> int:
    """Lanes a team: a power of two (1 to 32) dividing the words of a row, about
    row_words / words_a_lane of them."""
    lanes = 1
    while lanes < 32 and row_words % (2 * lanes) == 0 and row_words // (2 * lanes) >= words_a_lane:
        lanes *= 2
    return lanes


@functools.cache
def attention_kernel(head_dim: int, group: int, kv_dtype: str, chunk: int, threads: int) -> object:
    """The kernel specialised for a head_dim, group size, KV dtype, chunk length (a power of
    two) and block size. The sizes are compile-time constants so the per-lane loads, query
    slice and accumulators are fixed-size local arrays that the compiler keeps in registers
    (all loops over them unroll)."""
    FP8 = kv_dtype == "fp8"
    EPW = _elems_per_word(kv_dtype)  # elements per int64 word
    HD = head_dim
    HW = head_dim // EPW  # words a row
    G = group
    NT = threads
    NW = threads // 32
    CH = chunk
    CH_LOG = chunk.bit_length() - 1
    TL = _team(HW, K_WORDS)  # K: lanes a position, words a lane, positions a block step, steps
    KW = HW // TL
    KD = KW * EPW
    P1 = NW * (32 // TL)
    KS = -(-CH // P1)
    KSW = KS * KW  # K words a lane
    VL = _team(HW, V_WORDS)  # V: the same
    VW = HW // VL
    VD = VW * EPW
    P3 = NW * (32 // VL)
    VS = -(-CH // P3)
    VSW = VS * VW  # V words a lane
    Q_SCALE = FP_RAW_SCALE / math.sqrt(head_dim)  # 1/sqrt(head_dim) and the decode's 2^112
    SLICES = max(1, NT // HD)  # combine: thread (slice, d) sums every SLICES-th chunk
    U = UNROLL

    @cuda.jit(fastmath=False)
    def attention_kernel(q, k_cache, v_cache, state, part, count, out, window):  # noqa: ANN001, ANN202
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        # q (n_heads*HD,) f32; caches (seq_len, kv_words) int64; part (n_heads, n_chunks, >= HD+2)
        # f32; count (n_heads,) i32; out (n_heads*HD,) f32
        h = cuda.blockIdx.x
        c = cuda.blockIdx.y
        n_pos = int32(state[STATE_POS] + 1)
        start = int32(0)
        if window > 0 and n_pos > window:
            start = int32(n_pos - window)
        live = int32(int32(n_pos - start + CH - 1) >> int32(CH_LOG))
        if c >= live:
            return  # the whole block leaves together: no barrier is left waiting
        t0 = int32(start + c * CH)
        nc = min(int32(n_pos - t0), int32(CH))  # positions of this chunk
        last = int32(t0 + nc - 1)
        g = int32(h // G)
        tid = cuda.threadIdx.x
        warp = tid // 32
        wl = tid % 32
        kl = wl % TL  # lane in its K team, and the team's position in a step
        kteam = warp * (32 // TL) + wl // TL
        vl = wl % VL  # the same for V
        vteam = warp * (32 // VL) + wl // VL
        sc = cuda.shared.array(CH, float32)  # the chunk's scores
        red = cuda.shared.array((NW, HD), float32)  # per-warp sum of p*v
        red2 = cuda.shared.array((SLICES, HD), float32)  # combine: per-slice sums
        flag = cuda.shared.array(1, int32)  # combine: 1 in the last block of the head

        # 1. every K and V load of the chunk (past the end: reloads of the last row)
        kw = cuda.local.array(KSW, int64)
        vw = cuda.local.array(VSW, int64)
        kbase = g * HW + kl
        vbase = g * HW + vl
        for s in range(KS):
            if s * P1 < nc:  # block-uniform: a short chunk issues (and later uses) fewer steps
                t = uint32(min(t0 + s * P1 + kteam, last))  # unsigned: no negative-index code
                for j in range(KW):
                    kw[s * KW + j] = k_cache[t, uint32(kbase + TL * j)]
        for s in range(VS):
            if s * P3 < nc:
                t = uint32(min(t0 + s * P3 + vteam, last))
                for j in range(VW):
                    vw[s * VW + j] = v_cache[t, uint32(vbase + VL * j)]
        qr = cuda.local.array(KD, float32)  # this lane's slice of q, times Q_SCALE
        for j in range(KW):
            for e in range(EPW):
                qr[j * EPW + e] = q[h * HD + (kl + TL * j) * EPW + e] * float32(Q_SCALE)

        # 2. scores
        for s in range(KS):
            if s * P1 >= nc:
                continue  # block-uniform: every lane of a team skips together
            acc = float32(0.0)
            for j in range(KW):
                for e in range(EPW):
                    acc += qr[j * EPW + e] * _decode(kw[s * KW + j], e, FP8)
            off = TL // 2
            while off > 0:  # xor tree inside the team: every lane ends with the score
                acc += cuda.shfl_xor_sync(0xFFFFFFFF, acc, off)
                off //= 2
            tl = s * P1 + kteam
            if kl == 0 and tl < CH:
                sc[tl] = acc
        cuda.syncthreads()  # every score of the chunk is in sc

        # 3. the chunk's max and sum of exp, by every warp
        m = float32(NEG)
        for i in range(wl, nc, 32):
            m = max(m, sc[i])
        m = warp_reduce_max(m)
        ls = float32(0.0)
        for i in range(wl, nc, 32):
            ls += _exp(sc[i] - m)
        ls = warp_reduce_sum(ls)

        # 4. sum of p * v
        o = cuda.local.array(VD, float32)
        for i in range(VD):
            o[i] = float32(0.0)
        for s in range(VS):
            if s * P3 >= nc:
                continue  # block-uniform
            tl = s * P3 + vteam
            p = _exp(sc[min(tl, nc - 1)] - m)
            p = p if tl < nc else float32(0.0)
            for j in range(VW):
                for e in range(EPW):
                    o[j * EPW + e] += p * _decode(vw[s * VW + j], e, FP8)
        off = VL
        while off < 32:  # add the teams of a warp (xor over the team bits of the lane id)
            for i in range(VD):
                o[i] += cuda.shfl_xor_sync(0xFFFFFFFF, o[i], off)
            off *= 2
        if wl < VL:  # the first team holds the warp's sum
            for j in range(VW):
                for e in range(EPW):
                    red[warp, (vl + VL * j) * EPW + e] = o[j * EPW + e]
        cuda.syncthreads()  # every warp's sum is in red

        # 5. one chunk: the output; several: this chunk's partial, and the last block combines
        for d in range(tid, HD, NT):
            acc = float32(0.0)
            for w in range(NW):
                acc += red[w, d]
            acc *= float32(FP_RAW_SCALE)
            if live == 1:
                out[h * HD + d] = acc / ls
            else:
                part[h, c, d] = acc
        if live == 1:
            return
        if tid == 0:
            part[h, c, HD] = m
            part[h, c, HD + 1] = ls
        cuda.threadfence()  # this thread's part of the partial is visible device-wide ...
        cuda.syncthreads()  # ... for every thread, before the chunk is counted
        if tid == 0:
            done = cuda.atomic.add(count, h, 1)
            flag[0] = int32(1) if done == live - 1 else int32(0)
        cuda.syncthreads()  # flag is set
        if flag[0] == 0:
            return
        cuda.threadfence()  # the other chunks' partials are read after their count
        # every warp finds the largest chunk max and the denominator itself (no barrier)
        mm = float32(NEG)
        for cc in range(wl, live, 32):
            mm = max(mm, part[h, cc, HD])
        mm = warp_reduce_max(mm)
        den = float32(0.0)
        for cc in range(wl, live, 32):
            den += _exp(part[h, cc, HD] - mm) * part[h, cc, HD + 1]
        den = warp_reduce_sum(den)
        for i in range(tid, SLICES * HD, NT):
            sl = i // HD
            d = i % HD
            acc = float32(0.0)
            for c0 in range(sl * U, live, SLICES * U):
                for u in range(U):  # U independent loads; past-the-end ones read chunk live-1
                    cc = min(c0 + u, live - 1)
                    x = _exp(part[h, cc, HD] - mm) * part[h, cc, d]
                    acc += x if c0 + u < live else float32(0.0)
            red2[sl, d] = acc
        cuda.syncthreads()  # every slice's sum is in red2
        for d in range(tid, HD, NT):
            acc = float32(0.0)
            for sl in range(SLICES):
                acc += red2[sl, d]
            out[h * HD + d] = acc / den
        if tid == 0:
            count[h] = 0  # for the next launch (the next layer)

    return attention_kernel


def attention(
    q: object,
    k_cache: object,
    v_cache: object,
    state: object,
    out: object,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    window: int,
    scratch: AttentionScratch,
    *,
    stream: object,
    span: int | None = None,
) -> int:
    """out (n_heads*head_dim,) f32 = attention of q over positions [start, state[STATE_POS]].

    k_cache / v_cache: this layer's (seq_len, n_kv_heads*head_dim) float16 or uint8 (e5m2);
    scratch: from attention_scratch(n_heads, head_dim, kv_dtype, >= seq_len).
    span: the grid covers positions 0..span-1 (ceil(span / chunk) blocks a head; default the
    whole cache): the launch is right only while state[STATE_POS] < span. A graph captured at
    seq_len 4096 would otherwise launch 16 blocks a head where a short context has one live
    (attention_span: the spans an engine captures).
    Returns the bytes moved at the longest context the span holds (the real figure depends on
    pos, which lives on the device); bench_attention computes it per n_pos.
    """
    if kv_dtype not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {kv_dtype!r} (one of {', '.join(KV_DTYPES)})")
    if head_dim % _elems_per_word(kv_dtype):
        raise PycalmError(f"head_dim {head_dim} is not a multiple of 8 (fp8 KV) or 4 (fp16 KV)")
    if n_heads % n_kv_heads:
        raise PycalmError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    seq_len = k_cache.shape[0]
    part = scratch.part
    n_chunks = part.shape[1]
    if part.shape[0] != n_heads or n_chunks * scratch.chunk < seq_len or part.shape[2] < head_dim + 2:
        raise PycalmError(
            f"attention scratch {part.shape} does not fit {n_heads} heads of {seq_len} positions"
        )
    span = seq_len if span is None else span
    if not 0 < span <= seq_len:
        raise PycalmError(f"attention span {span} is outside the cache's 1..{seq_len} positions")
    grid_chunks = -(-span // scratch.chunk)
    kern = attention_kernel(head_dim, n_heads // n_kv_heads, kv_dtype, scratch.chunk, THREADS)
    k64 = k_cache.view(np.int64)
    v64 = v_cache.view(np.int64)
    kern[(n_heads, grid_chunks), THREADS, stream](q, k64, v64, state, part, scratch.count, out, int32(window))
    return attention_bytes(span, n_heads, n_kv_heads, head_dim, kv_dtype, grid_chunks)


def attention_span(pos: int, chunk: int, seq_len: int) -> int:
    """The span (see attention) of a step at pos: chunk times the smallest power of two that
    covers pos + 1, at most seq_len. An engine captures one step a span: at most
    log2(seq_len / chunk) + 1 of them, and a grid at most twice the live chunks."""
    if not 0 <= pos < seq_len:
        raise PycalmError(f"position {pos} is outside the context of {seq_len} positions")
    span = chunk
    while span <= pos:
        span *= 2
    return min(span, seq_len)


def attention_bytes(
    n_pos: int, n_heads: int, n_kv_heads: int, head_dim: int, kv_dtype: str, n_chunks: int
) -> int:
    """Bytes from DRAM at n_pos attended positions (all chunks live: an upper bound)."""
    kv = n_pos * n_kv_heads * head_dim * 2 * (1 if kv_dtype == "fp8" else 2)
    partials = 2 * n_chunks * n_heads * (head_dim + 2) * 4 if n_chunks > 1 else 0
    return kv + partials + 2 * n_heads * head_dim * 4


_SIG = (
    "void(float32[::1], int64[:, ::1], int64[:, ::1], int32[::1], float32[:, :, ::1], int32[::1],"
    " float32[::1], int32)"
)


def _compile_check() -> list[tuple[object, str]]:
    """Every kernel variant the models in use need: head_dim 64 / 128, groups 1..8, both KV dtypes."""
    checks = []
    for kv_dtype in KV_DTYPES:
        for head_dim, group in ((64, 3), (64, 7), (64, 8), (128, 1), (128, 4)):
            chunk = attention_chunk_len(head_dim, kv_dtype)
            checks.append((attention_kernel(head_dim, group, kv_dtype, chunk, THREADS), _SIG))
    return checks


COMPILE_CHECK = _compile_check()
