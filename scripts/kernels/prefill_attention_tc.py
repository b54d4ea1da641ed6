"""tc16: the shipped tensor-core prefill attention (pycalm.kernels.prefill_attention) with q and p
rounded once to fp16, as most flash-attention kernels take them (the shipped kernel carries each
as two fp16 parts, hi + lo, at twice the mma work), checked against pycalm.reference.
prefill_attention_ref at its own bound and timed beside the shipped kernel (llm.c dev/cuda style;
scripts/kernels/prefill_attention.py has the other versions).

    python scripts/kernels/prefill_attention_tc.py            # check, then time against the shipped kernel
    NUMBA_ENABLE_CUDASIM=1 python scripts/kernels/prefill_attention_tc.py --tiny   # check only

The math is the shipped kernel's (its docstring): for query row t at position p = pos0 + t and
query head h of kv head g, softmax over keys j in [start, p] of q . k_j / sqrt(head_dim), times V.

Thread mapping (flash-attention 2 on mma.sync m16n8k16, fp16 operands, fp32 accumulators):
grid (n_kv_heads, ceil(T / POS)), 4 warps a block. A block takes BR = 64 (position, head) rows of
one kv head, row r = position t0 + r // group, head g group + r % group (POS = 64 / group
positions), so one K/V tile serves every head of the group; warp w owns rows 16 w .. 16 w + 15.

1. q rows times 1/sqrt(head_dim), rounded to fp16, into shared memory; each warp loads its A
   fragments of Q (16 x head_dim) into registers with ldmatrix (head_dim / 4 words a thread).
   Barrier; the buffer then holds K tiles.
2. a tile of BK = 64 keys: K rows as they are stored (key-major, 16-byte loads; e5m2 bytes made
   fp16 halves by prmt), V transposed (dim-major: two keys' halves of one dim in a word, prmt), so
   that both are the "col" B operand that ldmatrix reads without .trans. Keys past the block's
   last position are zero (their p is 0, and 0 times a stale row could be NaN). Barrier.
3. S = Q K^T: 8 n-tiles of 8 keys x head_dim / 16 k-steps of mma; a thread holds rows g and
   g + 8 (g = lane >> 2) and keys 2 (lane & 3), +1 of each n-tile.
4. masking (key after the row's position, before its window, row past T: p = 0) and the online
   softmax: the tile's row max over the thread's 16 values and the 4 threads of the row (xor
   shuffles 1, 2), m_new, alpha = exp(m - m_new), p = exp(s - m_new); l (the thread's part of the
   row sum) and O times alpha.
5. O += P V: the S accumulators of n-tiles 2 k and 2 k + 1, packed to fp16, are exactly the A
   fragment of k-step k (no shared memory); B fragments of V^T by ldmatrix. Barrier before the
   next tile's stores.
6. l summed over the row's 4 threads; out = O / l as fp16.

Shared memory: (BR or BK) x (head_dim + 8) halves for Q / K and head_dim x (BK + 8) halves for
V^T (rows padded by 16 bytes: the 8 rows of an ldmatrix fall in 8 distinct groups of 4 banks),
35 KB at head_dim 128. Registers: Q fragments head_dim / 4, S 32, O head_dim / 2 floats.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/kernels: prefill_attention

from numba import config as numba_config  # noqa: E402
from numba import cuda, float32, int32  # noqa: E402
from numba.cuda import libdevice  # noqa: E402
from prefill_attention import SEQ_LEN, config, random_cache, state_at  # noqa: E402

from pycalm import formats  # noqa: E402
from pycalm.config import ModelConfig  # noqa: E402
from pycalm.kernels.attention import KVCache  # noqa: E402
from pycalm.kernels.common import STATE_POS, fp16_encode, ldg128, prmt  # noqa: E402
from pycalm.kernels.prefill_attention import (  # noqa: E402
    _hi,
    _lo,
    prefill_attention,
    prefill_attention_flops,
)
from pycalm.kernels.tensorcore import ldmatrix_x4, mma_16816, pack_f16x2  # noqa: E402
from pycalm.reference import prefill_attention_ref  # noqa: E402

SIM = numba_config.ENABLE_CUDASIM
BR = 64  # (position, head) rows a block
BK = 64  # keys a tile
WARPS = 4
THREADS = 32 * WARPS
NEG = -1.0e30
PAD = 4  # words of padding a shared row (16 bytes)


@functools.cache
def tc_attention_kernel(head_dim: int, group: int, kv_dtype: str) -> object:
    D = head_dim
    KS = D // 16  # k-steps of Q K^T
    DN = D // 8  # n-tiles of O
    NS = BK // 8  # n-tiles of S
    PK = BK // 16  # k-steps of P V
    ROW = D // 2 + PAD  # words a Q / K row
    VROW = BK // 2 + PAD  # words a V^T row
    QK_WORDS = max(BR, BK) * ROW
    V_WORDS = D * VROW
    QF, SW, OW = KS * 4, NS * 4, DN * 4  # fragment words (compile-time sizes of local arrays)
    POS = BR // group  # positions a block
    FP8 = kv_dtype == "fp8"
    UNITS = D // 16 if FP8 else D // 8  # 16-byte loads a cache row
    E = 16 if FP8 else 8  # elements a load
    scale = float32(1.0 / math.sqrt(D))

    @cuda.jit(device=True, inline=True)
    def load_words(m, row, u, w):  # noqa: ANN001, ANN202
        """16-byte unit u of cache row `row` (kv head g's units start at g UNITS) as fp16 words into w[0 .. E/2): 8 fp16 or 16 e5m2 (each
        byte the top byte of a half)."""
        a, b = ldg128(m, row, u)
        if FP8:
            lo0, hi0, lo1, hi1 = _lo(a), _hi(a), _lo(b), _hi(b)
            w[0] = prmt(lo0, int32(0), int32(0x1404))
            w[1] = prmt(lo0, int32(0), int32(0x3424))
            w[2] = prmt(hi0, int32(0), int32(0x1404))
            w[3] = prmt(hi0, int32(0), int32(0x3424))
            w[4] = prmt(lo1, int32(0), int32(0x1404))
            w[5] = prmt(lo1, int32(0), int32(0x3424))
            w[6] = prmt(hi1, int32(0), int32(0x1404))
            w[7] = prmt(hi1, int32(0), int32(0x3424))
        else:
            w[0], w[1], w[2], w[3] = _lo(a), _hi(a), _lo(b), _hi(b)

    @cuda.jit(fastmath=False)
    def kernel(q, k64, v64, state, out, window):  # noqa: ANN001, ANN202
        qk = cuda.shared.array(QK_WORDS, int32)  # Q rows, then K tiles: (rows, D) fp16, padded
        vt = cuda.shared.array(V_WORDS, int32)  # V^T tile: (D, BK) fp16, padded
        qf = cuda.local.array(QF, int32)  # this warp's Q A fragments
        s = cuda.local.array(SW, float32)  # S C fragments
        o = cuda.local.array(OW, float32)  # O C fragments
        w = cuda.local.array(8, int32)
        w2 = cuda.local.array(8, int32)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t4 = lane >> 2, lane & 3
        kvh = cuda.blockIdx.x
        n_rows = q.shape[0]
        n_blocks = (n_rows + POS - 1) // POS
        t0 = (n_blocks - 1 - cuda.blockIdx.y) * POS  # the longest blocks first
        pos0 = state[STATE_POS]
        first_pos = pos0 + t0
        last_t = min(t0 + POS, n_rows) - 1
        last_pos = pos0 + last_t
        kfirst = 0 if window <= 0 else max(0, first_pos + 1 - window)

        # 1. Q rows (scaled, fp16) into qk, then this warp's A fragments
        for i in range(tid, BR * (D // 2), THREADS):
            r, c = i // (D // 2), i % (D // 2)
            tq = t0 + r // group
            h = kvh * group + r % group
            word = int32(0)
            if tq < n_rows:
                word = pack_f16x2(q[tq, h * D + 2 * c] * scale, q[tq, h * D + 2 * c + 1] * scale)
            qk[r * ROW + c] = word
        cuda.syncthreads()  # Q staged
        a_row = (warp * 16 + (lane & 15)) * ROW + 4 * (lane >> 4)
        for kk in range(KS):
            qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3] = ldmatrix_x4(qk, a_row + 8 * kk)
        for i in range(DN * 4):
            o[i] = float32(0.0)
        m0, m1 = float32(NEG), float32(NEG)  # running max of rows g, g + 8
        l0, l1 = float32(0.0), float32(0.0)  # this thread's part of their sums
        r0 = warp * 16 + g
        r1 = r0 + 8
        p_r0 = pos0 + t0 + r0 // group
        p_r1 = pos0 + t0 + r1 // group
        ok0 = t0 + r0 // group < n_rows
        ok1 = t0 + r1 // group < n_rows
        b_row = ((lane & 7) + 8 * (lane >> 4)) * ROW + 4 * ((lane >> 3) & 1)
        v_row = ((lane & 7) + 8 * (lane >> 4)) * VROW + 4 * ((lane >> 3) & 1)
        cuda.syncthreads()  # every warp holds its Q fragments: qk takes K tiles

        j0 = (kfirst // BK) * BK
        while j0 <= last_pos:
            # 2. K tile (key-major) and V^T tile (dim-major); keys past last_pos are zero
            for i in range(tid, BK * UNITS, THREADS):
                kr, u = i // UNITS, i % UNITS
                key = j0 + kr
                if key <= last_pos:
                    load_words(k64, key, kvh * UNITS + u, w)
                else:
                    for e in range(E // 2):
                        w[e] = int32(0)
                for e in range(E // 2):
                    qk[kr * ROW + u * (E // 2) + e] = w[e]
            for i in range(tid, (BK // 2) * UNITS, THREADS):
                kp, u = i // UNITS, i % UNITS  # keys 2 kp, 2 kp + 1; dims u E ..
                key = j0 + 2 * kp
                for e in range(E // 2):
                    w[e] = int32(0)
                    w2[e] = int32(0)
                if key <= last_pos:
                    load_words(v64, key, kvh * UNITS + u, w)
                if key + 1 <= last_pos:
                    load_words(v64, key + 1, kvh * UNITS + u, w2)
                for e in range(E // 2):
                    d = u * E + 2 * e
                    vt[d * VROW + kp] = prmt(w[e], w2[e], int32(0x5410))  # dim d: keys 2kp, 2kp+1
                    vt[(d + 1) * VROW + kp] = prmt(w[e], w2[e], int32(0x7632))  # dim d + 1
            cuda.syncthreads()  # the tile is staged

            # 3. S = Q K^T
            for i in range(NS * 4):
                s[i] = float32(0.0)
            for kk in range(KS):
                for p in range(NS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(qk, b_row + p * 16 * ROW + 8 * kk)
                    n = 2 * p
                    s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3] = mma_16816(
                        qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3], b0, b1,
                        s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3],
                    )  # fmt: skip
                    n = 2 * p + 1
                    s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3] = mma_16816(
                        qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3], b2, b3,
                        s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3],
                    )  # fmt: skip

            # 4. mask, online softmax
            mx0, mx1 = float32(NEG), float32(NEG)
            for n in range(NS):
                for c in range(2):
                    key = j0 + 8 * n + 2 * t4 + c
                    if not (ok0 and key <= p_r0 and (window <= 0 or key > p_r0 - window)):
                        s[4 * n + c] = float32(NEG)
                    if not (ok1 and key <= p_r1 and (window <= 0 or key > p_r1 - window)):
                        s[4 * n + 2 + c] = float32(NEG)
                    mx0 = max(mx0, s[4 * n + c])
                    mx1 = max(mx1, s[4 * n + 2 + c])
            mx0 = max(mx0, cuda.shfl_xor_sync(0xFFFFFFFF, mx0, 1))
            mx0 = max(mx0, cuda.shfl_xor_sync(0xFFFFFFFF, mx0, 2))
            mx1 = max(mx1, cuda.shfl_xor_sync(0xFFFFFFFF, mx1, 1))
            mx1 = max(mx1, cuda.shfl_xor_sync(0xFFFFFFFF, mx1, 2))
            n0, n1 = max(m0, mx0), max(m1, mx1)
            al0, al1 = libdevice.fast_expf(m0 - n0), libdevice.fast_expf(m1 - n1)
            m0, m1 = n0, n1
            l0 *= al0
            l1 *= al1
            for i in range(DN):
                o[4 * i] *= al0
                o[4 * i + 1] *= al0
                o[4 * i + 2] *= al1
                o[4 * i + 3] *= al1
            for n in range(NS):
                for c in range(2):
                    e0 = s[4 * n + c]
                    e1 = s[4 * n + 2 + c]
                    p0 = float32(0.0) if e0 <= float32(NEG) else libdevice.fast_expf(e0 - m0)
                    p1 = float32(0.0) if e1 <= float32(NEG) else libdevice.fast_expf(e1 - m1)
                    s[4 * n + c] = p0
                    s[4 * n + 2 + c] = p1
                    l0 += p0
                    l1 += p1

            # 5. O += P V
            for kk in range(PK):
                a0 = pack_f16x2(s[8 * kk], s[8 * kk + 1])  # row g, keys 16 kk + 2 t4 ..
                a1 = pack_f16x2(s[8 * kk + 2], s[8 * kk + 3])  # row g + 8
                a2 = pack_f16x2(s[8 * kk + 4], s[8 * kk + 5])  # row g, keys 16 kk + 8 + 2 t4 ..
                a3 = pack_f16x2(s[8 * kk + 6], s[8 * kk + 7])  # row g + 8
                for p in range(DN // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(vt, v_row + p * 16 * VROW + 8 * kk)
                    n = 2 * p
                    o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3] = mma_16816(
                        a0, a1, a2, a3, b0, b1, o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3]
                    )
                    n = 2 * p + 1
                    o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3] = mma_16816(
                        a0, a1, a2, a3, b2, b3, o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3]
                    )
            cuda.syncthreads()  # every warp is done with the tile before the next one's stores
            j0 += BK

        # 6. the row sums, out = O / l
        l0 += cuda.shfl_xor_sync(0xFFFFFFFF, l0, 1)
        l0 += cuda.shfl_xor_sync(0xFFFFFFFF, l0, 2)
        l1 += cuda.shfl_xor_sync(0xFFFFFFFF, l1, 1)
        l1 += cuda.shfl_xor_sync(0xFFFFFFFF, l1, 2)
        if ok0:
            tq, h = t0 + r0 // group, kvh * group + r0 % group
            inv = float32(1.0) / l0
            for n in range(DN):
                out[tq, h * D + 8 * n + 2 * t4] = fp16_encode(o[4 * n] * inv)
                out[tq, h * D + 8 * n + 2 * t4 + 1] = fp16_encode(o[4 * n + 1] * inv)
        if ok1:
            tq, h = t0 + r1 // group, kvh * group + r1 % group
            inv = float32(1.0) / l1
            for n in range(DN):
                out[tq, h * D + 8 * n + 2 * t4] = fp16_encode(o[4 * n + 2] * inv)
                out[tq, h * D + 8 * n + 2 * t4 + 1] = fp16_encode(o[4 * n + 3] * inv)

    return kernel


def tc_attention(
    q: object, cache: KVCache, state: object, out: object, cfg: ModelConfig, stream: object
) -> None:
    """out = the block-causal attention of q's T rows (as pycalm.kernels.prefill_attention)."""
    group = cfg.n_heads // cfg.n_kv_heads
    if cfg.head_dim % 16 or BR % group:
        sys.exit(f"head_dim {cfg.head_dim} (a multiple of 16) and group {group} (a divisor of {BR})")
    kernel = tc_attention_kernel(cfg.head_dim, group, cache.dtype)
    grid = (cfg.n_kv_heads, -(-q.shape[0] // (BR // group)))
    kernel[grid, THREADS, stream](
        q, cache.k.view(np.uint64), cache.v.view(np.uint64), state, out, int32(cfg.sliding_window)
    )


def check(cache: KVCache, cfg: ModelConfig, n_rows: int, pos0: int) -> float:
    """Worst |kernel - reference| / (2^-9 |ref| + 2^-9 max |ref|): fp16 Q, K, P and V operands
    (the SIMT kernel keeps Q and P in fp32) carry about 2^-11 each into the output."""
    q = (np.random.default_rng(1).standard_normal((n_rows, cfg.q_dim)) * 0.3).astype(np.float32)
    out = cuda.to_device(np.full((n_rows, cfg.q_dim), np.nan, np.float16))
    tc_attention(cuda.to_device(q), cache, state_at(pos0), out, cfg, stream=0)
    cuda.synchronize()
    k, v = (formats.decode(a.copy_to_host(), cache.dtype).astype(np.float32) for a in (cache.k, cache.v))
    want = prefill_attention_ref(q, k, v, pos0, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.sliding_window)
    got = out.copy_to_host().astype(np.float32)
    err = np.abs(got - want) / (2.0**-9 * np.abs(want) + 2.0**-9 * np.abs(want).max())
    return float(np.nanmax(np.where(np.isnan(err), np.inf, err)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="check only, at tiny shapes (simulator)")
    ap.add_argument("--rows", default="512,2048,4000", help="prompt lengths T to time")
    args = ap.parse_args()
    tiny = args.tiny or SIM
    shapes = {"tiny": (4, 2, 32, 0), "tiny-window": (8, 2, 16, 24)} if tiny else {
        "Llama-3-8B": (32, 8, 128, 0), "TinyLlama": (32, 4, 64, 0), "Mistral-window": (32, 8, 128, 700)}  # fmt: skip
    seq_len = 160 if tiny else SEQ_LEN
    failed = []
    for name, (n_heads, n_kv_heads, head_dim, window) in shapes.items():
        cfg = config(n_heads, n_kv_heads, head_dim)
        if window:
            import dataclasses

            cfg = dataclasses.replace(cfg, sliding_window=window)
        for kv_dtype in ("fp16", "fp8"):
            cache = random_cache(seq_len, cfg.kv_dim, kv_dtype, seed=7)
            cases = [(70, 37), (1, 100)] if tiny else [(200, 60), (1000, 0), (1, 3000)]
            for n_rows, pos0 in cases:
                err = check(cache, cfg, n_rows, pos0)
                status = "ok" if err <= 1 else "FAILED"
                print(
                    f"{name:14s} {kv_dtype:5s} T {n_rows:4d} after {pos0:4d}: check {err:.3f} {status}",
                    flush=True,
                )
                if err > 1:
                    failed.append(f"{name} {kv_dtype} T {n_rows} pos0 {pos0}: {err:.3f}")
            if tiny or window:
                continue
            from gpubench import graph_seconds

            stream = cuda.stream()
            for n_rows in map(int, args.rows.split(",")):
                q = cuda.to_device(
                    (np.random.default_rng(2).standard_normal((n_rows, cfg.q_dim)) * 0.3).astype(np.float32)
                )
                out = cuda.device_array((n_rows, cfg.q_dim), np.float16)
                state = state_at(0)
                flops = prefill_attention_flops(n_rows, 0, cfg)
                for label, launch in (
                    (
                        "shipped",
                        functools.partial(prefill_attention, q, cache, state, out, cfg, stream=stream),
                    ),
                    ("tc16", functools.partial(tc_attention, q, cache, state, out, cfg, stream)),
                ):
                    sec = graph_seconds(stream, launch, 7)
                    print(f"{name:14s} {kv_dtype:5s} {label:7s} T {n_rows:5d}: {sec * 1e3:8.3f} ms "
                          f"{flops / sec / 1e12:7.1f} TFLOP/s", flush=True)  # fmt: skip
    if failed:
        sys.exit("tensor-core prefill attention off the reference:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
